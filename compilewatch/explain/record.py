"""The hook: every cache lookup of a watched process recorded with its key and the key's parts.

One patch point per cache, chosen by probing the installed torch (never by its version string):

| cache | torch 2.13 (read from torch/_inductor/codecache.py, _functorch/_aot_autograd/autograd_cache.py) | used when |
|---|---|---|
| FX graph | `FxGraphCache.load_with_key(key, debug_lines, example_inputs, ...)` -> `(graph or None, cache_info)`: the one call that has the key, torch's debug lines and the outcome, on a fresh compile (compile_fx) and on an AOTAutograd hit (aot_autograd_result) alike | the staticmethod exists and its first two parameters are `key`, `debug_lines` |
| FX graph, fallback | `compiled_fx_graph_hash(gm, example_inputs, fx_kwargs, inputs_to_check)` -> `(key, debug_lines)` plus `FxGraphCache._lookup_graph(key, ...)` -> `(graph or None, ...)` (or a bare graph), joined per thread | `load_with_key` is missing or has other parameters |
| AOTAutograd | `AOTAutogradCache._lookup(key, local, remote, args, cache_info, aot_config)` -> `(entry, bytes)` or None: key and outcome only. torch computes AOTAutograd's debug lines only with debug logging on (`_get_debug_lines_for_cache_key`), so its parts are "not recorded"; the FX-graph lookups of the same compile carry the parts | the staticmethod exists with `key` first |

Whatever is not found is reported in `Recorder.unsupported` ("not available on torch X"), never guessed.
Installed only while a Watcher is installed (refcounted; the originals are put back when the last one
closes). A lookup costs the parsing of torch's lines (the ~600 config lines are hashed, parsed only
once per distinct config) and one appended line; benchmarks/explain_overhead.py measures it.
Recording never breaks the program: any error in it is counted (`Recorder.errors`) and dropped.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import sys
import threading
import time
from typing import Any, Callable

from compilewatch.explain import parts as P
from compilewatch.explain import store as S
from compilewatch.explain import timing as T

_lock = threading.RLock()
_refs = 0
_originals: list[tuple[Any, str, Any]] = []  # (owner, attribute, original raw value)
_recorder: "Recorder | None" = None
_tls = threading.local()


class Recorder:
    def __init__(self, run: str | None = None) -> None:
        self.run = run or os.environ.get("COMPILEWATCH_RUN_DIR", "").rsplit("/", 1)[-1] or f"pid-{os.getpid()}-{int(time.time())}"
        self.writers: dict[str, S.Writer] = {}
        self.counts = {"fxgraph": [0, 0], "aotautograd": [0, 0]}  # kind -> [hits, misses]
        self.errors = 0
        self.first_error: str | None = None
        self.refused: dict[str, str] = {}  # store -> why it was refused
        self.unsupported: list[str] = []
        self.hooks: list[str] = []
        self._config_cache: dict[bytes, tuple[str, dict]] = {}
        self._rest_cache: dict[tuple, dict] = {}
        self._env_at: tuple[float, tuple[int, dict]] | None = None
        self._dirs: dict[str | None, str] = {}
        self._names: dict[str | None, str] = {}  # compile id -> the function its forward compiled
        self._torch = None

    # --- one lookup -------------------------------------------------------------------------
    def writer(self, cache_dir: str) -> S.Writer | None:
        w = self.writers.get(cache_dir)
        if w is None and cache_dir not in self.refused:
            try:
                w = S.Writer(cache_dir)
                w.compact_if_needed()
            except Exception as e:  # noqa: BLE001 - an untrusted or unwritable store: record nothing there
                self.refused[cache_dir] = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
                return None
            self.writers[cache_dir] = w
        return w

    def record(self, kind: str, key: str, lines: list[str] | None, hit: bool, backward: bool | None = None) -> None:
        try:
            self._record(kind, key, lines, hit, backward)
        except Exception as e:  # noqa: BLE001 - never break the compile
            self.errors += 1
            if self.first_error is None:
                self.first_error = f"{type(e).__name__}: {e}"

    def _record(self, kind: str, key: str, lines: list[str] | None, hit: bool, backward: bool | None) -> None:
        self.counts[kind][0 if hit else 1] += 1
        env_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        cache_dir = self._dirs.get(env_dir)
        if cache_dir is None:
            cache_dir = self._dirs[env_dir] = _cache_dir()
        w = self.writer(cache_dir)
        if w is None:
            return
        out: list[dict] = []
        groups: dict[str, str] = {}
        if lines:
            groups = self._groups(lines, w, out)
        name, compile_id = _where()
        if name is None:  # a lazy backward compiles outside dynamo's frame: the forward of its compile named it
            name = self._names.get(compile_id)
        elif compile_id is not None:
            self._names[compile_id] = name
        out.append({"v": S.FORMAT_VERSION, "type": "lookup", "t": round(time.time(), 3), "pid": os.getpid(),
                    "run": self.run, "kind": kind, "key": key, "hit": hit, "name": name, "backward": backward,
                    "compile_id": compile_id, "cache_dir": cache_dir, "torch": self._torch_version(),
                    "groups": groups})
        w.append(out)

    def _groups(self, lines: list[str], w: S.Writer, out: list[dict]) -> dict[str, str]:
        # torch prints the ~600 inductor config lines in one run (vars() order): slice them out, hash them,
        # parse them once per distinct config; the other ~50 lines are cached by their text except the graph's
        i0 = next((i for i, ln in enumerate(lines) if "] inductor_config" in ln[:80]), len(lines))
        i1 = len(lines)
        if i0 < len(lines):
            while i1 > i0 and "] inductor_config" not in lines[i1 - 1][:80]:
                i1 -= 1
        chunk = lines[i0:i1]
        h = hashlib.blake2b("\n".join(chunk).encode("utf-8", "replace"), digest_size=16).digest()
        cfg = self._config_cache.get(h)
        if cfg is None:
            parsed = P.parse_lines(chunk)
            cfg = (P.group_id(parsed["config"]), parsed)
            if len(self._config_cache) < 64:
                self._config_cache[h] = cfg
        other = lines[:i0] + lines[i1:]
        graph_lines = [ln for ln in other if P.group_of(_name_of(ln)) == "graph"]
        rest = tuple(ln for ln in other if P.group_of(_name_of(ln)) != "graph")
        env = self._env()
        ck = (rest, env[0])
        fixed = self._rest_cache.get(ck)
        if fixed is None:
            parsed = P.parse_lines(list(rest))
            for g in ("kwargs", "settings", "graph"):  # what the config chunk held besides config (a future torch)
                parsed[g].update(cfg[1][g])
            parsed["settings"].update(env[1])
            parsed["settings"]["torch.__version__"] = ["", self._torch_version()]
            fixed = {g: (P.group_id(parsed[g]), parsed[g]) for g in ("kwargs", "settings") if parsed[g]}
            fixed["_graph_extra"] = ("", parsed["graph"])
            if len(self._rest_cache) < 256:
                self._rest_cache[ck] = fixed
        graph = P.parse_lines(graph_lines)["graph"]
        graph.update(fixed["_graph_extra"][1])
        groups = {"graph": (P.group_id(graph), graph), "config": (cfg[0], cfg[1]["config"]),
                  **{g: v for g, v in fixed.items() if not g.startswith("_")}}
        ids = {}
        for g, (gid, parts) in groups.items():
            if not parts:
                continue
            ids[g] = gid
            if gid not in w.known:
                w.known.add(gid)
                out.append({"v": S.FORMAT_VERSION, "type": "group", "id": gid, "group": g, "parts": parts})
        return ids

    def _env(self) -> tuple[int, dict[str, list]]:
        """The environment's parts, re-read at most once a second (os.environ is slow to walk)."""
        now = time.monotonic()
        if self._env_at is None or now - self._env_at[0] > 1.0:
            parts = P.env_parts(os.environ)
            version = self._env_at[1][0] if self._env_at else 0
            if self._env_at is None or parts != self._env_at[1][1]:
                version += 1
            self._env_at = (now, (version, parts))
        return self._env_at[1]

    def _torch_version(self) -> str:
        if self._torch is None:
            self._torch = str(getattr(sys.modules.get("torch"), "__version__", "unknown"))
        return self._torch

    def summary(self) -> dict:
        return {"run": self.run, "stores": sorted(str(w.store) for w in self.writers.values()),
                "counts": {k: {"hit": v[0], "miss": v[1]} for k, v in self.counts.items()},
                "hooks": list(self.hooks), "unsupported": list(self.unsupported), "refused": dict(self.refused),
                "errors": self.errors, "first_error": self.first_error}

    def compile_time(self, timed: "T.Timings | None") -> dict | None:
        """Where this process's compile time went (compilewatch.explain.timing), appended to each store
        it looked up in; None when torch timed nothing while watched."""
        if timed is None or not timed.steps_seen():
            return None
        try:
            rec = timed.summary(self._torch_version(), T.exposed_events())
            hits = sum(v[0] for v in self.counts.values())
            rec["lookups"] = {"hit": hits, "miss": sum(v[1] for v in self.counts.values())}
            line = {"v": S.FORMAT_VERSION, "type": "timing", "t": round(time.time(), 3), "pid": os.getpid(),
                    "run": self.run, **rec}
            for w in self.writers.values():
                w.append([line])
            return rec
        except Exception as e:  # noqa: BLE001 - never break the program's exit
            self.errors += 1
            if self.first_error is None:
                self.first_error = f"compile time: {type(e).__name__}: {e}"
            return None

    def close(self) -> None:
        for w in self.writers.values():
            w.close()


