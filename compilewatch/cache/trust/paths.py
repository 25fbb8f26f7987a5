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

- (session 16b) a CachingAutotuner's `filename`: as a loaded entry's static autotuner is first used
  (recheck_autotune_cache), torch reads the best config at `<dirname(filename)>/<hex>.best_config` and files it
  for the Mega-Cache under `<basename(dirname(filename))>/<hex>.best_config` (2.11, 2.13, 2.15): a filename of
  `<dir>/../c<hash>.py` had a later Mega-Cache load write outside its cache dir. Nothing imports the file.
- `TritonBundler.read_and_emit`, on every FX-graph cache hit (bundling is on by default outside fbcode) and as
  the Mega-Cache loads an inductor artifact, writes each bundled artifact's `payload` to
  `<triton cache>/<device>/tmp.<uuid>/<filename>` and moves that directory to `<triton cache>/<device>/<kernel_hash>`:
  an absolute filename overwrote ~/.bashrc, an absolute kernel_hash or device put a sitecustomize.py anywhere.

The rules take the form torch makes, and no more:
- a local_cache is None or `(LocalAutotuneCache(), path)` whose last two components are
  `<2 characters>/<64 hex digits>.best_config` (the kernel's code directory `<cache dir>/<2>/`, and
  torch's sha256 name), with no '.', '..' or empty component. The directory above is not checked: a cache
  moved from another machine names that machine's cache dir, and torch writes there too; so a pickle can
  at most make a `<hex>.best_config` file (JSON) in a directory it names, never a file of another name.
  A recorder's key is the same two components, its type "autotune".
- a CompiledFxGraph's `cache_key` is letters, digits and '_' (torch's: "f" + base32 of a sha256);
- a CachingAutotuner's `filename` is None or ends in `<key[1:3]>/<key>.py`, key "c" + base32 (codecache.get_path),
  with no '.', '..' or empty component (the directory above, another machine's cache dir, is not checked);
- a bundled artifact (any state with a `payload`) has a file name for `filename` (no '/', not hidden); one with
  `artifacts`, or with `kernel_hash` and `device`, a path key (hex, base32 or url-safe base64) and an int device.
  These classes (and AutotuneCache, the recorder) are pickled by their state: called with arguments, refused;
- a launcher's `name` is an identifier (a triton kernel's function name) and its `hash` hex digits (triton's
  sha256); a compile result's `compile_meta["device"]` an int or None, checked at STOP (the dict is kept
  by reference: SETITEMs after the BUILD still reach torch).
