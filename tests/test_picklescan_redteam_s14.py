"""picklescan red-team pass (session 14): pickles the scan passed that, unpickled, ran code or took memory.

- A torch `__setstate__` the scan trusts (`CachingAutotuner`: `self.__dict__.update(state)`) called its
  state's `keys`: an instance whose `keys` was a bound method (`InductorCacheArtifact.populate_cache`)
  wrote a file of the pickle's choosing and unpickled it, unscanned (`FxGraphCache._emit_triton_bundle`).
  Under the names builtins and torch's restores call (`keys`, `get`, `items`) a state now keeps data only,
  and a torch restore's state is never an instance.
- A memo index is an array index in the unpickler: `LONG_BINPUT 2**31` made a 9-byte pickle allocate 32 GiB.
- `bytes(n)` / `bytearray(n)` allocate n bytes, a container built from `range(2**40)` iterates it; a codec
  the pickle names is imported (`bytes('x', 'uu')`).
- `_load_from_bytes` of one memo'd constant, again and again, scanned it again each time (quadratic).
"""

from __future__ import annotations

import pickle
import struct

from compilewatch.cache.trust import picklescan
from tests import limits
from tests.test_picklescan_adversarial import Asm, _unpickle_in_child

AUTOTUNER = ("torch._inductor.runtime.triton_heuristics", "CachingAutotuner")


def _new(a: Asm, module: str, name: str) -> Asm:
    return a.g(module, name).op("EMPTY_TUPLE").op("NEWOBJ")


def _populate_cache(a: Asm, key: str, content: bytes) -> Asm:
    """getattr(<InductorCacheArtifact(key, content)>, 'populate_cache'): a bound method, kept as a value."""
    a.g("builtins", "getattr")
    _new(a, "torch._inductor.codecache", "InductorCacheArtifact")
    a.op("EMPTY_DICT").s("key").s(key).op("SETITEM").s("content").by(content).op("SETITEM").op("BUILD")
    return a.s("populate_cache").op("TUPLE2").op("REDUCE")


def _keys_exploit(key: str, content: bytes) -> bytes:
    """BUILD of a CachingAutotuner whose state is an instance with `keys` = populate_cache: torch's
    `__setstate__` does `self.__dict__.update(state)`, which calls `state.keys()`."""
    a = _new(Asm(), *AUTOTUNER)
    _new(a, "torch._dynamo.pgo", "CodeId").op("EMPTY_DICT").s("keys")
    _populate_cache(a, key, content).op("SETITEM").op("BUILD")
    return a.op("BUILD").done()


def _populate_unpickles() -> bool:
    import inspect

    from torch._inductor.codecache import InductorCacheArtifact

    return "_emit_triton_bundle" in inspect.getsource(InductorCacheArtifact.populate_cache)


def test_a_torch_restore_calling_its_states_keys_is_refused_and_would_run_code(tmp_path):
    marker, entry = tmp_path / "ran", tmp_path / "entry"
    content = Asm().g("builtins", "open").s(str(marker)).s("w").op("TUPLE2").op("REDUCE").done()
    exploit = _keys_exploit(str(entry), content)
    r = picklescan.scan(exploit)
    assert not r.ok and any("'keys'" in why for why in r.refused), r
    # unscanned: the file is written (an absolute key: anywhere) and unpickled, and its code runs
    report = _unpickle_in_child([exploit, _codec_import()])
    assert any(i == 0 and e.startswith("open") for i, e in report["tripped"]), report
    assert any(entry.iterdir())  # an arbitrary file write on every torch tested
    if _populate_unpickles():  # torch 2.13's populate_cache also unpickles what it wrote (2.15's does not)
        assert marker.exists()
    assert any(i == 1 and e.startswith("import encodings") for i, e in report["tripped"]), report


