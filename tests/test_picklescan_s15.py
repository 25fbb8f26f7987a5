"""picklescan red-team pass (session 15): pickles the scan passed that, unpickled, took memory or time
without bound, crashed the interpreter, or made the loading process build a Redis client.

- A memo'd value copied k times by allowed calls (`bytearray(GET n)`, `list(GET n)`, `set`, `OrderedSet`,
  `OrderedDict`, `_codecs.encode`, a BUILD copying a shared state): k * L bytes for a few bytes each.
  `loadcost` models what the load allocates and refuses past max(64 MiB, 8x the pickle).
- `AutotuneCache.__setstate__` with a `remote_cache` builds a RemoteAutotuneCache (a Redis client in a
  key namespace the pickle names, which torch reads and writes when it autotunes); CachingAutotuner's
  with `incremental_autotune` imports a plugin module.
- Hashing: a tuple nested 1e6 deep as a dict key crashes the interpreter (SIGSEGV: tuplehash recurses in
  C without a limit); tuples sharing a tuple 60 times over take 2**60 steps; keys chosen to share one
  hash make each insertion probe every earlier one.
- `str(<shared tuple>)` is a repr 2**60 long; `torch.Tensor(n)` allocates n floats; a torch.save storage
  id declares its size; sympy's Max is quadratic in its arguments; a torch source's `__post_init__`
  walks its index each time (`ConstantVariable.is_literal`).

Each unscanned exploit is unpickled in a child process under an address-space and a CPU limit (set
after the modules it names are imported): what it did is asserted, never timed.
"""

from __future__ import annotations

import io
import pickle
import random
import resource
import socket
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import NamedTuple

import pytest

from compilewatch.cache.trust import loadcost, picklescan
from tests.test_picklescan_adversarial import Asm

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
P61 = (1 << 61) - 1

_CHILD = r'''
import importlib, os, pickle, resource, sys
events = []
def hook(event, args):
    if event == "socket.connect":
        events.append(["connect", repr(args[1])])
    elif event == "import" and args and ".fb" in str(args[0]):
        events.append(["import", str(args[0])])
for m in filter(None, sys.argv[1].split(",")):
    importlib.import_module(m)
sys.addaudithook(hook)
mem, cpu = int(sys.argv[2]), int(sys.argv[3])
blob = sys.stdin.buffer.read()
if mem:
    with open("/proc/self/statm") as f:
        vsz = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vsz + mem, vsz + mem))
if cpu:
    used = resource.getrusage(resource.RUSAGE_SELF)
    limit = int(used.ru_utime + used.ru_stime) + cpu
    resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 1))
try:
    x = pickle.loads(blob)
    print("loaded", flush=True)
except Exception as e:
    x = None
    print("error", type(e).__name__, str(e)[:200].replace("\n", " "), flush=True)
'''


def _no_core() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


