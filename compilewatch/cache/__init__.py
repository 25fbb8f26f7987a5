"""The inductor cache as a managed artifact: locate, fingerprint, verify, archive, manage.

Modules (each named after what it holds):
- `layout`: where the cache is, its sub-caches, how a relative path maps to a sub-cache and an entry,
  and the one file walk every other module uses.
- `stamps`: what torch writes inside entries that says which system key / torch build made them.
- `fingerprint`: a Merkle content hash (xxh3-128) with a stat index sidecar for fast re-runs.
- `verify`: unusable entries and entries built for another system key; `--fix` moves them aside.
- `archive`: portable `tar` (+ zstd or gzip) archives with a manifest, env summary and Mega-Cache.
- `provenance`: who made an archive (the signed statement `save` writes; `check_provenance`'s verdict:
  own, trusted or foreign) — what load, verify and a remote push decide by.
- `keys`: this machine's Ed25519 signing key and the trust store of keys the user accepts.
- `archive_check`: `cache verify ARCHIVE` (provenance, then every pickle scanned; nothing extracted).
- `picklescan`: a pickle's globals and calls checked without unpickling (the second line);
  `fxsource`: the FX-source check for the one source-executing call torch's pickles make.
- `relocate`: triton's absolute kernel paths, rewritten when a cache moves (load does it).
- `manage`: clear (with backup), prune (LRU), ls, du, diff.
- `lock`: the inter-process lock compilewatch's own cache operations take.

Nothing here imports torch at import time; functions that need torch import it lazily.
"""

from __future__ import annotations
