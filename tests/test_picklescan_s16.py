"""picklescan red-team pass (session 16): files torch writes where a pickle says (an autotuner's best config, an
FX graph's source, a launcher's cubin), hash collisions the model did not count, a constructor that dlopens.

- `AutotuneCache.local_cache` is `(LocalAutotuneCache(), <path>)`; `AutotuneCache.save` -- the pickled
  autotuner's `save_cache_hook`, called when the kernel next autotunes -- writes the best config to that
  path as JSON (makedirs, then write_atomic), and `_read` reads it. A pickle named `~/.bashrc`: torch
  overwrote it. The scan now takes only the path torch makes: `<dir>/<2 characters>/<64 hex>.best_config`.
- Floats: a float m * 2**e hashes as m * 2**(e mod 61) mod 2**61-1, so 201 distinct floats share one hash
  (with ints past 2**61 and `complex(h - 1000003 * b, b)`, as many as wanted). The model counted none, and
  charged a copy of a container (`set(GET n)`) one step a key though each key probes every earlier one on
  its hash: a 50 KB pickle of 8000 such copies took 5 s to load, a 33 KB one of 1231 keys (1000 complex)
  copied 1400 times 36 s (modeled: 1.8e6 steps). Floats are counted now, and probes are charged.
- More paths torch writes that a state names (`paths`): an AutotuneCache's `artifact_recorder` key (2.13,
  2.15; the Mega-Cache writes <cache dir>/<key>), a CompiledFxGraph's `cache_key` (on every hit torch writes
  its source_code to <cache dir>/<key[1:3]>/<key>.py: an absolute key wrote a sitecustomize.py), a static
  launcher's `name` / `hash` and its compile result's `compile_meta["device"]` (the cubin torch writes as it
  loads a CUDA entry: anywhere).
- CompiledAOTI called by a pickle: its __post_init__ (under config.enable_autograd_for_aot) dlopens the
  `filename` the pickle names, then writes its `_cached_files` where they say.

Each unscanned exploit is unpickled in a child process under an address-space and a CPU limit; it writes
only inside tmp_path. What it did is asserted, never timed.
"""

from __future__ import annotations

import math
import os
import pickle
import struct
from types import SimpleNamespace

import pytest

from compilewatch.cache.trust import loadcost, picklescan
from tests.test_picklescan_adversarial import Asm
from tests.test_picklescan_s15 import P61, _load, _model, _refused

MiB = 1 << 20
H = 1 | 1 << 10 | 1 << 20 | 1 << 30 | 1 << 40 | 1 << 50  # six bits 10 apart: each rotation fits 53 bits


# --- 1. AutotuneCache.local_cache -----------------------------------------------------------------
def _autotune_cache(tmp_path):
    """What torch makes for a kernel whose code is `<cache dir>/ab/c....py` (the local cache on)."""
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    kernel = tmp_path / "inductor" / "ab" / ("c" + "abcdefghijklmnopqrstuvwxyz234567" * 2)[:52]
    ac = AutotuneCache.create({"autotune_local_cache": True}, f"{kernel}.py", "the-configs-hash")
    assert ac is not None and ac.remote_cache is None
    return ac


def _with_path(ac, path: object, *, kind=tuple):
    import copy

    ac = copy.copy(ac)
    ac.local_cache = kind((ac.local_cache[0], path))
    return ac


_WRITE = (
    "from types import SimpleNamespace\n"
    "x.save(SimpleNamespace(kwargs={'XBLOCK': 64}, num_warps=4, num_stages=1), 5_000_000)\n"
    "print('wrote', x.local_cache[1])\n"
)


