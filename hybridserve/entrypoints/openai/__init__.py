"""The OpenAI-compatible HTTP server, a file per responsibility.

app.py builds the FastAPI app and its ServerContext (context.py: the engine handle, the
limits, admission and drain), which every route module receives: completions.py,
chat.py, tokenize.py. The CLI command that starts the server (`hybridserve serve`) stays
one level up, in entrypoints/; nothing here imports the CLI.
"""