def _name_of(line: str) -> str:
    i = line.find("] ", 0, 80)
    j = line.find(":", i)
    return line[i + 2:j] if i >= 0 and j > 0 else ""


def _cache_dir() -> str:
    mod = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if mod is not None:
        try:
            return str(mod.cache_dir())
        except Exception:  # noqa: BLE001
            pass
    from compilewatch.torchinfo import inductor_cache_dir

    return str(inductor_cache_dir())


def _where() -> tuple[str | None, str | None]:
    """The compiled function (dynamo's frame being compiled) and torch's compile id."""
    name = None
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        if code.co_name in ("_compile", "compile_inner", "_compile_inner") and code.co_filename.endswith("convert_frame.py"):
            c = f.f_locals.get("code")
            if c is not None and hasattr(c, "co_name"):
                name = c.co_name
                break
        f = f.f_back
    compile_id = None
    guards = sys.modules.get("torch._guards")
    if guards is not None:
        try:
            cid = guards.CompileContext.current_compile_id()
            compile_id = None if cid is None else str(cid)
        except Exception:  # noqa: BLE001 - not available on this torch
            pass
    return name, compile_id


# --- the hooks ----------------------------------------------------------------------------------
def _params(fn: Any) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def _static(owner: Any, attr: str, make: Callable[[Callable], Callable]) -> None:
    raw = owner.__dict__[attr]
    fn = raw.__func__ if isinstance(raw, staticmethod) else raw
    wrapped = make(fn)
    wrapped.__wrapped__ = fn
    wrapped.__compilewatch_original__ = fn
    setattr(owner, attr, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)
    _originals.append((owner, attr, raw))


