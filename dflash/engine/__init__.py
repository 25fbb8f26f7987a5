"""Several devices in one process: the threaded engine (replicas, routing, stall watch, compile
safety), the DFlash program it runs, the warm-workload plugin, and a toy program for tests."""
