"""The built-in cases: one module per failure pattern, each registering one Case."""