def _patched(owner: Any, attr: str) -> bool:
    raw = getattr(owner, "__dict__", {}).get(attr)
    fn = raw.__func__ if isinstance(raw, staticmethod) else raw
    return hasattr(fn, "__compilewatch_original__")


def _install_fx(rec: Recorder) -> None:
    import torch

    version = torch.__version__
    try:
        from torch._inductor import codecache as cc
    except Exception as e:  # noqa: BLE001
        rec.unsupported.append(f"FX-graph cache lookups: torch._inductor.codecache not importable on torch {version} ({e})")
        return
    fx = getattr(cc, "FxGraphCache", None)
    if fx is not None and (_patched(fx, "load_with_key") or _patched(fx, "_lookup_graph")):
        return
    lwk = fx is not None and fx.__dict__.get("load_with_key")
    if lwk is not None and _params(getattr(fx, "load_with_key"))[:2] == ["key", "debug_lines"]:
        def make(fn):
            def load_with_key(key, debug_lines, *a, **k):
                result = fn(key, debug_lines, *a, **k)
                r = _recorder
                if r is not None:
                    graph = result[0] if isinstance(result, tuple) else result
                    backward = bool(a[3] if len(a) > 3 else k.get("is_backward"))
                    r.record("fxgraph", key, list(debug_lines or ()), graph is not None, backward)
                return result
            return load_with_key

        _static(fx, "load_with_key", make)
        rec.hooks.append("FxGraphCache.load_with_key")
    elif fx is not None and callable(getattr(cc, "compiled_fx_graph_hash", None)) and "_lookup_graph" in fx.__dict__:
        orig_hash = cc.compiled_fx_graph_hash

        def compiled_fx_graph_hash(*a, **k):
            out = orig_hash(*a, **k)
            _tls.pending = out if isinstance(out, tuple) and len(out) == 2 else None
            return out

        compiled_fx_graph_hash.__wrapped__ = orig_hash
        _originals.append((cc, "compiled_fx_graph_hash", orig_hash))
        cc.compiled_fx_graph_hash = compiled_fx_graph_hash

        def make(fn):
            def _lookup_graph(key, *a, **k):
                result = fn(key, *a, **k)
                r, pending = _recorder, getattr(_tls, "pending", None)
                if r is not None:
                    graph = result[0] if isinstance(result, tuple) else result
                    lines = pending[1] if pending and pending[0] == key else None
                    kw = [ln for ln in (lines or ()) if "fx_kwargs[is_backward]: " in ln]
                    backward = kw[0].rstrip().endswith("True") if kw else None
                    r.record("fxgraph", key, list(lines or ()), graph is not None, backward)
                return result
            return _lookup_graph

        _static(fx, "_lookup_graph", make)
        rec.hooks.append("compiled_fx_graph_hash + FxGraphCache._lookup_graph")
    else:
        rec.unsupported.append(f"FX-graph cache lookups: FxGraphCache.load_with_key(key, debug_lines, ...) is not "
                               f"available on torch {version}")


