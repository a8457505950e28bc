"""Real models and silent-bug models through the matrix (see README.md here)."""

#: The stages every zoo model is checked at: one pass under no_grad, and one training step
#: (the loss and every gradient judged against float64).
STAGES = ("forward", "train")
