"""masklab."""
