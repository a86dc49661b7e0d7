"""Toy policies: a frozen Zipf prior plus a trainable part (tabular, or a shared network).
Imports ``problems`` (for the encoders) and the core."""
