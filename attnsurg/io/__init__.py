"""Loading checkpoints, fetching built-in assets, writing checkpoints."""
