"""hybridserve: an LLM serving engine for hybrid-attention models."""

__version__ = "0.1.0"
