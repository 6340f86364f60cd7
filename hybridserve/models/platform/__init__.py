"""What the machine offers and how the process uses it: CPU features, the C heap."""