def test_an_autotune_cache_writes_its_best_config_where_its_local_cache_says_and_a_foreign_path_is_refused(tmp_path):
    ac = _autotune_cache(tmp_path)
    made = ac.local_cache[1]
    rel = os.path.relpath(made, tmp_path / "inductor").split(os.sep)
    assert rel[0] == "ab" and len(rel) == 2 and rel[1].endswith(".best_config") and len(rel[1]) == 64 + 12, made
    real = pickle.dumps(ac, protocol=4)
    assert picklescan.scan(real).ok, picklescan.scan(real)
    # another machine's cache names that machine's cache dir: torch writes there, and the scan takes it
    moved = made.replace(str(tmp_path / "inductor"), "/home/alice/.cache/torchinductor_alice")
    assert picklescan.scan(pickle.dumps(_with_path(ac, moved), protocol=4)).ok
    assert picklescan.scan(pickle.dumps(_with_path(ac, os.path.join("rel", *rel)), protocol=4)).ok

    victim = tmp_path / "home" / ".bashrc"
    victim.parent.mkdir()
    victim.write_text("export PATH=$PATH:/usr/local/bin\n")
    evil = pickle.dumps(_with_path(ac, str(victim)), protocol=4)
    _refused(evil, "not a file torch makes")
    for path in (made.replace("/ab/", "/ab/../../.."), made + "/../.bashrc", made.replace("/ab/", "/a/"),
                 made.replace("/ab/", "/ab//"), made.replace(".best_config", ".py"), "ab/" + os.path.basename(made) + "\n"):
        _refused(pickle.dumps(_with_path(ac, path), protocol=4), "not a file torch makes")
    _refused(pickle.dumps(_with_path(ac, str(victim).encode()), protocol=4), "not a string")
    _refused(pickle.dumps(_with_path(ac, made, kind=list), protocol=4), "only (LocalAutotuneCache()")
    swapped = _with_path(ac, made)
    swapped.local_cache = (ac.local_cache[0].backend, made)  # its backend, not the cache
    _refused(pickle.dumps(swapped, protocol=4), "not torch's LocalAutotuneCache")

    class Called:  # AutotuneCache("h", (cache, path)): its dataclass __init__ stores it, no __setstate__
        def __reduce__(self):
            return type(ac), ("h", (ac.local_cache[0], str(victim)))

    _refused(pickle.dumps(Called(), protocol=4), "called with arguments")

    # unscanned: torch writes the best config over the pickle's file when the kernel autotunes
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    out = _load(evil, modules="torch._inductor.runtime.autotune_cache", mem=1024 * MiB, cpu=120, after=_WRITE, env=env)
    assert f"wrote {victim}" in out.stdout, (out.stdout, out.stderr[-2000:])
    written = victim.read_text()
    assert "PATH" not in written and '"configs_hash": "the-configs-hash"' in written and '"XBLOCK": 64' in written
    out = _load(real, modules="torch._inductor.runtime.autotune_cache", mem=1024 * MiB, cpu=120, after=_WRITE, env=env)
    assert f"wrote {made}" in out.stdout and '"XBLOCK": 64' in open(made).read(), (out.stdout, out.stderr[-2000:])


def test_an_autotuner_holding_a_foreign_autotune_cache_as_its_save_hook_is_refused(tmp_path):
    """CachingAutotuner keeps `save_cache_hook = autotune_cache.save`: pickled as getattr(<the cache>, 'save')."""
    ac = _autotune_cache(tmp_path)
    victim = str(tmp_path / "home" / ".bashrc")
    a = Asm().g("torch._inductor.runtime.triton_heuristics", "CachingAutotuner").op("EMPTY_TUPLE").op("NEWOBJ")
    a.op("EMPTY_DICT").s("save_cache_hook").g("builtins", "getattr")
    for path, ok in ((ac.local_cache[1], True), (victim, False)):
        inner = pickle.dumps(_with_path(ac, path), protocol=4)[2:-1]  # the AutotuneCache, unframed
        inner = inner[9:] if inner[:1] == b"\x95" else inner
        blob = bytes(a.b) + inner + Asm(2).s("save").op("TUPLE2").op("REDUCE").op("SETITEM").op("BUILD").done()[2:]
        r = picklescan.scan(blob)
        assert r.ok == ok and r.problem is None, r
        if not ok:
            assert any("local_cache" in why for why in r.refused), r