"""
from __future__ import annotations

import inspect
import re

from compilewatch.cache.trust.stackmodel import _NONE, _BoundMethod, _Dict, _List, _Num, _Obj, _Seq, _Str, describe

# the file torch keeps a kernel's best config in: `os.path.join(os.path.dirname(<kernel .py>), <sha256 hex>
# + ".best_config")` (2.11: f"{dirname}/..."), the kernel's code being `<cache dir>/<2 characters>/c<hash>.py`
_BEST_CONFIG = re.compile(r"[0-9a-z]{2}/[0-9a-f]{64}\.best_config")
_KERNEL_PY = re.compile(r"([0-9a-z]{2})/(c[0-9a-z]{8,128})\.py")  # a kernel's module: <key[1:3]>/<key>.py
_LOCAL_AUTOTUNE = "LocalAutotuneCache"  # torch._inductor.remote_cache's (2.13, 2.15), runtime.autotune_cache's (2.11)
_AUTOTUNE_CACHE = "torch._inductor.runtime.autotune_cache.AutotuneCache"
RECORDER = "torch.compiler._cache.CacheArtifactRecorder"
_AUTOTUNER = "torch._inductor.runtime.triton_heuristics.CachingAutotuner"  # and its subclasses
_HEX = re.compile(r"[0-9a-f]+")
_BUNDLER = "torch._inductor.triton_bundler."
_JIT = "triton.runtime.jit.JITFunction"
# classes whose fields torch makes paths of, and how many constructor arguments torch's pickles give them
# (none: they are pickled by their state, which `refused` reads): calls.construct refuses more
BY_STATE = {_AUTOTUNE_CACHE: 1, RECORDER: 0, **{_BUNDLER + c: 0 for c in (
    "TritonKernelArtifact", "TritonKernelArtifacts", "TritonBundleEntry")}}
# a triton artifact's file name (<kernel>.cubin, .json, .ttir, __grp__<kernel>.json) and a kernel's directory
# (triton_hash_to_path_key: the hash in hex, base32 or url-safe base64)
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=-]{0,254}")
_PATH_KEY = re.compile(r"[A-Za-z0-9_=-]{1,255}")
_KEY = re.compile(r"[A-Za-z0-9_]{3,256}")  # an FX-graph key: "f" + base32 of a sha256
CUBIN_DEVICE = "<a compile_meta whose device names the cubin's directory>"  # checked at STOP (picklescan)
LAUNCHERS = "<a CachingAutotuner's launchers>"  # checked at STOP: still empty


def _odd(p: str) -> bool:
    """A path with a control character, a backslash, or a '.', '..' or empty component (but a leading '/')."""
    parts = p.split("/")
    return len(p) > 4096 or any(ord(c) < 32 for c in p) or "\\" in p or parts[0] in (".", "..") or any(
        x in ("", ".", "..") for x in parts[1:])


def kernel_file_refused(value: object) -> str | None:
    """Why a CachingAutotuner's `filename` is not what torch gives it (the kernel's module `__file__`,
    `<cache dir>/<key[1:3]>/<key>.py` with key "c" + base32 of a sha256: codecache.get_path), or None."""
    if value is _NONE:
        return None
    if not isinstance(value, _Str):
        return f"of {describe(value)}, not a string"
    p = str(value)
    m = _KERNEL_PY.fullmatch("/".join(p.split("/")[-2:]))
    if _odd(p) or m is None or m.group(1) != m.group(2)[1:3]:
        return (f"{p[:120]!r}, not a kernel's file as torch names it (<cache dir>/<key[1:3]>/c<hash>.py, no '..'): "
                "torch reads the best config beside it and files it in the Mega-Cache under its directory's name")
    return None


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
    if _odd(p) or not _BEST_CONFIG.fullmatch("/".join(p.split("/")[-2:])):
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
    autotuner = any(f"{k.__module__}.{k.__qualname__}" == _AUTOTUNER for k in cls.__mro__)
    if named is None:  # the scan cannot read it key by key: refused where torch makes a path of it
        if autotuner or name in BY_STATE or (cls.__module__.startswith("torch._inductor.") and any(
                _has(cls, m) for m in ("write_to_disk", "reload_cubin_from_raw", "reload_cubin_path"))):
            return f"BUILD of {name} with a state the scan cannot read key by key: torch makes a path of it"
        return None
    why = bundle_refused(named)  # read off whatever the bundle holds: any class
    if why:
        return f"BUILD of {name} {why}"
    if name == _AUTOTUNE_CACHE:  # its restore takes a dict only (stackmodel._restore_acts)
        why = local_cache_refused(named.get("local_cache", _NONE))
        return f"BUILD of {name} with a local_cache {why}" if why else None
    if name == RECORDER:
        return recorder_refused(state)
    if autotuner:  # its filename: recheck_autotune_cache makes an AutotuneCache of it (AutotuneCache.create)
        why = kernel_file_refused(named.get("filename", _NONE))
        return f"BUILD of {name} with a filename {why}" if why else autotuner_calls_refused(name, named, later)
    if name == _JIT:  # a launch-tensor dump (the autotuner's pickled dump_launch_tensors) makes a directory of it
        fn_name = named.get("__name__", _NONE)
        if not (fn_name is _NONE or (isinstance(fn_name, _Str) and str(fn_name).isidentifier())):
            return (f"BUILD of {name} with a __name__ of {describe(fn_name)[:40]} {str(fn_name)[:120]!r}, not a "
                    "function's name: torch dumps launch tensors to <kernel dir>/<__name__>_run_<n>/")
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


def autotuner_calls_refused(name: str, named: dict[str, object], later: list[tuple[object, object]]) -> str | None:
    """What a loaded CachingAutotuner later calls holds what torch pickles there (2.11, 2.13, 2.15): `_reload_kernel()`
    and `_cached_launcher(*args, stream=)` None (put_static_autotuner, prepare_for_pickle), `save_cache_hook(config,
    time)` None or a bound method (`methods` checks it is an AutotuneCache's save), `launchers` an empty list
    (__getstate__ asserts it; each is called with the kernel's arguments): checked again at STOP (kept by reference)."""
    for key in ("_reload_kernel", "_cached_launcher"):
        if named.get(key, _NONE) is not _NONE:
            return f"BUILD of {name} with {describe(named[key])} as {key!r}: torch pickles None there, and calls it"
    hook = named.get("save_cache_hook", _NONE)
    if not (hook is _NONE or isinstance(hook, _BoundMethod) or (isinstance(hook, _Num) and hook.value is False)):
        return f"BUILD of {name} with {describe(hook)} as 'save_cache_hook': torch keeps an AutotuneCache's save there"
    launchers = named.get("launchers", _NONE)
    if not (launchers is _NONE or isinstance(launchers, _List)):
        return f"BUILD of {name} with {describe(launchers)} as 'launchers': torch pickles an empty list, and calls each"
    if isinstance(launchers, _List):
        later.append((launchers, LAUNCHERS))
    return None


def launchers_refused(launchers: object) -> str | None:
    """At STOP: a CachingAutotuner's `launchers` list is still empty."""
    return ("a CachingAutotuner's launchers list with items: torch pickles it empty, and calls each launcher with the "
            "kernel's arguments") if isinstance(launchers, _List) and launchers.n else None


def bundle_refused(named: dict[str, object]) -> str | None:
    """TritonBundler.read_and_emit, on every FX-graph cache hit (bundling is on by default outside fbcode) and as the
    Mega-Cache loads an inductor artifact, writes each artifact's `payload` to `os.path.join(<triton cache>/
    <device>/tmp.<uuid>, artifact.filename)` and moves that directory to `<triton cache>/<device>/<kernel_hash>`:
    an absolute filename overwrote ~/.bashrc, an absolute kernel_hash or a device of "/x" put the files anywhere.
    It reads those attributes of whatever the bundle holds, so any state with them is held to torch's form: a
    file name (no '/', not hidden), a path key, an int device."""
    if "payload" in named:
        fname = named.get("filename", _NONE)
        if not (isinstance(fname, _Str) and _FILE_NAME.fullmatch(str(fname))):
            return (f"with a payload and a filename of {describe(fname)[:40]} {str(fname)[:120]!r}, not a triton artifact's "
                    "file name: torch writes the payload to <triton cache>/<device>/<dir>/<filename> as it loads the entry")
    if "artifacts" in named or ("kernel_hash" in named and "device" in named):  # (a CachingAutotuner's is a name)
        key, device = named.get("kernel_hash", _NONE), named.get("device", _NONE)
        if not (isinstance(key, _Str) and _PATH_KEY.fullmatch(str(key))):
            return (f"with a kernel_hash of {describe(key)[:40]} {str(key)[:120]!r}, not triton's path key: torch moves "
                    "the kernel's artifacts to <triton cache>/<device>/<kernel_hash> as it loads the entry")
        if not (isinstance(device, _Num) and type(device.value) is int):
            return (f"with a device of {describe(device)[:120]}, not an int: torch writes the kernel's artifacts under "
                    "<triton cache>/<device>/ as it loads the entry")
    return None


def device_refused(meta: object) -> str | None:
    """At STOP: a compile_meta's `device` is an int or None (`triton_cache_dir(device)` is <cache>/triton/<device>)."""
    device = ((meta.named or {}) if isinstance(meta, _Dict) else {}).get("device", _NONE)
    if device is _NONE or (isinstance(device, _Num) and type(device.value) is int):
        return None
    return (f"a static compile result's compile_meta with a device of {describe(device)[:120]}, not an int: torch "
            "writes the kernel's cubin under <cache>/triton/<device>/ as it loads the entry")


# A Mega-Cache artifact's key is a path too: torch's `populate_caches` writes each artifact's content under it
# (2.11-2.15): inductor and aot_autograd to `<cache dir>/{fxgraph,aotautograd}/<key[1:3]>/<key>/<sha256>`,
# autotune to `os.path.join(<cache dir>, key)`, precompile to `os.path.join(<precompile dir>, key)/entry`; pgo
# puts `code_state_<key>.pkl` under `<cache dir>/dynamo/` with / \ : and other separators replaced. An absolute
# key or one with '..' wrote outside the cache dir (`cache load_mega_cache`, a signed or --trust archive).
_MEGA_KEYS = {"inductor": _KEY, "aot_autograd": _KEY, "autotune": _BEST_CONFIG,
              "precompile": re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=-]{0,255}")}


def mega_key_refused(kind: str, key: object) -> str | None:
    """Why a Mega-Cache artifact's `key` is not the form torch makes for its `kind` (torch writes the artifact
    under it), or None. A kind this list does not know keeps to one plain path component."""
    if not isinstance(key, str):
        return f"a {kind} artifact whose key is {type(key).__name__}, not a string"
    form = _MEGA_KEYS.get(kind)
    if kind == "pgo":  # torch replaces the separators itself; only its length and characters matter
        ok = 0 < len(key) <= 1024 and key.isprintable()
    elif form is not None:
        ok = form.fullmatch(key) is not None
    else:
        ok = 0 < len(key) <= 255 and key.isprintable() and "/" not in key and "\\" not in key and key not in (".", "..")
    if ok:
        return None
    return (f"a {kind} artifact keyed {key[:120]!r}: torch writes it to a path made of its key, and this is not "
            "a key torch makes (it would write outside the cache dir)")
