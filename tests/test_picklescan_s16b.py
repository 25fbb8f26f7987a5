"""picklescan red-team pass (session 16b): two gadgets the s16 pass noticed and left.

- A CachingAutotuner's `filename` (the kernel's module, `<cache dir>/<key[1:3]>/<key>.py`). Nothing imports or
  execs that file after loading (torch reloads a kernel from source it keeps itself); but as a loaded entry's
  static autotuner is first used (StaticAutotunerFuture.result -> recheck_autotune_cache ->
  check_autotune_cache -> AutotuneCache.create), torch reads the best config at
  `<dirname(filename)>/<hex>.best_config` and files it for the Mega-Cache under
  `<basename(dirname(filename))>/<hex>.best_config` (2.11: LocalAutotuneCache._get; 2.13, 2.15: the recorder).
  A filename of `<dir>/../c....py` had torch 2.11, 2.13 and 2.15 read a best config from the directory above the
  one named, record it under '../<hex>.best_config', and a later Mega-Cache load write it outside its cache dir.
  Now only torch's form passes (`paths.kernel_file_refused`).
- A bound method kept in a state. `getattr(AutotuneCacheArtifact(key=<path>, content=<bytes>), 'populate_cache')`
  stored as a CachingAutotuner's `_reload_kernel` (torch: `self.fn = self._reload_kernel().fn`) was accepted on
  2.11, 2.13 and 2.15; called, it wrote the pickle's bytes to the path (here a sitecustomize.py that the next
  Python ran). Now a bound method is kept in an object only where torch keeps one (`methods`).
- Found on the way: a CachingAutotuner pickled as torch pickles it (put_static_autotuner's steps, built here by
  torch's own constructor where triton is installed) was refused by the s15 rules: its JITFunction's `repr` is
  torch's `_ConstRepr` (over a method), and the JITFunction is held by `getattr(<it>, 'create_binder')` before its
  BUILD (its hash is a string's). Both are torch's own and pass now.

Each unscanned exploit is unpickled in a child process under an address-space and a CPU limit; it writes only
inside tmp_path. What it did is asserted, never timed.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import os
import pickle
import pickletools
import subprocess
import sys

import pytest

from compilewatch.cache.trust import methods, picklescan
from tests.test_picklescan_adversarial import Asm
from tests.test_picklescan_s15 import _load, _refused

MiB = 1 << 20
TH = "torch._inductor.runtime.triton_heuristics"
KEY = ("c" + "abcdefghijklmnopqrstuvwxyz234567" * 2)[:52]  # a kernel's key: "c" + base32 of a sha256
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _frag(obj: object) -> bytes:
    """The opcodes that build `obj` (protocol 4, no PROTO/FRAME/STOP), memo entries only where it reads them back:
    spliced after fragments that leave none (its own memo indices start at 0)."""
    b = pickletools.optimize(pickle.dumps(obj, protocol=4))[2:-1]
    return b[9:] if b[:1] == b"\x95" else b


def _compile_results() -> bytes:
    """[StaticTritonCompileResult(config=Config({'XBLOCK': 64}, 4 warps, 1 stage))] (where triton is installed)."""
    from torch._inductor.runtime import triton_heuristics as th

    result = object.__new__(th.StaticTritonCompileResult)
    result.__dict__.update(config=th.Config({"XBLOCK": 64}, num_warps=4, num_stages=1))
    return _frag([result])


def _autotuner(filename: object, items: bytes = b"") -> bytes:
    """A CachingAutotuner restored from {filename, inductor_meta (local autotune cache, coordinate descent), what
    recheck_autotune_cache reads, compile_results (where triton is installed)} and `items` (more key/values)."""
    a = Asm().g(TH, "CachingAutotuner").op("EMPTY_TUPLE").op("NEWOBJ").op("EMPTY_DICT").op("MARK").s("filename")
    if isinstance(filename, str):
        a.s(filename)
    else:
        a.raw(_frag(filename))
    a.s("inductor_meta").raw(_frag({"autotune_local_cache": True, "coordinate_descent_tuning": True}))
    a.s("deterministic_mode").raw(b"\x89").s("heuristic_type").op("NONE").s("size_hints").op("NONE")
    a.s("device_props").op("NONE")
    if _HAS_TRITON:
        a.s("compile_results").raw(_compile_results())
    return a.raw(items).op("SETITEMS").op("BUILD").done()


# --- 1. a CachingAutotuner's filename ---------------------------------------------------------------------
_RECHECK = r'''
import json, os, torch
from torch._inductor.runtime import triton_heuristics as th
from torch._inductor.runtime.autotune_cache import AutotuneCache
real = th.Config.__module__.startswith("triton")
configs = [r.config for r in x.compile_results] if real else []
configs_hash = th.hash_configs(configs) if real else "the-configs-hash"
where = AutotuneCache.create(x.inductor_meta, x.filename, configs_hash).local_cache[1]  # as check_autotune_cache
os.makedirs(os.path.dirname(where), exist_ok=True)
with open(where, "w") as f:  # a best config beside the kernel, an earlier run's
    json.dump({"XBLOCK": 64, "num_warps": 4, "num_stages": 1, "configs_hash": configs_hash}, f)
if real:  # what StaticAutotunerFuture.result() runs first on a loaded entry's autotuner
    x.recheck_autotune_cache(lambda: x)
    print("state", x.autotune_cache_info.get("autotune_cache_state"))
else:  # torch 2.13 for CPU has no triton: the read recheck_autotune_cache makes (read_best -> _read)
    AutotuneCache.create(x.inductor_meta, x.filename, configs_hash)._read()
blob, info = torch.compiler.save_cache_artifacts()
print("recorded", info.artifacts["autotune"])
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ["FRESH_CACHE"]
torch.compiler.load_cache_artifacts(blob)
'''


def test_an_autotuners_filename_is_where_torch_reads_a_best_config_and_the_mega_cache_writes_it(tmp_path):
    cache = tmp_path / "inductor"
    made = str(cache / KEY[1:3] / f"{KEY}.py")
    assert picklescan.scan(_autotuner(made)).ok, picklescan.scan(_autotuner(made))
    # another machine's cache dir (torch reads there too), a relative cache dir, no file at all
    for ok in ("/home/alice/.cache/torchinductor_alice/" + f"{KEY[1:3]}/{KEY}.py", f"rel/{KEY[1:3]}/{KEY}.py", None):
        assert picklescan.scan(_autotuner(ok)).ok, ok
    evil = str(cache / KEY[1:3] / ".." / f"{KEY}.py")
    _refused(_autotuner(evil), "not a kernel's file as torch names it")
    for bad in (f"/{KEY}.py", f"{KEY}.py", f"../{KEY}.py", f"{cache}/xy/{KEY}.py", f"{cache}/ab/x.py",
                f"{cache}/ab/{KEY}.so", f"{cache}//ab/{KEY}.py", f"{cache}/./ab/{KEY}.py", f"./ab/{KEY}.py",
                f"{cache}/ab/{KEY}.py\n", f"{cache}\\..\\ab/{KEY}.py", "/etc/passwd"):
        _refused(_autotuner(bad), "not a kernel's file as torch names it")
    for bad in (made.encode(), 7, [made]):
        _refused(_autotuner(bad), "not a string")

    # unscanned: torch reads beside '<dir>/..' and files what it read under '../<hex>.best_config'
    fresh = tmp_path / "elsewhere" / "cache"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "FRESH_CACHE": str(fresh)}
    out = _load(_autotuner(evil), modules=TH, mem=2048 * MiB, cpu=120, after=_RECHECK, env=env)
    assert "recorded ['../" in out.stdout, (out.stdout, out.stderr[-3000:])
    if _HAS_TRITON:
        assert "state hit" in out.stdout, out.stdout
    outside = list((tmp_path / "elsewhere").glob("*.best_config"))
    assert len(outside) == 1 and '"XBLOCK": 64' in outside[0].read_text(), sorted(tmp_path.rglob("*"))
    assert list(cache.glob("*.best_config"))  # read from the directory above the kernel's
    # torch's own filename: recorded as <key[1:3]>/<hex>.best_config, written inside the fresh cache dir
    fresh = tmp_path / "fresh2" / "cache"
    out = _load(_autotuner(made), modules=TH, mem=2048 * MiB, cpu=120, after=_RECHECK,
                env={**env, "FRESH_CACHE": str(fresh)})
    assert f"recorded ['{KEY[1:3]}/" in out.stdout, (out.stdout, out.stderr[-3000:])
    assert len(list(fresh.glob(f"{KEY[1:3]}/*.best_config"))) == 1 and not list(fresh.parent.glob("*.best_config"))


def test_nothing_imports_the_file_an_autotuner_names():
    """What torch does with `filename` after loading (2.11, 2.13, 2.15): recheck_autotune_cache hands it to
    check_autotune_cache (a best config beside it), the profiler gets it as a string, and a launch-tensor dump
    (TORCHINDUCTOR_DUMP_LAUNCH_TENSORS, pickled as `dump_launch_tensors`) writes beside it. Nothing imports,
    execs or opens it: torch reloads a kernel from source it keeps (`reload_kernel_from_src`)."""
    from torch._inductor.runtime import triton_heuristics as th

    src = inspect.getsource(th)
    uses = [line.strip() for line in src.splitlines() if "self.filename" in line]
    assert uses and all(any(ok in u for ok in ("self.filename = filename", "if self.filename is not None",
                                                 "os.path.basename(self.filename)", "self.filename,", "configs, self.filename",
                                                 '"kernel_file": (self.filename or "")', "args, self.filename"))
                        for u in uses), uses
    assert "check_autotune_cache(" in inspect.getsource(th.CachingAutotuner.recheck_autotune_cache)


# --- 2. bound methods kept in a state ---------------------------------------------------------------------------
def _artifact(cls: str, key: str, content: bytes) -> bytes:
    module, _, name = cls.rpartition(".")
    a = Asm(2).g(module, name).op("EMPTY_TUPLE").op("NEWOBJ").op("EMPTY_DICT")
    a.s("key").s(key).op("SETITEM").s("content").by(content).op("SETITEM").op("BUILD")
    return bytes(a.b[2:])


def _bound(instance: bytes, name: str) -> bytes:
    return bytes(Asm(2).g("builtins", "getattr").b[2:]) + instance + bytes(Asm(2).s(name).op("TUPLE2").op("REDUCE").b[2:])


_ARTIFACT = "torch._inductor.runtime.autotune_cache.AutotuneCacheArtifact"
_SITE = "print('the pickle runs in every python')\n"
_RELOAD = r'''
try:
    x._reload_kernel().fn  # what CachingAutotuner does when its kernel must be reloaded (2.11, 2.13, 2.15)
except AttributeError as e:
    print("called", e)
'''


def test_a_bound_method_stored_where_torch_calls_it_wrote_a_file_and_is_refused(tmp_path):
    site = tmp_path / "site"
    bm = _bound(_artifact(_ARTIFACT, str(site / "sitecustomize.py"), _SITE.encode()), "populate_cache")
    evil = _autotuner(None, bytes(Asm(2).s("_reload_kernel").b[2:]) + bm)
    _refused(evil, "storing a bound method, getattr(<AutotuneCacheArtifact instance>, 'populate_cache') as '_reload_kernel'")
    out = _load(evil, modules=TH, mem=2048 * MiB, cpu=120, after=_RELOAD,
                env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert "called" in out.stdout and (site / "sitecustomize.py").read_text() == _SITE, (out.stdout, out.stderr[-3000:])
    ran = subprocess.run([sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(site)})
    assert "the pickle runs in every python" in ran.stdout  # the next Python ran the pickle's code


def test_torch_calls_a_loaded_autotuners_reload_kernel_and_save_cache_hook_and_keeps_only_save_there():
    """The attributes torch calls on a loaded CachingAutotuner, and the one bound method it stores (2.11-2.15)."""
    import torch._inductor.triton_bundler as bundler
    from torch._inductor.runtime import triton_heuristics as th

    src = inspect.getsource(th)
    assert "self._reload_kernel().fn" in src and "self.save_cache_hook(" in src
    assert src.count("save_cache_hook=autotune_cache and autotune_cache.save") == 2
    assert "new_kernel._reload_kernel = None" in inspect.getsource(bundler.TritonBundler.put_static_autotuner)
    assert methods.HOMES == {(TH + ".CachingAutotuner", "save_cache_hook"):
                             ("torch._inductor.runtime.autotune_cache.AutotuneCache", "save")}


def _cache_artifact_classes() -> list[type]:
    import torch._dynamo.pgo  # noqa: F401 - each registers its artifact class
    import torch._functorch._aot_autograd.autograd_cache  # noqa: F401
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.runtime.autotune_cache  # noqa: F401
    from torch.compiler._cache import CacheArtifact

    seen, todo = [], [CacheArtifact]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if "populate_cache" in vars(sub) and sub.__module__.startswith("torch."):
                seen.append(sub)
    return seen


def test_every_cache_artifacts_populate_cache_kept_in_a_state_is_refused():
    """Each CacheArtifact subclass's populate_cache writes (or loads) what its key names; kept as any attribute of
    an object, under a key torch keeps no bound method, it is refused; so is one bound to the wrong class."""
    classes = _cache_artifact_classes()
    assert {c.__name__ for c in classes} >= {"AutotuneCacheArtifact", "InductorCacheArtifact", "AOTAutogradCacheArtifact",
                                            "PGOCacheArtifact"}, classes
    for cls in classes:
        bm = _bound(_artifact(f"{cls.__module__}.{cls.__qualname__}", "../../x", b"{}"), "populate_cache")
        for key in ("_reload_kernel", "save_cache_hook", "launchers", "fn"):
            r = picklescan.scan(_autotuner(None, bytes(Asm(2).s(key).b[2:]) + bm))
            assert not r.ok and any("a bound method" in why for why in r.refused), (cls, key, r)


def _autotune_cache_frag(tmp_path) -> bytes:
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    ac = AutotuneCache.create({"autotune_local_cache": True}, str(tmp_path / "ab" / f"{KEY}.py"), "h")
    assert ac is not None
    return _frag(ac)


def test_a_bound_method_is_kept_only_where_torch_keeps_one(tmp_path):
    save = _bound(_autotune_cache_frag(tmp_path), "save")
    hook = bytes(Asm(2).s("save_cache_hook").b[2:])
    assert picklescan.scan(_autotuner(None, hook + save)).ok  # torch's: save_cache_hook = autotune_cache.save
    populate = _bound(_artifact(_ARTIFACT, "x", b"{}"), "populate_cache")
    where = {
        "under another key": bytes(Asm(2).s("_reload_kernel").b[2:]) + save,
        "bound to another class": hook + populate,
        "in a list": bytes(Asm(2).s("launchers").op("EMPTY_LIST").b[2:]) + save + bytes(Asm(2).op("APPEND").b[2:]),
        "in a dict": bytes(Asm(2).s("inductor_meta").op("EMPTY_DICT").s("get").b[2:]) + populate
        + bytes(Asm(2).op("SETITEM").b[2:]),
        "in a tuple in a tuple": bytes(Asm(2).s("configs").b[2:]) + populate + bytes(Asm(2).op("TUPLE1").op("TUPLE1").b[2:]),
        "as a defaultdict's factory": bytes(Asm(2).s("device_caches").g("collections", "defaultdict").b[2:]) + populate
        + bytes(Asm(2).op("TUPLE1").op("REDUCE").b[2:]),
    }
    for what, items in where.items():
        r = picklescan.scan(_autotuner(None, items))
        assert not r.ok and any("bound method" in why for why in r.refused), (what, r)
    # given to a constructor, or added to a state after the BUILD that holds the dict
    a = Asm().g("torch._inductor.triton_bundler", "StaticallyLaunchedAutotuner").s("k").s("n").raw(populate)
    _refused(a.op("TUPLE3").op("REDUCE").done(), "called with a tuple holding a bound method")
    a = Asm().g(TH, "CachingAutotuner").op("EMPTY_TUPLE").op("NEWOBJ").op("EMPTY_DICT").put(1).op("BUILD").get(1)
    _refused(a.s("_reload_kernel").raw(populate).op("SETITEM").op("POP").done(), "something already holds")
    # a pickle's own top-level containers may hold one, as before: nothing restores them into an object
    assert picklescan.scan(Asm().op("EMPTY_DICT").s("fn").raw(populate).op("SETITEM").done()).ok
    assert picklescan.scan(Asm().op("EMPTY_LIST").raw(populate).op("TUPLE1").op("APPEND").done()).ok


def test_what_a_loaded_autotuner_calls_holds_what_torch_pickles_there():
    """`_reload_kernel()` and `_cached_launcher(*args, stream=)`: None; `save_cache_hook`: None or a bound method;
    `launchers` (each called with the kernel's arguments): an empty list, also at the pickle's end."""
    fn = bytes(Asm(2).g("torch._inductor.decomposition", "select_decomp_table").b[2:])
    for key in ("_reload_kernel", "_cached_launcher", "save_cache_hook"):
        _refused(_autotuner(None, bytes(Asm(2).s(key).b[2:]) + fn), f"as {key!r}")
        assert picklescan.scan(_autotuner(None, bytes(Asm(2).s(key).op("NONE").b[2:]))).ok
    _refused(_autotuner(None, bytes(Asm(2).s("launchers").op("EMPTY_TUPLE").b[2:])), "as 'launchers'")
    assert picklescan.scan(_autotuner(None, bytes(Asm(2).s("launchers").op("EMPTY_LIST").b[2:]))).ok
    a = Asm().op("EMPTY_LIST").put(1).op("POP").g(TH, "CachingAutotuner").op("EMPTY_TUPLE").op("NEWOBJ").op("EMPTY_DICT")
    a.s("inductor_meta").op("EMPTY_DICT").op("SETITEM").s("launchers").get(1).op("SETITEM").op("BUILD").op("POP")
    _refused(a.get(1).op("NONE").op("APPEND").done(), "launchers list with items")  # filled after its BUILD


# --- 3. torch's own CachingAutotuner, pickled as a CUDA entry pickles it -----------------------------------------
def test_an_autotuner_pickled_as_torch_pickles_it_passes(tmp_path, monkeypatch):
    """TritonBundler.put_static_autotuner: prepare_for_pickle (the JITFunction's repr becomes a _ConstRepr),
    deepcopy, `_reload_kernel = None`, pickled with its JITFunction (`device_caches = defaultdict(
    self.create_binder)`) and `save_cache_hook = autotune_cache.save`. Built by torch's own constructor (CPU
    device properties): needs triton, which torch 2.13 for CPU lacks."""
    if not _HAS_TRITON:
        pytest.skip("no triton here (torch 2.13+cpu): CachingAutotuner takes a triton JITFunction")
    import torch
    from torch._inductor.runtime import triton_heuristics as th
    from torch._inductor.runtime.hints import DeviceProperties, HeuristicType

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    path = tmp_path / KEY[1:3] / f"{KEY}.py"
    path.parent.mkdir()
    path.write_text("import triton\n@triton.jit\ndef triton_poi_fused_add_0(x):\n    pass\n")
    spec = importlib.util.spec_from_file_location("s16b_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    configs = [th.Config({"XBLOCK": n}, num_warps=4, num_stages=1) for n in (64, 128)]
    meta = {"autotune_local_cache": True, "kernel_name": "triton_poi_fused_add_0"}
    _, ac, info = th.check_autotune_cache(configs, str(path), meta)
    assert ac is not None
    tuner = th.CachingAutotuner(module.triton_poi_fused_add_0, {"device": DeviceProperties.create(torch.device("cpu"))},
                                configs, ac and ac.save, [], False, HeuristicType.POINTWISE, size_hints={"x": 1024},
                                inductor_meta=meta, filename=str(path), autotune_cache_info=info)
    tuner.prepare_for_pickle()
    kept = copy.deepcopy(tuner)
    kept._reload_kernel = None
    blob = pickle.dumps(kept, protocol=4)
    assert b"create_binder" in blob and b"_ConstRepr" in blob and b"save_cache_hook" in blob
    r = picklescan.scan(blob)
    assert r.ok, r
    # the same with its filename pointed one directory up, or its hook bound elsewhere: refused
    kept.filename = str(tmp_path / KEY[1:3] / ".." / f"{KEY}.py")
    _refused(pickle.dumps(kept, protocol=4), "not a kernel's file as torch names it")
    kept.filename, kept._reload_kernel = str(path), ac.save
    _refused(pickle.dumps(kept, protocol=4), "as '_reload_kernel'")
    # a launch-tensor dump (the pickled dump_launch_tensors) writes to <kernel dir>/<fn.__name__>_run_<n>/
    kept._reload_kernel, kept.fn.__name__ = None, "../../../elsewhere/x"
    _refused(pickle.dumps(kept, protocol=4), "not a function's name")


# --- 4. a triton bundle's artifacts, written as the entry loads ---------------------------------------------------
_EMIT = "from torch._inductor.triton_bundler import TritonBundler\nprint('emitted', TritonBundler.read_and_emit(x))\n"


def _bundle(kernel_hash: object, device: object, filename: object, payload: bytes = b"echo the pickle's\n") -> bytes:
    from torch._inductor.triton_bundler import TritonBundle, TritonKernelArtifact, TritonKernelArtifacts

    return pickle.dumps(TritonBundle([TritonKernelArtifacts(kernel_hash, device, [TritonKernelArtifact(filename, payload)])],
                                     []), protocol=4)


def test_a_triton_bundles_artifacts_go_where_their_names_say_and_only_torchs_form_passes(tmp_path):
    """On every FX-graph cache hit (CompiledFxGraph's `_triton_bundle`; bundling is on by default outside fbcode) and
    as the Mega-Cache loads an inductor artifact, TritonBundler.read_and_emit writes each artifact's payload to
    os.path.join(<triton cache>/<device>/tmp.<uuid>, filename), then moves that directory to
    <triton cache>/<device>/<kernel_hash>: an absolute filename, kernel_hash or device puts the pickle's bytes
    anywhere (2.11, 2.13, 2.15)."""
    import torch._inductor.triton_bundler as bundler

    assert "os.path.join(tmp_dir, artifact.filename)" in inspect.getsource(bundler.TritonBundler.read_and_emit)
    path_key = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567ABCDEFGHIJKLMNOPQRST"
    real = _bundle(path_key, 0, "triton_poi_fused_add_0.cubin")
    assert picklescan.scan(real).ok, picklescan.scan(real)
    for name in ("__grp__triton_poi_fused_add_0.json", "triton_poi_fused_add_0.ttgir"):
        assert picklescan.scan(_bundle("0a1b2c", 3, name)).ok
    victim = tmp_path / "home" / ".bashrc"
    by_name = _bundle(path_key, 0, str(victim))
    _refused(by_name, "not a triton artifact's file name")
    for bad in ("../../../home/.bashrc", ".bashrc", "..", "a/b.cubin", "x.cubin\n", b"x.cubin"):
        _refused(_bundle(path_key, 0, bad), "not a triton artifact's file name")
    elsewhere = tmp_path / "elsewhere"
    by_hash = _bundle(str(elsewhere), 0, "sitecustomize.py")
    _refused(by_hash, "not triton's path key")
    _refused(_bundle("../x", 0, "a.cubin"), "not triton's path key")
    by_device = _bundle(path_key, str(elsewhere), "sitecustomize.py")
    _refused(by_device, "not an int")
    # the same fields given to the constructor, or on another class's instance (torch reads them off anything)
    for cls, args in (("TritonKernelArtifact", (str(victim), b"x")), ("TritonKernelArtifacts", (str(elsewhere), 0, []))):
        a = Asm().g("torch._inductor.triton_bundler", cls).op("MARK")
        for v in args:
            a.s(v) if isinstance(v, str) else a.by(v) if isinstance(v, bytes) else a.raw(_frag(v))
        _refused(a.op("TUPLE").op("REDUCE").done(), "called with arguments")
    a = Asm().g(TH, "CachingAutotuner").op("EMPTY_TUPLE").op("NEWOBJ").op("EMPTY_DICT").s("inductor_meta").op("EMPTY_DICT")
    a.op("SETITEM").s("filename").s(str(victim)).op("SETITEM").s("payload").by(b"x").op("SETITEM").op("BUILD")
    _refused(a.done(), "not a triton artifact's file name")

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop("TRITON_CACHE_DIR", None)
    env.pop("TORCHINDUCTOR_BUNDLE_TRITON_INTO_FX_GRAPH_CACHE", None)
    victim.parent.mkdir()
    victim.write_text("export PATH=$PATH:/usr/local/bin\n")
    out = _load(by_name, modules="torch._inductor.triton_bundler", mem=1024 * MiB, cpu=120, after=_EMIT, env=env)
    assert "emitted" in out.stdout and victim.read_text() == "echo the pickle's\n", (out.stdout, out.stderr[-3000:])
    for blob in (by_hash, by_device):
        out = _load(blob, modules="torch._inductor.triton_bundler", mem=1024 * MiB, cpu=120, after=_EMIT, env=env)
        assert "emitted" in out.stdout, (out.stdout, out.stderr[-3000:])
    assert (elsewhere / "sitecustomize.py").read_bytes() == b"echo the pickle's\n"  # the kernel_hash's directory
    assert next(elsewhere.glob(f"{path_key}/sitecustomize.py")).read_bytes() == b"echo the pickle's\n"  # the device's
    out = _load(real, modules="torch._inductor.triton_bundler", mem=1024 * MiB, cpu=120, after=_EMIT, env=env)
    assert (tmp_path / "inductor" / "triton" / "0" / path_key / "triton_poi_fused_add_0.cubin").exists(), out
