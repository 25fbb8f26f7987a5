"""Trace & threads: who entered `torch.fx.Tracer.trace` and held the FX tracing state, from which
thread, and what it broke. One owner per patch point (tracehooks, fxpatch), the version layer
(torchcompat), the watcher and its events and verdict patterns, the guard that fixes the race,
targets (what `probe` and `warm` compile), `compilewatch run`'s runner and boot hook, stacks, counters and timelines.
"""
