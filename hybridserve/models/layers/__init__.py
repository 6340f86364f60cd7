"""Layers and kernels the architectures are built from: linears (dense, int8), the output
head and its span summaries, rotary embeddings, norms."""
