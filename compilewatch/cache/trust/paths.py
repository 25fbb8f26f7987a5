"""What torch later makes a file path of, in a state a pickle restores (session 16).

Some of torch's cached objects keep the pieces of a path and write to it after loading, with content the
pickle holds too, so the pickle would choose where torch writes:

- `AutotuneCache.local_cache` is `(LocalAutotuneCache(), <path>)`: `AutotuneCache.save` -- the pickled
  CachingAutotuner's `save_cache_hook`, called when the kernel next autotunes -- writes the best config
  there as JSON (`LocalCacheBackend._put`: makedirs, write_atomic; 2.11: `_LocalAutotuneCacheBackend`),
  and `_read` reads it. A path of `~/.bashrc` was overwritten (tests/test_picklescan_s16.py). Its
  `artifact_recorder` (2.13, 2.15) files what it reads and saves for the Mega-Cache under its own key,
  which `load_cache_artifacts` writes to `<cache dir>/<key>`.
- `CompiledFxGraph.write_to_disk()`, on every FX-graph cache hit (`after_deserialization`), writes its
  `source_code` to `get_path(cache_key, "py")` = `os.path.join(<cache dir>, key[1:3], key + ".py")` if that
  is missing: a key of "/home/u/.local/lib/python3.11/site-packages/sitecustomize" wrote a module every
  later Python runs.
- `StaticTritonCompileResult.reload_cubin_path()`, run for each statically launched kernel as
  `TritonBundler.load_autotuners` loads an FX-graph entry (CUDA), writes the launcher's `cubin_raw` to
  `os.path.join(triton_cache_dir(compile_meta["device"]), triton_hash_to_path_key(kernel.hash),
  kernel.name + ".cubin")` if that is missing: an absolute `name`, or a `device` of "/somewhere", put it
  anywhere (a hash that is not hex is used as it is: "../..").

The rules take the form torch makes, and no more:
- a local_cache is None or `(LocalAutotuneCache(), path)` whose last two components are
  `<2 characters>/<64 hex digits>.best_config` (the kernel's code directory `<cache dir>/<2>/`, and
  torch's sha256 name), with no '.', '..' or empty component. The directory above is not checked: a cache
  moved from another machine names that machine's cache dir, and torch writes there too; so a pickle can
  at most make a `<hex>.best_config` file (JSON) in a directory it names, never a file of another name.
  A recorder's key is the same two components, its type "autotune".
- a CompiledFxGraph's `cache_key` is letters, digits and '_' (torch's: "f" + base32 of a sha256);
- a launcher's `name` is an identifier (a triton kernel's function name) and its `hash` hex digits (triton's
  sha256); a compile result's `compile_meta["device"]` an int or None, checked at STOP (the dict is kept
  by reference: SETITEMs after the BUILD still reach torch).
"""
from __future__ import annotations

import inspect
import re

from compilewatch.cache.trust.stackmodel import _NONE, _Dict, _Num, _Obj, _Seq, _Str, describe

# the file torch keeps a kernel's best config in: `os.path.join(os.path.dirname(<kernel .py>), <sha256 hex>
# + ".best_config")` (2.11: f"{dirname}/..."), the kernel's code being `<cache dir>/<2 characters>/c<hash>.py`
_BEST_CONFIG = re.compile(r"[0-9a-z]{2}/[0-9a-f]{64}\.best_config")
_LOCAL_AUTOTUNE = "LocalAutotuneCache"  # torch._inductor.remote_cache's (2.13, 2.15), runtime.autotune_cache's (2.11)
_AUTOTUNE_CACHE = "torch._inductor.runtime.autotune_cache.AutotuneCache"
RECORDER = "torch.compiler._cache.CacheArtifactRecorder"
_HEX = re.compile(r"[0-9a-f]+")
_KEY = re.compile(r"[A-Za-z0-9_]{3,256}")  # an FX-graph key: "f" + base32 of a sha256
CUBIN_DEVICE = "<a compile_meta whose device names the cubin's directory>"  # checked at STOP (picklescan)


def local_cache_refused(value: object) -> str | None:
    """Why an AutotuneCache's `local_cache` is not what torch makes, or None."""
    if value is _NONE:
        return None
    items = value.items if isinstance(value, _Seq) else None
    if items is None or len(items) != 2:
        return f"of {describe(value)}: only (LocalAutotuneCache(), <its best-config path>), which torch unpacks"
    cache, path = items
    if not (isinstance(cache, _Obj) and cache.cls.__name__ == _LOCAL_AUTOTUNE
            and cache.cls.__module__.startswith("torch._inductor.")):
        return f"holding {describe(cache)}, not torch's LocalAutotuneCache: torch reads and writes best configs through it"
    if not isinstance(path, _Str):
        return f"whose path is {describe(path)}, not a string"
    p = str(path)
    parts = p.split("/")
    if len(p) > 4096 or any(ord(c) < 32 for c in p) or "\\" in p or parts[0] in (".", "..") or any(
            x in ("", ".", "..") for x in parts[1:]) or not _BEST_CONFIG.fullmatch("/".join(parts[-2:])):
        return (f"path {p[:120]!r}, not a file torch makes (<cache dir>/<2 characters>/<64 hex digits>.best_config, "
                "no '..'): torch writes the kernel's best config to that path when it autotunes")
    return None