# --- 2. keys sharing a hash: floats, and copies --------------------------------------------------------
def _floats_sharing(h: int) -> list[float]:
    """Every float whose hash is h: m * 2**e with m = h * 2**-j mod 2**61-1 < 2**53 and e = j mod 61."""
    out = set()
    for j in range(61):
        m = h * pow(2, -j, P61) % P61
        if m >> 53:
            continue
        for e in range(-1134, 1024 - m.bit_length()):
            if (e - j) % 61 == 0:
                x = math.ldexp(m, e)
                if x and hash(x) == h:
                    out.add(x)
    return sorted(out)


def _dict_of(keys: list[object]) -> bytes:
    a = Asm().op("EMPTY_DICT").op("MARK")
    for k in keys:
        if isinstance(k, float):
            a.raw(b"G" + struct.pack(">d", k))
        else:
            b = int(k).to_bytes(16, "little", signed=True)
            a.raw(b"\x8a" + bytes([len(b)]) + b)
        a.op("NONE")
    return a.op("SETITEMS").done()


def test_floats_sharing_one_hash_are_counted_and_refused():
    floats = _floats_sharing(H)
    assert len(floats) == 201 and {hash(x) for x in floats} == {H} and len(set(floats)) == 201
    assert sum(x == H for x in floats) == 1  # one of them, H itself as a float, is the key H (not counted)
    _refused(_dict_of(floats), f"sharing the hash {H}")
    _refused(pickle.dumps(set(floats), protocol=4), f"sharing the hash {H}")
    _refused(pickle.dumps(frozenset(floats), protocol=4), f"sharing the hash {H}")
    _refused(pickle.dumps(set(floats), protocol=2), "share a hash")  # set(<a list>): the list's items
    ints = [H + k * P61 for k in range(1, 21)]
    mixed = [x for x in floats if x != H][:20] + ints
    assert len({hash(x) for x in mixed}) == 1 and len(set(mixed)) == 40
    _refused(_dict_of(mixed), f"sharing the hash {H}")
    assert picklescan.scan(_dict_of(mixed[:16] + ints[:16])).ok
    # equal keys are one key (1, 1.0 and True; 0.0 and -0.0): not a chain, whatever the pickle repeats
    assert picklescan.scan(_dict_of([1, 1.0, 0.0, -0.0] * 40)).ok
    assert picklescan.scan(pickle.dumps({**dict.fromkeys([0.0, -0.0, 1.0]), True: 1, 1: 2}, protocol=4)).ok
    # what real pickles hold: floats of distinct hashes, many of them
    assert picklescan.scan(pickle.dumps({i / 7: i * 0.5 for i in range(5000)}, protocol=4)).ok
    assert picklescan.scan(pickle.dumps([0.1] * 5000, protocol=4)).ok


def _complex_sharing(h: int, n: int) -> list[complex]:
    return [complex(h - 1000003 * b, b) for b in range(n)]  # hash(real) + 1000003 * hash(imag)


def _set_copies(n: int, k: int) -> bytes:
    """memo 1: a list of n `complex(h - 1000003 * b, b)` (numbers a call made: the scan cannot hash them);
    then a list of k `set(GET 1)`."""
    a = Asm().op("EMPTY_LIST").op("MARK").g("builtins", "complex").put(3).op("POP")
    for x in _complex_sharing(H, n):
        a.get(3).raw(b"G" + struct.pack(">d", x.real)).raw(b"G" + struct.pack(">d", x.imag)).op("TUPLE2").op("REDUCE")
    a.op("APPENDS").put(1).op("POP").g("builtins", "set").put(2).op("POP").op("EMPTY_LIST").op("MARK")
    for _ in range(k):
        a.get(2).get(1).op("TUPLE1").op("REDUCE")
    return a.op("APPENDS").done()


def test_copies_of_keys_sharing_a_hash_are_charged_their_probes_and_refused():
    n = 1000
    assert {hash(x) for x in _complex_sharing(H, n)} == {H}
    probes = loadcost.PROBE_STEP * n * (n - 1) // 2  # each key probes every earlier one on its hash
    one, two = _model(_set_copies(n, 1)).work, _model(_set_copies(n, 2)).work
    assert one >= probes and two - one >= probes, (one, two)  # each copy re-inserts every key
    blob = _set_copies(n, 1400)  # 33 KB: 1400 copies took 36 s to load (36 s of CPU before: not timed here)
    _refused(blob, "steps of hashing")
    assert picklescan.scan(_set_copies(n, 40)).ok
    # unscanned, a few copies: each set holds n keys on one hash (what makes each insertion probe them all)
    out = _load(_set_copies(n, 3), mem=256 * MiB, cpu=60,
                after="print('sets', len(x), {len(s) for s in x}, len({hash(v) for s in x for v in s}))\n")
    assert f"sets 3 {{{n}}} 1" in out.stdout, (out.stdout, out.stderr[-2000:])


