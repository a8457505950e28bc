"""Real models and silent-bug models through the matrix (see README.md here)."""