def test_what_builtins_and_torch_restores_call_on_an_instance_holds_data_only():
    bm = bytes(_populate_cache(Asm(2), "k", b"x").b[2:])
    # `inductor_meta.get(...)` in CachingAutotuner.__setstate__
    a = _new(Asm(), *AUTOTUNER).op("EMPTY_DICT").s("inductor_meta")
    a = _new(a, "torch._dynamo.pgo", "CodeId").op("EMPTY_DICT").s("get").raw(bm).op("SETITEM").op("BUILD")
    exploits = {"inductor_meta with a bound method as its get": a.op("SETITEM").op("BUILD").done()}
    # a torch restore's own __dict__.update setting `keys`, then that instance another's state
    a = _new(Asm(), *AUTOTUNER)
    a = _new(a, *AUTOTUNER).op("EMPTY_DICT").s("inductor_meta").op("EMPTY_DICT").op("SETITEM").s("keys").raw(bm)
    exploits["a CachingAutotuner's keys set by its own restore"] = a.op("SETITEM").op("BUILD").op("BUILD").done()
    a = _new(Asm(), "collections", "OrderedDict").op("NONE").op("EMPTY_DICT").s("items").raw(bm).op("SETITEM")
    exploits["an OrderedDict's items by slot state"] = a.op("TUPLE2").op("BUILD").done()
    a = _new(Asm(), "torch._dynamo.pgo", "CodeId").op("EMPTY_DICT").s("keys").g("torch._dynamo.pgo", "CodeId")
    exploits["a class as keys"] = a.op("SETITEM").op("BUILD").done()
    a = _new(Asm(), *AUTOTUNER).g("builtins", "range").i(0).i(2**31 - 1).op("TUPLE2").op("REDUCE")
    exploits["a torch restore of an instance (a range: dict.fromkeys)"] = a.op("BUILD").done()
    for name, blob in exploits.items():
        assert not picklescan.scan(blob).ok, name
    # data under those names stays allowed (a dataclass field `items`: codecache.OrderedSetHolder)
    a = _new(Asm(), "torch._inductor.codecache", "OrderedSetHolder").op("EMPTY_DICT").s("items").op("EMPTY_LIST")
    assert picklescan.scan(a.op("MARK").s("x").s("y").op("APPENDS").op("SETITEM").op("BUILD").done()).ok
    a = _new(Asm(), *AUTOTUNER).op("EMPTY_DICT").s("inductor_meta").op("EMPTY_DICT").op("SETITEM")
    assert picklescan.scan(a.s("get").s("data").op("SETITEM").op("BUILD").done()).ok


def _load_in_512_mib(blob: bytes) -> str:
    """pickle.loads(blob) in a child limited to 512 MiB of address space: 'ok' or the exception's name."""
    code = ("import pickle, sys\ntry:\n    pickle.loads(bytes.fromhex(sys.argv[1])); print('ok')\n"
            "except Exception as e:\n    print(type(e).__name__)")
    out = limits.python(code, blob.hex(), mem=512 * limits.MiB, timeout=60)
    assert out.rc == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_a_memo_index_past_the_pickle_is_refused():
    bomb = Asm().op("NONE").raw(b"r" + struct.pack("<I", 0x7FFFFFFF)).done()  # LONG_BINPUT: 32 GiB
    assert not picklescan.scan(bomb).ok
    assert not picklescan.scan(Asm(0).raw(b"Np99999999999\n").done()).ok  # PUT, protocol 0
    small = Asm().op("NONE").raw(b"r" + struct.pack("<I", 1 << 26)).done()
    assert not picklescan.scan(small).ok
    assert _load_in_512_mib(small) == "MemoryError"  # 9 bytes, unscanned: 2**27 slots of 8 bytes
    assert _load_in_512_mib(Asm().op("NONE").raw(b"r" + struct.pack("<I", 1)).done()) == "ok"
    for protocol in range(5):  # pickle's own memo indices pass
        shared = ["x" * 10, b"y"]
        assert picklescan.scan(pickle.dumps([shared, shared, {"k": shared}, (shared,)], protocol=protocol)).ok