def test_real_caches_hash_no_keys_together():
    """A real entry's keys: strings, small ints, tuples of them: no probes charged (the s15 real-cache test
    runs a fresh torch cache through the whole model)."""
    real = {**{f"k{i}": i for i in range(2000)}, **{i: None for i in range(2000)}, **{(i, 0.5): 0 for i in range(2000)}}
    blob = pickle.dumps([real, set(range(3000)), frozenset(f"s{i}" for i in range(100))], protocol=4)
    assert picklescan.scan(blob).ok
    assert _model(blob).work <= len(blob) // 4, _model(blob).work


@pytest.mark.parametrize("proto", [2, 4])
def test_a_memod_float_key_repeated_is_one_key(proto):
    """SETITEMS of one memo'd float many times: one key (dict replaces it); counted as a chain all the same."""
    x = _floats_sharing(H)[5]
    a = Asm(proto).raw(b"G" + struct.pack(">d", x)).put(1).op("POP").op("EMPTY_DICT").op("MARK")
    for _ in range(40):
        a.get(1).op("NONE")
    blob = a.op("SETITEMS").done()
    assert pickle.loads(blob) == {x: None}
    _refused(blob, "sharing the hash")  # the scan does not tell equal keys from colliding ones: never real


# --- 3. a static launcher's cubin, written as the entry loads ----------------------------------------------
_LAUNCHERS = "torch._inductor.runtime.static_triton_launcher"


def _static_result(name: str, digest: str, device: bytes, then: bytes = b"") -> bytes:
    """StaticTritonCompileResult(kernel=<launcher: name, hash, cubin_raw>, compile_meta={device, "cuda"}); the
    compile_meta dict is memo 7 (`then` may fill it after the BUILD)."""
    launcher = Asm(2).g(_LAUNCHERS, "StaticallyLaunchedCudaKernel").op("EMPTY_TUPLE").op("NEWOBJ").op("EMPTY_DICT")
    for k, v in (("name", name), ("hash", digest)):
        launcher.s(k).s(v).op("SETITEM")
    launcher.s("cubin_raw").by(b"the pickle's bytes").op("SETITEM").s("cubin_path").op("NONE").op("SETITEM")
    launcher.s("module").op("NONE").op("SETITEM").s("modules").op("EMPTY_DICT").op("SETITEM").op("BUILD")
    a = Asm().g("torch._inductor.runtime.triton_heuristics", "StaticTritonCompileResult").op("EMPTY_TUPLE").op("NEWOBJ")
    a.op("EMPTY_DICT").s("kernel").raw(bytes(launcher.b[2:])).op("SETITEM")
    a.s("compile_meta").op("EMPTY_DICT").put(7).s("device").raw(device).op("SETITEM").s("device_type").s("cuda").op("SETITEM")
    return a.op("SETITEM").op("BUILD").raw(then).done()


_RELOAD = "x.reload_cubin_path()\nprint('cubin', x.kernel.cubin_path)\n"


