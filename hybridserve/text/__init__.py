"""Text services shared by the executors and the engine: the model's tokenizer, with its chat
prompts and incremental detokenizing (tokenizer.py), and the grammar backend that compiles
structured-output constraints over the tokenizer's vocabulary (structured_output.py).
"""
