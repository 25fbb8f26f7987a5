"""The training loop on one device (Trainer), how one is built from a config (build), its lr
schedule, its metrics log, what a run returns, and the dry run that checks a config without training."""
