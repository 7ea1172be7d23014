"""Training: the loop, optimizer and LR schedule, checkpoints, metrics, and the `scalenlp train` command."""
