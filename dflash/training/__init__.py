"""The training loop on one device (Trainer), its lr schedule, its metrics log, what a run returns,
and the dry run that checks a config without training."""
