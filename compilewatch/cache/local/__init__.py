"""The cache dir on this machine.

- `layout`: where it is, its sub-caches, how a path maps to an entry, the one file walk;
- `lock`: the inter-process lock compilewatch's own operations take (and where its file lives);
- `swap`: the two-rename swap with a journal, recovered after a kill; `busy`: writers in flight;
- `relocate`: triton's absolute kernel paths rewritten when a cache moves;
- `manage`: ls, du, clear (with a recorded backup), prune.

May import: `trust` (clear records its backup there) and compilewatch's top-level basics.
"""
