"""What the cache holds.

- `stamps`: what torch writes inside entries that says which system key / torch build made them;
- `fingerprint`: a Merkle content hash (xxh3-128) with a stat-index sidecar for fast re-runs;
- `verify`: unusable entries, entries built for another system key, pickles that do not scan.

May import: `local`, `trust` and compilewatch's top-level basics.
"""
