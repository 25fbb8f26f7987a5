"""The inductor cache as a managed artifact, in five rooms by capability. Each room imports only the
rooms before it in this list (and compilewatch's top-level basics); tests/test_layering.py checks it,
string imports included, and that no two files import each other in a cycle.

- `trust/`: deciding what may be believed about bytes from elsewhere: the pickle scan, the FX-source
  check, this machine's signing key and trust store, an archive's signed statement and its verdict,
  the record of backup dirs compilewatch made. Imports no other cache room.
- `local/`: the cache dir on this machine: where it is, its sub-caches, the one file walk, the lock,
  the two-rename swap, busy writers, triton's absolute paths; ls, du, clear, prune.
- `content/`: what the cache holds: the stamps torch writes into entries, the Merkle fingerprint,
  `verify --dir`.
- `archive/`: portable archives: the format and its one-pass reads, save, load, `verify ARCHIVE`, the
  tar bounds, `cache diff` (which reads dirs, fingerprints and archives alike).
- `remote/`: torch's Redis remote caches: the key space, status and verify, push/pull/clear.

Nothing here imports torch at import time; functions that need torch import it lazily.
"""

from __future__ import annotations
