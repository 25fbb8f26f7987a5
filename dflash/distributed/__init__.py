"""Several processes (torchrun): the process group and rank facts, one rank's training, and the
per-rank report."""
