"""What torch writes inside cache entries that tells which system and torch build made them.

Read from torch 2.13's source (`torch/_inductor/codecache.py`, `compile_fx.py`,
`_functorch/_aot_autograd/autograd_cache.py`) and checked on a real CPU cache:

- An FX-graph entry is a pickled `CompiledFxGraph`. On a cache miss inductor stores on it
  `_fx_graph_cache_debug_lines`: one line per input of the cache key, written by
  `FxGraphCachePickler.debug_lines` as `"[<hash of value>] <name>: <value>"`. Two of them matter:
  - `system_info[hash]: <64 hex>` is `CacheBase.get_system()["hash"]`, the system key itself
    (GPU name + CUDA version + triton key; without a GPU a CPU-only hash, a constant on torch 2.13
    and a hash of the triton version on 2.15 — read either way, never re-derived; checked on 2.15 CPU).
  - `[<h>] torch_version: ...`, where `<h>` is the pickler hash of `torch_key()` (torch's version plus
    a hash of its source files): the torch build that made the entry.
- An AOTAutograd entry (a pickled `AOTAutogradResult`) carries the same lines for its forward and
  backward graphs in `compiled_fw.fx_graph_cache_info` / `compiled_bw.fx_graph_cache_info`, next to the
  FX-graph keys it needs.
- `cache/<64 hex>` files are CacheBase's local caches, named by the system key they belong to.

The strings sit in the pickles as plain UTF-8, so a regex over the raw bytes finds them: no unpickling,
no torch import, no GPU. Entries written by a torch that does not store debug lines give no stamp
(reported as "unknown", never as foreign).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

_SYSTEM_MARK = b"system_info[hash]: "
_SYSTEM_RE = re.compile(rb"[0-9a-f]{64}")
_TORCH_MARK = b"] torch_version: "
_TORCH_RE = re.compile(rb"\[([a-z0-9]{40,64})$")
_LOCAL_CACHE_RE = re.compile(r"^cache/([0-9a-f]{64})$")
STAMPED_SUBCACHES = ("fxgraph", "aotautograd")


@dataclass(frozen=True, slots=True)
class Stamp:
    """The system key and torch-build hash found in one entry (None: the entry does not say)."""

    system_key: str | None
    torch_hash: str | None


NO_STAMP = Stamp(None, None)


def stamp_of(rel: str, content: bytes | None) -> Stamp:
    """The stamp of the file at `rel` (relative to the cache root) with bytes `content`."""
    m = _LOCAL_CACHE_RE.match(rel)
    if m:
        return Stamp(m.group(1), None)
    if content is None or rel.split("/", 1)[0] not in STAMPED_SUBCACHES:
        return NO_STAMP
    return Stamp(_after(content, _SYSTEM_MARK), _before(content, _TORCH_MARK))


def _after(content: bytes, mark: bytes) -> str | None:
    i = content.find(mark)  # bytes.find is a fast scan; a regex over MBs of pickle is not
    if i < 0:
        return None
    m = _SYSTEM_RE.match(content, i + len(mark))
    return m.group(0).decode() if m else None


def _before(content: bytes, mark: bytes) -> str | None:
    i = content.find(mark)
    if i < 0:
        return None
    m = _TORCH_RE.search(content[max(0, i - 65):i])
    return m.group(1).decode() if m else None


def needs_content(rel: str) -> bool:
    """True when `stamp_of` looks at the file's bytes (so hashing should keep them for it)."""
    return rel.split("/", 1)[0] in STAMPED_SUBCACHES


@functools.lru_cache(maxsize=1)
def current_torch_hash() -> str | None:
    """The hash inductor writes after `torch_version:` for the installed torch, or None if unknown.

    Computed with torch's own pickler (`FxGraphCachePickler.get_hash(torch_key())`), the same call
    that produced the entries' debug lines. Private torch API: any failure means "cannot check".
    """
    try:
        import torch
        from torch._inductor.codecache import FxGraphCachePickler, torch_key

        gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
        return str(FxGraphCachePickler(gm).get_hash(torch_key()))
    except Exception:  # noqa: BLE001 - a torch without this API: the check is skipped, not failed
        return None