def _install_aot(rec: Recorder) -> None:
    import torch

    version = torch.__version__
    try:
        from torch._functorch._aot_autograd import autograd_cache as ac
    except Exception:  # noqa: BLE001
        ac = None
    aot = getattr(ac, "AOTAutogradCache", None)
    if aot is not None and _patched(aot, "_lookup"):
        return
    if aot is not None and "_lookup" in aot.__dict__ and _params(aot._lookup)[:1] == ["key"]:
        def make_aot(fn):
            def _lookup(key, *a, **k):
                result = fn(key, *a, **k)
                r = _recorder
                if r is not None:
                    r.record("aotautograd", key, None, result is not None)
                return result
            return _lookup

        _static(aot, "_lookup", make_aot)
        rec.hooks.append("AOTAutogradCache._lookup")
    else:
        rec.unsupported.append(f"AOTAutograd cache lookups: AOTAutogradCache._lookup(key, ...) is not available on "
                               f"torch {version}")


def _install_timing(rec: Recorder) -> None:
    if T.install(rec.unsupported):
        rec.hooks.append("ChromiumEventLogger.log_event_start/end")


_MODULES = (("torch._inductor.codecache", _install_fx),
            ("torch._functorch._aot_autograd.autograd_cache", _install_aot),
            ("torch._dynamo.utils", _install_timing))


def _installer(install: Callable[[Recorder], None]) -> Callable[[], None]:
    def run() -> None:
        with _lock:
            rec = _recorder
            if rec is None:
                return  # the watch ended before torch imported this cache
            try:
                install(rec)
            except Exception as e:  # noqa: BLE001 - a torch we do not understand: record nothing there, say so
                rec.unsupported.append(f"cache lookups: {install.__name__} failed ({type(e).__name__}: {e})")
    return run


def start(run: str | None = None, after_import: Callable[[str, Callable[[], None]], None] | None = None) -> Recorder:
    """Start recording (first caller) and return the process's recorder. The hooks go in when torch's
    cache modules are imported (`after_import`: the watcher's import hook; without it: now)."""
    global _refs, _recorder
    with _lock:
        if _recorder is None:
            _recorder = Recorder(run)
            for name, install in _MODULES:
                if after_import is not None:
                    after_import(name, _installer(install))
                else:
                    import importlib

                    try:
                        importlib.import_module(name)
                    except Exception as e:  # noqa: BLE001
                        _recorder.unsupported.append(f"{name} not importable ({type(e).__name__}: {e})")
                        continue
                    _installer(install)()
        _refs += 1
        return _recorder


def _uninstall() -> "T.Timings | None":
    while _originals:
        owner, attr, raw = _originals.pop()
        setattr(owner, attr, raw)
    return T.uninstall()


def stop() -> dict | None:
    """Drop one reference; the last one removes the hooks. Returns the recorder's summary."""
    global _refs, _recorder
    with _lock:
        if _recorder is None:
            return None
        _refs -= 1
        if _refs <= 0:
            timed = _uninstall()
            compile_time = _recorder.compile_time(timed)
            summary = _recorder.summary()
            if compile_time is not None:
                summary["compile_time"] = compile_time
            _recorder.close()
            _recorder, _refs = None, 0
        else:
            summary = _recorder.summary()
        return summary


def installed() -> bool:
    return bool(_originals) or T.installed()


# --- the watcher's one-line hook ----------------------------------------------------------------
def on_watch_start(watcher: Any, after_import: Callable[[str, Callable[[], None]], None]) -> None:
    """Called by Watcher.install: start recording for this watcher (hooks go in as torch imports its caches)."""
    try:
        start(after_import=after_import)
        watcher._cache_keys_started = True
    except Exception:  # noqa: BLE001 - never stop the watcher from installing
        pass


def on_watch_close(watcher: Any) -> None:
    """Called by Watcher.close: stop recording and put a `cache_lookups` event into its report."""
    if not getattr(watcher, "_cache_keys_started", False):
        return
    watcher._cache_keys_started = False
    try:
        summary = stop()
        if summary is not None:
            watcher._emit("cache_lookups", summary)
    except Exception:  # noqa: BLE001
        pass
