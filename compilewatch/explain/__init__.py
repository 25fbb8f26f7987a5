"""Why did it miss: every FX-graph / AOTAutograd cache lookup recorded with its key's parts, and every
miss explained by the parts that changed.

- `parts`: torch's "[hash] name: value" debug lines turned into named parts (digest + short value),
  grouped so that what rarely changes (inductor config, system, torch build) is stored once;
  plain words for each part, and the order in which causes are named (worst first).
- `store`: compilewatch's own key store beside the cache dir (`<parent>/.<name>.compilewatch-keys/`):
  one JSON-lines file, format-versioned, bounded (compacted through a temp file + rename), refused
  when other users can write it.
- `record`: the hook per torch version (`FxGraphCache.load_with_key`, `AOTAutogradCache._lookup`),
  installed only while compilewatch watches a process and removed after.
- `explain`: a miss compared with its closest recorded entries; causes grouped and counted; the
  last run of a store; doctor's one line.
- `against`: `cache explain --against OTHER`: why another cache dir's entries would not be hit here.
- `timing`: warm but slow: where a watched process's compile time went, phase by phase (dynamo tracing,
  AOTAutograd lookup, FX-graph load, kernel load, autotune, ...), from the steps torch times itself
  (`dynamo_timed` through its ChromiumEventLogger); a phase a torch does not time is "not available".

May import: compilewatch's top-level basics (`errors`, `fsutil`, `inputs`, `torchinfo`, `serialize`)
and `compilewatch.cache.*`; never `compilewatch.tracing` (the watcher calls into this room, so the
arrow must not point back), `cli/` or `dflash/`. Nothing here imports torch at import time.
"""

from __future__ import annotations