def test_a_static_launchers_cubin_goes_where_its_name_hash_and_device_say_and_only_torchs_form_passes(tmp_path):
    """As TritonBundler.load_autotuners loads a CUDA entry, `reload_cubin_path` writes the launcher's cubin_raw
    to <triton cache dir(device)>/<path key of hash>/<name>.cubin if it is missing: all three are the pickle's."""
    pytest.importorskip("torch._inductor.runtime.static_triton_launcher")
    real = _static_result("triton_poi_fused_add_0", "0a1b2c", b"K\x00")
    assert picklescan.scan(real).ok, picklescan.scan(real)
    assert picklescan.scan(_static_result("triton_poi_fused_add_0", "0a1b2c", b"N")).ok
    elsewhere = tmp_path / "elsewhere"
    by_name = _static_result(str(elsewhere / "evil"), "0a1b2c", b"K\x00")
    _refused(by_name, "not a kernel's identifier")
    _refused(_static_result("triton_poi_fused_add_0", "../../../elsewhere", b"K\x00"), "not hex digits")
    by_device = _static_result("triton_poi_fused_add_0", "0a1b2c", Asm(2).s(str(elsewhere)).b[2:])
    _refused(by_device, "not an int")
    later = _static_result("triton_poi_fused_add_0", "0a1b2c", b"K\x00", b"h\x07" + Asm(2).s("device").s(str(elsewhere)).b[2:] + b"s0")
    _refused(later, "not an int")  # the dict is the result's own: filled after its BUILD, torch still reads it
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop("TRITON_CACHE_DIR", None)
    modules = "torch._inductor.runtime.triton_heuristics," + _LAUNCHERS
    for blob, where in ((by_name, elsewhere / "evil.cubin"), (by_device, elsewhere / "0a1b2c" / "triton_poi_fused_add_0.cubin")):
        out = _load(blob, modules=modules, mem=1024 * MiB, cpu=120, after=_RELOAD, env=env)
        if "0a1b2c" in str(where) and f"cubin {where}" not in out.stdout:  # triton present: the hash's path key
            where = next(elsewhere.glob("*/triton_poi_fused_add_0.cubin"))
        assert f"cubin {where}" in out.stdout, (out.stdout, out.stderr[-2000:])
        assert where.read_bytes() == b"the pickle's bytes"
    out = _load(real, modules=modules, mem=1024 * MiB, cpu=120, after=_RELOAD, env=env)
    assert f"cubin {tmp_path / 'inductor' / 'triton' / '0'}/" in out.stdout, (out.stdout, out.stderr[-2000:])


def test_an_autotune_caches_artifact_recorder_keeps_torchs_key_only(tmp_path):
    """2.13, 2.15: AutotuneCache.create makes CacheArtifactRecorder("autotune", "<2>/<hex>.best_config") (the
    best-config path's last two components); `record` files each best config under that key for the
    Mega-Cache, whose load writes it to <cache dir>/<key>. 2.11 has no recorder."""
    ac = _autotune_cache(tmp_path)
    recorder = getattr(ac, "artifact_recorder", None)
    assert (recorder is None) == ("artifact_recorder" not in type(ac).__dataclass_fields__)
    if recorder is None:
        return
    assert recorder.artifact_type == "autotune" and recorder.key == "/".join(ac.local_cache[1].split(os.sep)[-2:])
    assert picklescan.scan(pickle.dumps(ac, protocol=4)).ok  # what torch pickles (the s15 pass refused its class)
    import copy
    import dataclasses

    for changed in ({"key": "../../outside/x.best_config"}, {"key": "../" + recorder.key}, {"artifact_type": "inductor"}):
        evil = copy.copy(ac)
        evil.artifact_recorder = dataclasses.replace(recorder, **changed)
        _refused(pickle.dumps(evil, protocol=4), "torch records best configs under that key")

    class Called:
        def __reduce__(self):
            return type(recorder), ("autotune", "../../outside/x.best_config")

    _refused(pickle.dumps(Called(), protocol=4), "called with arguments")


# --- 4. an FX-graph entry's source, written where its cache_key says -------------------------------------
def _fx_graph(key: str) -> bytes:
    a = Asm().g("torch._inductor.output_code", "CompiledFxGraph").op("EMPTY_TUPLE").op("NEWOBJ").op("EMPTY_DICT")
    a.s("cache_key").s(key).op("SETITEM").s("source_code").s("print('the pickle runs in every python')\n")
    return a.op("SETITEM").op("BUILD").done()


