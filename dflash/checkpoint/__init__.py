"""What a run leaves on disk and reads back: checkpoints and exports, the run directory's lock, and
the config of a resumed run. The training side uses two doors: `rundir` when a run starts (checks,
lock, leftovers, the verified resume state) and `writer.Saver` while it runs (saves, disk plan)."""