class _Out(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def _load(blob: bytes, *, modules: str = "", mem: int = 0, cpu: int = 0, after: str = "", prelude: str = "",
          env: dict[str, str] | None = None) -> _Out:
    """pickle.loads(blob) in a child: `modules` imported first (then `prelude` runs), then at most `mem` more
    bytes of address space and `cpu` more seconds of CPU; `after` runs on the result `x` (the audit events
    in `events`)."""
    code = _CHILD.replace("sys.addaudithook(hook)\n", "sys.addaudithook(hook)\n" + prelude, 1)
    p = subprocess.run([sys.executable, "-c", code + after, modules, str(mem), str(cpu)], input=blob,
                       capture_output=True, timeout=300, cwd=ROOT, env=env, preexec_fn=_no_core)
    return _Out(p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace"))


def _model(blob: bytes) -> loadcost.LoadCost:
    s = picklescan._Scan(picklescan.MAX_OPS, size=len(blob))
    assert s.run(io.BytesIO(blob)) is None
    return s.cost


def _refused(blob: bytes, words: str) -> None:
    r = picklescan.scan(blob)
    assert not r.ok and any(words in why for why in r.refused), r


def _frag(a: Asm) -> bytes:
    return bytes(a.b[2:])


# --- 1. copies of a memo'd value ------------------------------------------------------------------
def _copies(value: bytes, k: int, call: bytes, extra: bytes = b"") -> bytes:
    """memo 1 = value; memo 2 = the callee; a list of k `callee(GET 1[, extra])`."""
    a = Asm().raw(value).put(1).op("POP").raw(call).put(2).op("POP").op("EMPTY_LIST").op("MARK")
    for _ in range(k):
        a.get(2).get(1).raw(extra).op("TUPLE2" if extra else "TUPLE1").op("REDUCE")
    return a.op("APPENDS").done()


def _g(module: str, name: str) -> bytes:
    return _frag(Asm(2).g(module, name))


_BIG_BYTES = _frag(Asm(2).by(b"x" * MiB))
_BIG_STR = _frag(Asm(2).s("x" * MiB))
_NONES = b"](" + b"N" * 65536 + b"e"
_INTS = b"](" + b"".join(b"J" + struct.pack("<i", i) for i in range(65536)) + b"e"
_DICT = b"}(" + b"".join(_frag(Asm(2).s(f"k{i}")) + b"N" for i in range(4096)) + b"u"


def _build_copies(k: int) -> bytes:
    """k CodeId instances restored from one memo'd state dict of 4096 entries (each BUILD copies it)."""
    a = Asm().raw(_DICT).put(1).op("POP").g("torch._dynamo.pgo", "CodeId").put(2).op("POP").op("EMPTY_LIST").op("MARK")
    for _ in range(k):
        a.get(2).op("EMPTY_TUPLE").op("NEWOBJ").get(1).op("BUILD")
    return a.op("APPENDS").done()


COPY_BOMBS = {  # name: (pickle of k copies, k refused, k allowed)
    "bytearray(GET bytes)": (lambda k: _copies(_BIG_BYTES, k, _g("builtins", "bytearray")), 100, 8),
    "list(GET list)": (lambda k: _copies(_NONES, k, _g("builtins", "list")), 200, 8),
    "set(GET list)": (lambda k: _copies(_INTS, k, _g("builtins", "set")), 64, 4),
    "OrderedSet(GET list)": (lambda k: _copies(_INTS, k, _g("torch.utils._ordered_set", "OrderedSet")), 32, 4),
    "OrderedDict(GET dict)": (lambda k: _copies(_DICT, k, _g("collections", "OrderedDict")), 200, 8),
    "_codecs.encode(GET str)": (lambda k: _copies(_BIG_STR, k, _g("_codecs", "encode"), _frag(Asm(2).s("latin1"))),
                                100, 8),
    "BUILD from GET state": (_build_copies, 400, 16),
}


@pytest.mark.parametrize("name", sorted(COPY_BOMBS))
def test_copies_of_one_memod_value_are_charged_to_the_load_and_refused(name):
    make, bad, fine = COPY_BOMBS[name]
    _refused(make(bad), "the load would allocate more than")
    r = picklescan.scan(make(fine))
    assert r.ok, r  # a cap on what the load holds, not a ban on the call


@pytest.mark.parametrize("make, k, per_copy", [
    (lambda k: _copies(_BIG_BYTES, k, _g("builtins", "bytearray")), 600, MiB),
    (lambda k: _copies(_NONES, k, _g("builtins", "list")), 1100, 65536 * 8),
])
def test_a_copy_bomb_unscanned_takes_what_the_model_says(make, k, per_copy):
    """Before: the scan passed these (1 MB / 0.6 MB pickles); unpickled in 256 MiB they run out of memory
    (uncapped: 1 GB; `list` copies: 8.3 GB and 72 s for 2000 copies of a 2**19 list)."""
    blob = make(k)
    assert _model(blob).alloc >= k * per_copy  # the model counts at least what the copies hold
    _refused(blob, "the load would allocate more than")
    out = _load(blob, mem=256 * MiB)
    assert out.stdout.startswith("error MemoryError"), (out.stdout, out.stderr[-2000:])
    # and the model is near what CPython really allocates, for a load that fits
    small = make(6)
    tracemalloc.start()
    try:
        pickle.loads(small)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert 0.7 * peak <= _model(small).alloc <= 3 * peak + MiB, (peak, _model(small).alloc)


# --- real torch caches stay inside the budget ---------------------------------------------------------
@pytest.fixture(scope="module")
def real_cache(tmp_path_factory) -> Path:
    """A real CPU inductor cache of this torch: dynamic shapes, a module with a parameter and a buffer, SDPA,
    fwd+bwd, PGO state (tests/test_cache_real.py's script, compiled in a child with a private cache dir)."""
    from tests.test_cache_real import PGO_SCRIPT, compile_env

    base = tmp_path_factory.mktemp("s15-real-cache")
    (base / "compile.py").write_text(PGO_SCRIPT)
    (base / "tmp").mkdir()
    env = compile_env()
    env.update(TORCHINDUCTOR_CACHE_DIR=str(base / "inductor"), TORCHINDUCTOR_COMPILE_THREADS="1",
               TORCH_COMPILE_JOB_ID="compilewatch-s15", TMPDIR=str(base / "tmp"))
    out = subprocess.run([sys.executable, str(base / "compile.py")], env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return base / "inductor"


def test_real_torch_cache_pickles_stay_well_inside_the_budget(real_cache):
    seen: dict[str, int] = {}
    for f in sorted(p for p in real_cache.rglob("*") if p.is_file()):
        rel = f.relative_to(real_cache).as_posix()
        data = f.read_bytes()
        if not picklescan.is_pickle_file(rel, data[:1]):
            continue
        r = picklescan.scan(data)
        assert r.ok, (rel, r.refused, r.problem)
        cost = _model(data)
        # what the load allocates (every allocation, at CPython's sizes): ~1.6x an entry (tracemalloc: 1.7x)
        assert cost.alloc <= 4 * len(data) + 64 * 1024, (rel, len(data), cost.alloc)
        assert cost.work <= len(data) + 10_000, (rel, len(data), cost.work)
        seen[rel.split("/")[0]] = seen.get(rel.split("/")[0], 0) + 1
    assert seen.get("fxgraph", 0) >= 4 and seen.get("aotautograd", 0) >= 2 and seen.get("dynamo", 0) >= 1, seen


# --- 2. AutotuneCache and CachingAutotuner restores ------------------------------------------------
def _restored(module: str, name: str, state: dict[str, object]) -> bytes:
    a = Asm().g(module, name).op("EMPTY_TUPLE").op("NEWOBJ").op("EMPTY_DICT").op("MARK")
    _items(a, state)
    return a.op("SETITEMS").op("BUILD").done()


def _items(a: Asm, d: dict[str, object]) -> None:
    for k, v in d.items():
        a.s(k)
        if isinstance(v, dict):
            a.op("EMPTY_DICT").op("MARK")
            _items(a, v)
            a.op("SETITEMS")
        elif isinstance(v, str):
            a.s(v)
        else:
            a.raw(b"N" if v is None else b"\x88" if v else b"\x89")


AUTOTUNE_CACHE = ("torch._inductor.runtime.autotune_cache", "AutotuneCache")
REMOTE_STATE = {"configs_hash": "h", "local_cache": None, "remote_cache": "best-config-key",
                "remote_cache_full_key": "attacker-namespace", "is_fbcode": False}


def _closed_port() -> int:
    with socket.socket() as s:  # bound, never listening: a connect is refused at once
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_pickled_autotune_cache_with_a_remote_cache_builds_a_redis_client_and_is_refused(tmp_path):
    """torch 2.13 and 2.15: `AutotuneCache.__setstate__` calls `create_cache(remote_cache_full_key, is_fbcode,
    "FbRemoteAutotuneCache", "RemoteAutotuneCache")`: a RemoteAutotuneCache whose Redis client goes to
    TORCHINDUCTOR_REDIS_URL/_HOST/_PORT (localhost:6379 by default), keys `pt2:<the pickle's key>::...`,
    connected when torch first reads a best config through it (`AutotuneCache._read`); with is_fbcode it
    imports torch._inductor.fb.remote_cache."""
    blob = _restored(*AUTOTUNE_CACHE, REMOTE_STATE)
    _refused(blob, "builds a RemoteAutotuneCache")
    _refused(_restored(*AUTOTUNE_CACHE, {**REMOTE_STATE, "remote_cache": True}), "builds a RemoteAutotuneCache")
    a = _frag(Asm(2).op("EMPTY_LIST").op("MARK").s("remote_cache").s("k").op("TUPLE2").op("APPENDS"))
    listed = Asm().g(*AUTOTUNE_CACHE).op("EMPTY_TUPLE").op("NEWOBJ").raw(a).op("BUILD").done()
    _refused(listed, "only a dict of string keys")  # dict.update of a list of pairs
    # what torch pickles (its __getstate__ keeps only the remote key, None without a remote cache) passes
    assert picklescan.scan(_restored(*AUTOTUNE_CACHE, {**REMOTE_STATE, "remote_cache": None})).ok
    assert picklescan.scan(_restored(*AUTOTUNE_CACHE, {"configs_hash": "h", "local_cache": None})).ok
    pytest.importorskip("redis")
    port = _closed_port()
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_REDIS")}
    env["TORCHINDUCTOR_REDIS_URL"] = f"redis://127.0.0.1:{port}"
    after = ("rc = x.remote_cache\nprint('built', type(rc[0]).__name__, rc[0]._key_fmt, rc[1])\n"
             "print('read', x._read())\nprint('events', events)\n")
    out = _load(blob, modules="torch._inductor.runtime.autotune_cache", after=after, env=env)
    assert "loaded" in out.stdout, out.stderr[-2000:]
    assert "built RemoteAutotuneCache pt2:attacker-namespace::{key}:c1 best-config-key" in out.stdout, out.stdout
    assert "read None" in out.stdout and f"['connect', \"('127.0.0.1', {port})\"]" in out.stdout, out.stdout
    fb = _restored(*AUTOTUNE_CACHE, {**REMOTE_STATE, "is_fbcode": True})
    out = _load(fb, modules="torch._inductor.runtime.autotune_cache", after="print('events', events)\n", env=env)
    assert "['import', 'torch._inductor.fb" in out.stdout, out.stdout


def test_an_autotuner_asking_for_incremental_autotune_imports_a_plugin_and_is_refused():
    autotuner = ("torch._inductor.runtime.triton_heuristics", "CachingAutotuner")
    blob = _restored(*autotuner, {"inductor_meta": {"incremental_autotune": True}})
    _refused(blob, "incremental_autotune")
    assert picklescan.scan(_restored(*autotuner, {"inductor_meta": {"incremental_autotune": False}})).ok
    assert picklescan.scan(_restored(*autotuner, {"inductor_meta": {"backend_hash": "h"}})).ok
    out = _load(blob, modules="torch._inductor.runtime.triton_heuristics", after="print('events', events)\n")
    import inspect

    import torch._inductor.runtime.triton_heuristics as th

    imports = "fb.incremental" in inspect.getsource(th)  # a plugin import torch 2.11 does not have
    assert "loaded" in out.stdout and ("fb.incremental" in out.stdout) == imports, (out.stdout, out.stderr[-2000:])


# --- 3. hashing ----------------------------------------------------------------------------------
def test_a_key_nested_deeper_than_the_c_stack_crashes_the_loader_and_is_refused():
    """1e6 TUPLE1s (a 1 MB pickle) as a dict key: tuplehash recurses in C with no depth check (SIGSEGV)."""
    blob = b"\x80\x04}" + b")" + b"\x85" * 10**6 + b"K\x01s."
    _refused(blob, "nested 1000001 deep")
    _refused(b"\x80\x04\x8f(" + b")" + b"\x85" * 2000 + b"\x90.", "nested")  # a set item
    out = _load(blob)
    assert out.returncode == -11 and out.stdout == "", (out.returncode, out.stdout, out.stderr[-500:])
    shallow = b"\x80\x04}" + b")" + b"\x85" * 500 + b"K\x01s."
    assert picklescan.scan(shallow).ok and _load(shallow).stdout.startswith("loaded")


def _shared_tuple(k: int) -> bytes:
    """t = (); k times t = (t, t): 2**k leaves, 5 bytes a level."""
    a = Asm(2).op("EMPTY_TUPLE").put(0)
    for _ in range(k):
        a.op("POP").get(0).get(0).op("TUPLE2").put(0)
    return _frag(a)


def test_a_key_of_shared_tuples_takes_2_to_the_k_steps_and_is_refused():
    blob = Asm().op("EMPTY_DICT").raw(_shared_tuple(60)).i(1).op("SETITEM").done()  # 493 bytes
    _refused(blob, "steps of hashing")
    out = _load(blob, cpu=2)  # never finishes: killed at its CPU limit
    assert out.returncode in (-9, -24) and out.stdout == "", (out.returncode, out.stdout)
    ok = Asm().op("EMPTY_DICT").raw(_shared_tuple(12)).i(1).op("SETITEM").done()
    assert picklescan.scan(ok).ok and _load(ok).stdout.startswith("loaded")
    # a big int is hashed by its length, every time (not cached)
    big = 1 << (8 * MiB)
    key = _frag(Asm(2).raw(b"\x8b" + struct.pack("<i", MiB + 1) + big.to_bytes(MiB + 1, "little")).put(1))
    key += b"(" + b"h\x01" * 200 + b"t" + b"q\x02"
    many = Asm().raw(key).op("POP").op("EMPTY_LIST").op("MARK")
    for _ in range(200):
        many.op("EMPTY_DICT").get(2).i(1).op("SETITEM")
    _refused(many.op("APPENDS").done(), "steps of hashing")
    assert picklescan.scan(Asm().raw(key).op("POP").op("EMPTY_DICT").get(2).i(1).op("SETITEM").done()).ok


def _colliding_pairs(n: int) -> list[tuple[int, int]]:
    """n pairs of small ints with one tuple hash: CPython's xxHash solved for the second lane."""
    m, xx1, xx2, xx5 = (1 << 64) - 1, loadcost._XX1, loadcost._XX2, loadcost._XX5
    target, inv2, out, a = 0x1234_5678_9ABC_DEF0, pow(xx2, -1, 1 << 64), [], 1
    while len(out) < n:
        acc = (xx5 + a * xx2) & m
        acc = (((acc << 31) | (acc >> 33)) * xx1) & m
        b = ((target - acc) * inv2) & m
        if b < P61 - 1:
            out.append((a, b))
        a += 1
    return out


def test_keys_made_to_share_one_hash_are_refused():
    ints = [i * P61 for i in range(1, 41)]  # each hashes to 0
    assert {hash(x) for x in ints} == {0}
    _refused(pickle.dumps(dict.fromkeys(ints), protocol=4), "sharing the hash 0")
    _refused(pickle.dumps(set(ints), protocol=4), "sharing the hash 0")
    assert picklescan.scan(pickle.dumps(dict.fromkeys(ints[:20]), protocol=4)).ok
    import sympy

    integers = [sympy.Integer(x) for x in ints]  # Integer.__hash__ is hash(self.p)
    assert {hash(x) for x in integers} == {0}
    _refused(pickle.dumps(dict.fromkeys(integers), protocol=4), "sharing the hash 0")
    assert picklescan.scan(pickle.dumps(dict.fromkeys(integers[:20]), protocol=4)).ok
    pairs = _colliding_pairs(40)
    assert len({hash(p) for p in pairs}) == 1 and len(set(pairs)) == 40
    _refused(pickle.dumps(dict.fromkeys(pairs), protocol=4), "sharing the hash")
    _refused(pickle.dumps(frozenset(pairs), protocol=4), "sharing the hash")
    _refused(pickle.dumps(set(pairs), protocol=2), "share a hash")  # set(list): the list's items
    assert picklescan.scan(pickle.dumps(dict.fromkeys(pairs[:20]), protocol=4)).ok
    # what real pickles key dicts with passes: strings, small ints, tuples of them, many of each
    real = {**{f"k{i}": i for i in range(5000)}, **{i: None for i in range(5000)}, **{(i, i + 1): 0 for i in range(5000)}}
    assert picklescan.scan(pickle.dumps(real, protocol=4)).ok


def test_the_models_tuple_hash_is_cpythons():
    rnd = random.Random(15)
    atoms = [0, 1, -1, -2, 2**61 - 1, 2**61, -(2**70), 0.5, -3.25, 1e300, None, True, 7]
    for _ in range(300):
        t = tuple(rnd.choice(atoms) for _ in range(rnd.randrange(0, 6)))
        if rnd.random() < 0.5:
            t = (t, rnd.choice(atoms), (t,))
        blob = pickle.dumps({t: 1}, protocol=4)
        s = picklescan._Scan(picklescan.MAX_OPS, size=len(blob))
        seen: list[object] = []
        real = picklescan.add_items

        def spy(node, items, seen=seen, real=real):
            why = real(node, items)
            seen.append(node.h)
            return why

        picklescan.add_items = spy
        try:
            s.run(io.BytesIO(blob))
        finally:
            picklescan.add_items = real
        assert seen[-1] == hash(t), t


# --- other calls ----------------------------------------------------------------------------------
def test_str_of_a_container_is_its_repr_and_is_refused():
    blob = Asm().g("builtins", "str").raw(_shared_tuple(60)).op("TUPLE1").op("REDUCE").done()
    _refused(blob, "str() of one is its repr")
    out = _load(blob, mem=512 * MiB, cpu=2)  # a repr 2**60 leaves long: out of memory or time
    assert not out.stdout.startswith("loaded") and (out.returncode != 0 or "MemoryError" in out.stdout), out
    assert picklescan.scan(Asm().g("builtins", "str").by(b"ab").s("latin1").op("TUPLE2").op("REDUCE").done()).ok


def test_torch_tensor_with_sizes_allocates_them_and_is_refused():
    blob = Asm().g("torch", "Tensor").i(2**28).op("TUPLE1").op("NEWOBJ").done()  # 26 bytes: 1 GiB of floats
    _refused(blob, "allocates n elements")
    out = _load(blob, modules="torch", mem=512 * MiB)
    assert "can't allocate memory" in out.stdout or "MemoryError" in out.stdout, (out.stdout, out.stderr[-1000:])


def _legacy_save(numel: int) -> bytes:
    """torch.save's legacy bytes of one FloatStorage whose persistent id declares `numel` elements."""
    import torch.serialization as ser

    pid = Asm(2).op("MARK").s("storage").glob("torch", "FloatStorage").s("0").s("cpu").raw(
        b"\x8a\x08" + numel.to_bytes(8, "little")).op("NONE").op("TUPLE").op("BINPERSID")
    obj = bytes(pid.b) + b"."
    return (pickle.dumps(ser.MAGIC_NUMBER, protocol=2) + pickle.dumps(ser.PROTOCOL_VERSION, protocol=2)
            + pickle.dumps({}, protocol=2) + obj + pickle.dumps(["0"], protocol=2) + struct.pack("<q", numel))


def test_a_torch_save_storage_declaring_a_huge_size_is_refused():
    """`_load_from_bytes` -> torch.load's legacy persistent_load: `torch.UntypedStorage(numel * 4)` before
    it reads a byte of the data (which this blob does not have)."""
    blob = Asm(2).g("torch.storage", "_load_from_bytes").by(_legacy_save(2**28)).op("TUPLE1").op("REDUCE").done()
    _refused(blob, "a storage of 268435456 elements")
    out = _load(blob, modules="torch", mem=512 * MiB)
    assert "can't allocate memory" in out.stdout or "MemoryError" in out.stdout, (out.stdout, out.stderr[-1000:])
    import torch

    for t in (torch.arange(10), torch.randn(3, 4)):  # what torch pickles passes
        for protocol in (2, 4):
            assert picklescan.scan(pickle.dumps(t, protocol=protocol)).ok


def test_sympy_max_of_many_arguments_is_quadratic_and_refused():
    a = Asm().g("sympy.functions.elementary.miscellaneous", "Max").put(1).op("POP").g("sympy.core.symbol", "Symbol")
    a.put(2).op("POP").get(1).op("MARK")
    for i in range(250):  # a 5 KB pickle; unpickled: ~40 s (0.5 ms a pair of arguments)
        a.get(2).s(f"s{i}").op("TUPLE1").op("NEWOBJ")
    blob = a.op("TUPLE").op("REDUCE").done()
    _refused(blob, "Max of 250 arguments")
    out = _load(blob, modules="sympy", cpu=3)
    assert out.returncode in (-9, -24) and out.stdout == "", (out.returncode, out.stdout)


def test_a_post_init_walking_a_memod_tuple_again_and_again_is_refused():
    """DictGetItemSource.__post_init__ walks its index (ConstantVariable.is_literal): 2000 sources of one
    memo'd tuple of 20000 ints (a 60 KB pickle) walk 4e7 items."""
    a = Asm().op("MARK").raw(b"K\x01" * 20000).op("TUPLE").put(1).op("POP")
    a.g("torch._dynamo.source", "LocalSource").s("x").op("TUPLE1").op("REDUCE").put(2).op("POP")
    a.g("torch._dynamo.source", "DictGetItemSource").put(3).op("POP").op("EMPTY_LIST").op("MARK")
    for _ in range(2000):
        a.get(3).get(2).get(1).op("TUPLE2").op("REDUCE")
    blob = a.op("APPENDS").done()
    _refused(blob, "steps of hashing")
    out = _load(blob, modules="torch._dynamo.source,torch._dynamo.variables", cpu=3)
    assert out.returncode in (-9, -24) and out.stdout == "", (out.returncode, out.stdout, out.stderr[-1000:])
    few = blob.replace(b"h\x03h\x02h\x01\x86R" * 2000, b"h\x03h\x02h\x01\x86R" * 2)
    assert picklescan.scan(few).ok
    lists = Asm().g("torch._dynamo.source", "DictGetItemSource").g("torch._dynamo.source", "LocalSource").s("x")
    lists.op("TUPLE1").op("REDUCE").op("EMPTY_LIST").op("TUPLE2").op("REDUCE")
    _refused(lists.done(), "its __post_init__ walks it")


def test_an_instance_restored_after_a_tuple_holds_it_is_refused():
    """A tuple's hash cost is counted when it is built; restoring an instance it holds afterwards (hashed by
    its fields) would change that unseen."""
    a = Asm().g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op("NEWOBJ").put(1).op("DUP").op("TUPLE2").op("POP")
    a.get(1).op("EMPTY_DICT").s("filename").raw(_shared_tuple(40)).op("SETITEM").op("BUILD")
    _refused(a.done(), "after something holds it")
    a = Asm().g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op("NEWOBJ").op("EMPTY_DICT").s("filename")
    a.s("f.py").op("SETITEM").op("BUILD").op("DUP").op("TUPLE2")
    assert picklescan.scan(a.done()).ok
    a = Asm().g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op("NEWOBJ").put(1).op("DUP").op("TUPLE2").op("POP")
    assert picklescan.scan(a.get(1).op("EMPTY_DICT").s("filename").s("f.py").op("SETITEM").op("BUILD").done()).ok


def test_a_length_declared_past_the_end_is_refused_and_the_loader_would_allocate_it():
    """BINBYTES / BINBYTES8 / BYTEARRAY8 claiming 2-8 GiB in a 16-byte pickle: CPython's unpickler allocates
    the declared size before it reads (then finds the data truncated); the scan reads what is there and
    calls the pickle malformed (BINUNICODE is checked before it allocates)."""
    for op, fmt, n, allocates in ((b"B", "<I", 2**31, True), (b"\x8e", "<Q", 2**33, True),
                                  (b"\x96", "<Q", 2**33, True), (b"X", "<I", 2**31, False)):
        blob = b"\x80\x05" + op + struct.pack(fmt, n) + b"abc."
        r = picklescan.scan(blob)
        assert not r.ok and "not a valid pickle" in (r.problem or ""), (op, r)
        out = _load(blob, mem=512 * MiB)
        expected = "error MemoryError" if allocates else "error UnpicklingError pickle data was truncated"
        assert out.stdout.startswith(expected), (op, out)


# --- instance attributes over a class's methods: StaticallyLaunchedTritonKernel.__del__ ---------------
def _launcher(c_impl: bytes, source: str = "int x;") -> bytes:
    """A StaticallyLaunchedCudaKernel whose state sets `C_impl` (a cached_property of its class) to what
    `c_impl` pushes and `module` to `source`; popped at once, so the load lets go of it while it runs."""
    a = Asm().g("torch._inductor.runtime.static_triton_launcher", "StaticallyLaunchedCudaKernel")
    a.op("EMPTY_TUPLE").op("NEWOBJ").op("EMPTY_DICT").s("module").s(source).op("SETITEM")
    a.s("modules").op("EMPTY_DICT").op("SETITEM").s("C_impl").raw(c_impl).op("SETITEM").op("BUILD")
    return a.op("POP").op("NONE").done()


def _cpp_load(of_instance: bool = True) -> bytes:
    """getattr(CppCodeCache() or CppCodeCache, 'load'): CppCodeCache.load (a classmethod) compiles C++ and loads it."""
    a = Asm(2).g("builtins", "getattr").g("torch._inductor.codecache", "CppCodeCache")
    if of_instance:
        a.op("EMPTY_TUPLE").op("NEWOBJ")
    return _frag(a.s("load").op("TUPLE2").op("REDUCE"))


def _holder(method: bytes) -> bytes:
    """A CodeId instance whose `_unload_kernel` attribute is what `method` pushes."""
    return _frag(Asm(2).g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op("NEWOBJ").op("EMPTY_DICT").s(
        "_unload_kernel").raw(method).op("SETITEM").op("BUILD"))


def test_a_launcher_whose_del_calls_an_attribute_the_pickle_set_is_refused():
    """Before: passed by the scan, and on 2.13 and 2.15 `pickle.loads` compiled and loaded the pickle's C++
    (a constructor function writing a file ran): the launcher's `__del__` -> `close()` ->
    `self.C_impl._unload_kernel(self.module)`, with C_impl an instance whose `_unload_kernel` is
    `getattr(CppCodeCache(), 'load')` (a bound classmethod, which the scan let an instance keep as data)."""
    source = "#include <cstdio>\n__attribute__((constructor)) static void ran() { }\n"
    blob = _launcher(_holder(_cpp_load()), source)
    _refused(blob, "over its cached_property StaticallyLaunchedCudaKernel.C_impl")
    _refused(_launcher(_holder(_cpp_load(of_instance=False))), "over its cached_property")
    _refused(_launcher(_cpp_load()), "over its cached_property")
    # what pickle.loads does with it, CppCodeCache.load replaced by a recorder in the child
    after = "print('recorded', calls)\n"
    record = ("import torch._inductor.codecache as cc\ncalls = []\n"
              "cc.CppCodeCache.load = classmethod(lambda cls, src, *a, **k: calls.append(src))\n")
    out = _load(blob, modules="torch._inductor.codecache,torch._inductor.runtime.static_triton_launcher",
                after=after, prelude=record)
    ran = f"recorded [{source!r}]" in out.stdout
    assert "loaded" in out.stdout and ran == _launcher_has_del(), (out.stdout, out.stderr[-2000:])


def test_a_state_may_not_put_an_object_over_a_method_but_data_over_a_cached_property_passes():
    a = Asm().g("torch._inductor.output_code", "CompiledFxGraph").op("EMPTY_TUPLE").op("NEWOBJ").op("EMPTY_DICT")
    a.s("post_compile").g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op("NEWOBJ").op("SETITEM").op("BUILD")
    _refused(a.done(), "over its function")
    # what a real AOTAutograd entry stores: InputAliasInfo's cached_property mutation_type, an enum member
    a = Asm().g("torch._functorch._aot_autograd.schemas", "InputAliasInfo").op("EMPTY_TUPLE").op("NEWOBJ")
    a.op("EMPTY_DICT").s("mutation_type").g("torch._functorch._aot_autograd.schemas", "MutationType").i(1)
    assert picklescan.scan(a.op("TUPLE1").op("REDUCE").op("SETITEM").op("BUILD").done()).ok


def test_restores_that_look_into_their_state_get_plain_dicts_only():
    """TritonCompileResult.__setstate__ reads state["kernel"]["metadata"] and copies `{**state["kernel"]}`.
    (torch.Tensor.__setstate__, which keeps its state's third item as backward hooks, stays refused.)"""
    def tcr(kernel: bytes) -> bytes:
        a = Asm().g("torch._inductor.runtime.triton_heuristics", "TritonCompileResult").op("EMPTY_TUPLE").op("NEWOBJ")
        return a.op("EMPTY_DICT").s("kernel").raw(kernel).op("SETITEM").op("BUILD").done()

    instance = _frag(Asm(2).g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op("NEWOBJ"))
    _refused(tcr(instance), "kernel state that is not a plain dict")
    _refused(tcr(b"}" + _frag(Asm(2).s("metadata")) + instance + b"s"), "kernel state that is not a plain dict")
    assert picklescan.scan(tcr(b"}" + _frag(Asm(2).s("metadata")) + b"}" + _frag(Asm(2).s("num_warps")) + b"K\x04ss")).ok
    a = Asm().g("torch", "Tensor").op("EMPTY_TUPLE").op("NEWOBJ").op("NEWTRUE").op("NONE")
    a.g("collections", "OrderedDict").op("EMPTY_TUPLE").op("REDUCE").i(0).g("torch.fx.graph_module", "reduce_graph_module")
    _refused(a.op("SETITEM").op("TUPLE3").op("BUILD").done(), "torch.Tensor.__setstate__ runs its own code")


def _launcher_state(module: bytes, modules: bytes, then: bytes = b"") -> bytes:
    a = Asm().g("torch._inductor.runtime.static_triton_launcher", "StaticallyLaunchedCudaKernel")
    a.op("EMPTY_TUPLE").op("NEWOBJ").op("EMPTY_DICT").s("module").raw(module).op("SETITEM")
    return a.s("modules").raw(modules).op("SETITEM").op("BUILD").op("POP").raw(then).op("NONE").done()


def test_what_a_launchers_del_reads_is_none_or_an_empty_dict(tmp_path):
    """torch 2.15's StaticallyLaunchedTritonKernel.close() calls `self.modules.values()`: an instance whose
    `values` was a bound `InductorCacheArtifact.populate_cache` wrote a file where the pickle chose, as the
    load let go of the launcher (2.13's close() stops at `module is None`). Its state keeps only what
    torch's __getstate__ writes there: None and {}."""
    target = tmp_path / "written"
    method = _frag(Asm(2).g("builtins", "getattr").g("torch._inductor.codecache", "InductorCacheArtifact").op(
        "EMPTY_TUPLE").op("NEWOBJ").op("EMPTY_DICT").s("key").s(str(target)).op("SETITEM").s("content").by(
        b"the pickle's bytes").op("SETITEM").op("BUILD").s("populate_cache").op("TUPLE2").op("REDUCE"))
    holder = _frag(Asm(2).g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op("NEWOBJ").op("EMPTY_DICT").s(
        "values").raw(method).op("SETITEM").op("BUILD"))
    blob = _launcher_state(b"N", holder)
    _refused(blob, "as 'values'")
    assert picklescan.scan(_launcher_state(b"N", b"}")).ok  # what torch pickles
    if _launcher_has_del():  # torch 2.11's launcher has no __del__: nothing reads these as the load ends
        _refused(_launcher_state(b"N", _frag(Asm(2).g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op(
            "NEWOBJ"))), "only None or an empty dict")
        _refused(_launcher_state(_frag(Asm(2).s("x")), b"}"), "only None or an empty dict")
        filled_later = _launcher_state(b"N", b"}q\x07", b"h\x07K\x01K\x02s0")  # modules memo'd, filled after BUILD
        _refused(filled_later, "filled after its BUILD")
    out = _load(blob, modules="torch._inductor.codecache,torch._inductor.runtime.static_triton_launcher")
    import inspect

    from torch._inductor.runtime.static_triton_launcher import StaticallyLaunchedTritonKernel

    close = getattr(StaticallyLaunchedTritonKernel, "close", None)
    reads = _launcher_has_del() and close is not None and "self.modules.values()" in inspect.getsource(close)
    wrote = target.exists() and any(p.read_bytes() == b"the pickle's bytes" for p in target.iterdir())
    assert wrote == reads, out


def _launcher_has_del() -> bool:
    from torch._inductor.runtime.static_triton_launcher import StaticallyLaunchedCudaKernel

    return any("__del__" in vars(c) for c in StaticallyLaunchedCudaKernel.__mro__ if c is not object)


def test_getattr_reaching_a_classmethod_is_refused_for_an_instance_as_for_its_class():
    """getattr(CppCodeCache, 'load') was refused as a value torch might call; getattr(CppCodeCache(), 'load')
    is the same classmethod, bound to the class, and passed as "an instance's bound method"."""
    _refused(Asm().raw(_cpp_load()).done(), "a classmethod of CppCodeCache")
    _refused(Asm().raw(_cpp_load(of_instance=False)).done(), "a classmethod of CppCodeCache")
    a = Asm().g("builtins", "getattr").g(*AUTOTUNE_CACHE).op("EMPTY_TUPLE").op("NEWOBJ").s("save").op("TUPLE2")
    assert picklescan.scan(a.op("REDUCE").done()).ok  # a real CUDA entry keeps `cache.save`: an instance's method


def test_a_frame_declared_past_the_end_is_refused_and_pickle_load_would_allocate_it(tmp_path):
    """pickletools checks no FRAME length; pickle.load(file) (torch's OnDiskCache under cache/) reads a frame
    whole: 2**33 declared in a 13-byte file allocated 8 GiB before the unpickler found the data short."""
    blob = b"\x80\x04\x95" + struct.pack("<Q", 2**33) + b"N."
    r = picklescan.scan(blob)
    assert not r.ok and "a frame of 8589934592 bytes" in (r.problem or ""), r
    f = tmp_path / "entry.pkl"
    f.write_bytes(blob)
    code = ("import pickle, resource, sys\nresource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
            "try:\n    pickle.load(open(sys.argv[1], 'rb'))\nexcept Exception as e:\n    print(type(e).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code, str(f)], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "MemoryError", (out.stdout, out.stderr[-1000:])
    for protocol in (4, 5):  # pickle's own frames pass
        assert picklescan.scan(pickle.dumps({"a": list(range(100_000)), "b": "x" * 200_000}, protocol=protocol)).ok


def _graph_module(line: str) -> bytes:
    """A real GraphModule's pickle (reduce_graph_module(body, import_block)) with `line` added to forward."""
    import torch
    import torch.fx

    class Plus(torch.nn.Module):
        def forward(self, x):
            return x + 1

    fn, (body, block) = torch.fx.symbolic_trace(Plus()).__reduce__()
    body = {**body, "_code": body["_code"].replace("    add = x + 1", f"{line}\n    add = x + 1")}

    class Reduced:
        def __reduce__(self):
            return fn, (body, block)

    return pickle.dumps(Reduced(), protocol=4)


def test_fx_source_computing_on_its_constants_while_it_is_traced_is_refused():
    """reduce_graph_module executes the source, then FX re-traces forward: what touches no proxy runs for
    real during pickle.loads (before: the scan passed these few-hundred-byte pickles)."""
    assert picklescan.scan(_graph_module("    y = 2 * 3")).ok
    assert picklescan.scan(_graph_module("    y = torch.ops.aten.full.default([8, 16], 1.0)")).ok
    bombs = {'    y = "a" * 1000000000': ("a sequence of 1000000000 items", "MemoryError"),
             "    y = 10 ** 10 ** 8": ("an int of ~400000000 bits", None),
             "    y = sum(range(10 ** 12))": ("sum() over 1000000000000 items", None),
             "    y = torch.ops.aten.full.default([16384, 16384], 1.0)": ("the load would allocate more than",
                                                                         "can't allocate memory")}
    for line, (words, loaded) in bombs.items():
        blob = _graph_module(line)
        _refused(blob, words)
        if loaded:  # the 1 GB ones, unscanned, under 512 MiB
            out = _load(blob, modules="torch.fx", mem=512 * MiB)
            assert loaded in out.stdout, (line, out.stdout, out.stderr[-1000:])
    out = _load(_graph_module("    y = 10 ** 10 ** 8"), modules="torch.fx", cpu=3)
    assert out.returncode in (-9, -24) and out.stdout == "", (out.returncode, out.stdout)  # hours of CPU