def test_an_fx_graph_writes_its_source_where_its_cache_key_says_and_only_torchs_keys_pass(tmp_path):
    """On every FX-graph cache hit, `after_deserialization` calls `write_to_disk()`: the entry's source_code to
    get_path(cache_key, "py") (<cache dir>/<key[1:3]>/<key>.py) if missing. The real-cache test (s15) scans
    torch's own entries, keys included."""
    key = "f" + "abcdefghijklmnopqrstuvwxyz234567" * 2
    real = _fx_graph(key[:52])
    assert picklescan.scan(real).ok, picklescan.scan(real)
    site = tmp_path / "site-packages" / "sitecustomize"
    evil = _fx_graph(str(site))
    _refused(evil, "not a key torch makes")
    for bad in ("f/../../../x", "fab.cd", "", "f\nx"):
        _refused(_fx_graph(bad), "not a key torch makes")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    out = _load(evil, modules="torch._inductor.output_code", mem=1024 * MiB, cpu=120,
                after="print('wrote', x.write_to_disk())\n", env=env)
    assert f"wrote {site}.py" in out.stdout, (out.stdout, out.stderr[-2000:])
    assert site.with_suffix(".py").read_text() == "print('the pickle runs in every python')\n"
    out = _load(real, modules="torch._inductor.output_code", mem=1024 * MiB, cpu=120,
                after="print('wrote', x.write_to_disk())\n", env=env)
    assert f"wrote {tmp_path / 'inductor' / key[1:3] / key[:52]}.py" in out.stdout, (out.stdout, out.stderr[-2000:])


# --- 5. CompiledAOTI's __post_init__ ------------------------------------------------------------------------
def test_a_compiled_aoti_called_by_a_pickle_would_load_its_so_and_is_refused(tmp_path):
    """CompiledAOTI.__post_init__, under config.enable_autograd_for_aot (off by default), hands its `filename` to
    an AOTI runner (dlopen) and then writes each `_cached_files` entry to the path it names. torch pickles it by
    its state (NEWOBJ + BUILD: no __post_init__), which passes; a REDUCE of the class runs it."""
    import dataclasses

    from torch._inductor.output_code import CompiledAOTI

    so = tmp_path / "not-a-model.so"
    fields = [f.name for f in dataclasses.fields(CompiledAOTI) if f.init]
    args = tuple({"filename": str(so), "device_type": "cpu"}.get(f) for f in fields[:fields.index("device_type") + 1])

    class Called:
        def __reduce__(self):
            return CompiledAOTI, args

    blob = pickle.dumps(Called(), protocol=4)
    _refused(blob, "CompiledAOTI called: its __init__ runs its own code")
    assert picklescan.scan(pickle.dumps(CompiledAOTI(*args), protocol=4)).ok  # what torch pickles
    prelude = "import torch._inductor.config as c\nc.enable_autograd_for_aot = True\n"
    out = _load(blob, modules="torch._inductor.output_code", mem=2048 * MiB, cpu=120, prelude=prelude)
    assert "dlopen" in out.stdout and str(so) in out.stdout, (out.stdout, out.stderr[-2000:])  # the runner dlopened it
    out = _load(blob, modules="torch._inductor.output_code", mem=2048 * MiB, cpu=120)
    assert "loaded" in out.stdout, (out.stdout, out.stderr[-2000:])  # off by default: stored only


def test_a_slot_state_is_read_as_the_dict_state_is():
    """BUILD's (dict, slots) state sets the slots with setattr after the dict: the paths are checked in both."""
    def slot_state(module: str, cls: str, key: str, value: str) -> bytes:
        a = Asm().g(module, cls).op("EMPTY_TUPLE").op("NEWOBJ").op("NONE").op("EMPTY_DICT").s(key).s(value)
        return a.op("SETITEM").op("TUPLE2").op("BUILD").done()

    fx = ("torch._inductor.output_code", "CompiledFxGraph")
    _refused(slot_state(*fx, "cache_key", "/somewhere/sitecustomize"), "not a key torch makes")
    launcher = (_LAUNCHERS, "StaticallyLaunchedCudaKernel")
    r = picklescan.scan(slot_state(*launcher, "name", "/somewhere/x"))  # 2.13, 2.15: also for the __del__ it has
    assert any("not a kernel's identifier" in why or "its own __del__ reads it" in why for why in r.refused), r
