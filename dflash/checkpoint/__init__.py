"""What a run leaves on disk and reads back: checkpoints and exports, the run directory's lock, and
the config of a resumed run."""
