"""Model architectures: the decoder and each family's own blocks and config extras."""