def recorder_refused(state: object) -> str | None:
    """A CacheArtifactRecorder (2.13, 2.15) is what `AutotuneCache.create` makes: ("autotune", the last two
    components of its best-config path). `record` adds each best config torch reads or saves to the
    Mega-Cache under them; `torch.compiler.load_cache_artifacts` then writes it to `<cache dir>/<key>`
    (AutotuneCacheArtifact.populate_cache): a key of '../../x' would write outside the cache there."""
    named = _named(state) or {}
    kind, key = named.get("artifact_type"), named.get("key")
    if not (isinstance(kind, _Str) and str(kind) == "autotune" and isinstance(key, _Str)
            and _BEST_CONFIG.fullmatch(str(key))):
        return (f"BUILD of {RECORDER} with other than ('autotune', <2 characters>/<64 hex digits>.best_config): "
                "torch records best configs under that key, and the Mega-Cache writes them to <cache dir>/<key>")
    return None


def _has(cls: type, name: str) -> bool:
    return inspect.getattr_static(cls, name, None) is not None


def _named(state: object) -> dict[str, object] | None:
    """What a builtin restore sets of the keys `paths` asks about: a dict state's, then a slot state's
    (setattr, after it); None if a part is not a dict of string keys (the scan cannot read it)."""
    parts = state.items if isinstance(state, _Seq) and len(state.items) == 2 else [state]
    named: dict[str, object] = {}
    for d in parts:
        if d is _NONE:
            continue
        if not (isinstance(d, _Dict) and d.str_keys):
            return None
        named.update(d.named or {})
    return named


def refused(obj: object, state: object, later: list[tuple[object, object]]) -> str | None:
    """Why BUILD(obj, state), which the stack model admitted, names a path torch writes that torch would not
    make, or None. A compile_meta (kept by reference) goes to `later`, checked again at STOP."""
    if not isinstance(obj, _Obj):
        return None
    cls = obj.cls
    name = f"{cls.__module__}.{cls.__qualname__}"
    named = _named(state)
    if named is None:  # the scan cannot read it key by key: refused where torch makes a path of it
        if name in (_AUTOTUNE_CACHE, RECORDER) or (cls.__module__.startswith("torch._inductor.") and any(
                _has(cls, m) for m in ("write_to_disk", "reload_cubin_from_raw", "reload_cubin_path"))):
            return f"BUILD of {name} with a state the scan cannot read key by key: torch makes a path of it"
        return None
    if name == _AUTOTUNE_CACHE:  # its restore takes a dict only (stackmodel._restore_acts)
        why = local_cache_refused(named.get("local_cache", _NONE))
        return f"BUILD of {name} with a local_cache {why}" if why else None
    if name == RECORDER:
        return recorder_refused(state)
    if not cls.__module__.startswith("torch._inductor."):
        return None
    if _has(cls, "write_to_disk"):  # CompiledFxGraph
        key = named.get("cache_key", _NONE)
        if not (key is _NONE or (isinstance(key, _Str) and _KEY.fullmatch(str(key)))):
            return (f"BUILD of {name} with a cache_key of {describe(key)[:120]}, not a key torch makes: on a cache "
                    "hit torch writes its source_code to <cache dir>/<key[1:3]>/<key>.py, a path of the key's naming")
    if _has(cls, "reload_cubin_from_raw"):  # a static launcher: `name` and `hash` make the cubin's path
        kernel, digest = named.get("name", _NONE), named.get("hash", _NONE)
        if not (kernel is _NONE or (isinstance(kernel, _Str) and str(kernel).isidentifier())):
            return (f"BUILD of {name} with a name of {describe(kernel)[:120]}, not a kernel's identifier: torch writes "
                    "its cubin_raw to <triton cache>/<hash>/<name>.cubin as it loads the entry")
        if not (digest is _NONE or (isinstance(digest, _Str) and _HEX.fullmatch(str(digest)))):
            return (f"BUILD of {name} with a hash of {describe(digest)[:120]}, not hex digits: torch makes a "
                    "directory of it for the cubin it writes")
    if _has(cls, "reload_cubin_path"):  # a static compile result: compile_meta["device"] names the directory
        meta = named.get("compile_meta", _NONE)
        if not (meta is _NONE or isinstance(meta, _Dict)):
            return f"BUILD of {name} with a compile_meta of {describe(meta)}: torch makes a path of its device"
        if isinstance(meta, _Dict):
            later.append((meta, CUBIN_DEVICE))
    return None


def device_refused(meta: object) -> str | None:
    """At STOP: a compile_meta's `device` is an int or None (`triton_cache_dir(device)` is <cache>/triton/<device>)."""
    device = ((meta.named or {}) if isinstance(meta, _Dict) else {}).get("device", _NONE)
    if device is _NONE or (isinstance(device, _Num) and type(device.value) is int):
        return None
    return (f"a static compile result's compile_meta with a device of {describe(device)[:120]}, not an int: torch "
            "writes the kernel's cubin under <cache>/triton/<device>/ as it loads the entry")