def _call(module: str, name: str, *args: bytes) -> Asm:
    a = Asm().g(module, name).op("MARK")
    for x in args:
        a.raw(x)
    return a.op("TUPLE").op("REDUCE")


def _range(n: int) -> bytes:
    return bytes(_call("builtins", "range", b"J" + struct.pack("<i", n)).b[2:])


def test_constructors_that_allocate_by_a_number_or_iterate_a_range_are_refused():
    big = b"J" + struct.pack("<i", 2**31 - 1)
    as_int = bytes(_call("builtins", "int", bytes(Asm(2).s(str(2**36)).b[2:])).b[2:])
    refused = {
        "bytes(n)": _call("builtins", "bytes", big), "bytearray(n)": _call("builtins", "bytearray", big),
        "bytearray(int('2**36'))": _call("builtins", "bytearray", as_int),
        "list(range)": _call("builtins", "list", _range(2**31 - 1)),
        "frozenset(range)": _call("builtins", "frozenset", _range(2**31 - 1)),
        "torch.Size(range)": _call("torch", "Size", _range(2**31 - 1)),
        "OrderedSet(range)": _call("torch.utils._ordered_set", "OrderedSet", _range(2**31 - 1)),
    }
    for name, a in refused.items():
        assert not picklescan.scan(a.done()).ok, name
    assert _load_in_512_mib(_call("builtins", "bytearray", b"J" + struct.pack("<i", 1 << 30)).done()) == "MemoryError"
    assert _load_in_512_mib(_call("builtins", "list", _range(1 << 27)).done()) == "MemoryError"
    assert _load_in_512_mib(_call("builtins", "list", _range(10)).done()) == "ok"
    for protocol in range(5):  # what pickle makes of bytes, bytearrays and ranges passes
        assert picklescan.scan(pickle.dumps([b"ab", bytearray(b"cd"), range(3, 9, 2), b""], protocol=protocol)).ok


def _codec_import() -> bytes:
    return _call("builtins", "bytes", bytes(Asm(2).s("x").s("uu").b[2:])).done()  # imports encodings.uu_codec


def test_a_codec_the_pickle_names_is_refused():
    assert not picklescan.scan(_codec_import()).ok
    assert not picklescan.scan(_call("builtins", "str", bytes(Asm(2).by(b"x").s("idna").b[2:])).done()).ok
    assert picklescan.scan(_call("builtins", "bytearray", bytes(Asm(2).s("x").s("latin-1").b[2:])).done()).ok


def test_one_constant_loaded_again_and_again_is_scanned_once(monkeypatch):
    """_load_from_bytes of a memo'd constant 2000 times: each scanned it again (a 0.5 MB pickle, 15 minutes)."""
    scanned: list[int] = []
    real = picklescan._Scan.nested_torch_save

    def counting(self, blob):
        scanned.append(len(blob))
        return real(self, blob)

    monkeypatch.setattr(picklescan._Scan, "nested_torch_save", counting)
    inner = b"\x80\x02" + b"N0" * 20_000 + b"."
    as_bytes = lambda a: a.get(1)  # noqa: E731
    encoded = lambda a: a.g("_codecs", "encode").get(1).s("latin1").op("TUPLE2").op("REDUCE")  # noqa: E731
    for constant, arg in ((Asm(2).by(inner), as_bytes), (Asm(2).s(inner.decode("latin1")), encoded)):
        scanned.clear()
        a = Asm().op("EMPTY_LIST").op("MARK").raw(bytes(constant.b[2:])).put(1).op("POP")
        for _ in range(2000):
            arg(a.g("torch.storage", "_load_from_bytes")).op("TUPLE1").op("REDUCE")
        r = picklescan.scan(a.op("APPENDS").done())
        assert not r.ok and scanned == [len(inner)], (r, scanned[:3], len(scanned))
