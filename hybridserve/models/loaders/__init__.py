"""Getting weights in: HF directories, safetensors, GGUF files, the Hub, the default model."""
