"""picklescan: what a pickle would import, read from its opcodes without running anything."""

from __future__ import annotations

import collections
import os
import pickle
import pickletools
import subprocess

import pytest

from compilewatch.cache.trust import picklescan


class _Call:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


class _CallResult(_Call):
    """A call whose result the pickle then calls (pickle wants the callable slot to be callable)."""

    def __call__(self, *args):
        raise AssertionError("never called: the tests only pickle and scan")


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_code_running_globals_are_refused_in_every_protocol(protocol):
    for fn in (os.system, subprocess.Popen, eval, exec, getattr, __import__):
        r = picklescan.scan(pickle.dumps(_Call(fn, "x"), protocol=protocol))
        assert r.refused and not r.ok, (fn, r)


def test_plain_data_and_allowed_classes_pass():
    data = {"a": [1, 2.0, "s", b"b", None], "c": collections.OrderedDict(x=1), "d": {1, 2}, "e": (slice(1, 2),)}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert picklescan.scan(pickle.dumps(data, protocol=protocol)).ok


def test_dotted_names_reach_only_listed_globals():
    # STACK_GLOBAL("torch._inductor.codecache", "PyCodeCache.load"): pickle resolves dotted names
    # attribute by attribute, so a class-module prefix must not let a method through
    evil = (b"\x80\x04\x8c\x19torch._inductor.codecache\x94\x8c\x10PyCodeCache.load\x94\x93\x94.")
    r = picklescan.scan(evil)
    assert r.refused == ("torch._inductor.codecache.PyCodeCache.load",)
    ok = b"\x80\x04\x8c\x1btorch._inductor.output_code\x94\x8c\x0fCompiledFxGraph\x94\x93\x94."
    assert picklescan.scan(ok).ok  # a class of a data module


def test_memo_references_are_followed():
    # module and name pushed, memoized, then fetched back with BINGET before STACK_GLOBAL
    blob = (b"\x80\x04\x8c\x05posix\x94\x8c\x06system\x94h\x00h\x01\x93\x94.")
    assert picklescan.scan(blob).refused == ("posix.system",)


def test_computed_names_and_extension_codes_are_refused():
    computed = b"\x80\x04K\x01K\x02\x93."  # STACK_GLOBAL over two ints
    assert picklescan.scan(computed).refused == ("<a global whose name is computed>",)
    ext = b"\x80\x02\x82\x01)R."  # EXT1 1, EMPTY_TUPLE, REDUCE
    assert picklescan.scan(ext).refused


@pytest.mark.parametrize("blob", [b"", b"\x80", b"\x80\x04garbage", b"\x80\x04\x8c\x05ab"])
def test_malformed_pickles_are_a_problem_not_an_exception(blob):
    r = picklescan.scan(blob)
    assert r.problem and not r.ok


def test_a_make_fx_graph_module_passes():
    """What AOTAutograd entries hold on CUDA for compiled flex_attention (issue 16: `cache load` of a real
    Qwen3-8B-scale cache was refused): a GraphModule traced by make_fx names its tracer class,
    torch.fx.experimental.proxy_tensor.PythonKeyTracer. Scanned only, never unpickled here."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x: x.sin() + 1)(torch.randn(3))
    r = picklescan.scan(pickle.dumps(gm))
    assert r.ok, r
    assert "torch.fx.experimental.proxy_tensor.PythonKeyTracer" in r.globals


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_enum_members_by_getattr_pass(protocol):
    """Python 3.12 pickles an enum member as getattr(EnumClass, "NAME"); a CUDA fxgraph entry of torch
    2.11 holds inspect._ParameterKind and inductor's HeuristicType members that way (H200, issue 16)."""
    import inspect

    kind = _Call(getattr, inspect._ParameterKind, "POSITIONAL_OR_KEYWORD")
    r = picklescan.scan(pickle.dumps(_Call(inspect.Parameter, "a", kind), protocol=protocol))
    assert r.ok, r
    assert "builtins.getattr" in r.globals


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_bound_methods_pass_as_values(protocol):
    """A CUDA fxgraph entry (torch 2.11, H200) keeps bound methods (`launcher.create_binder`,
    `cache.save`): pickled as getattr(<object>, "name"). A value: nothing in the pickle may call it."""
    import inspect

    holder = {"fn": _Call(getattr, _Call(inspect.Signature), "replace")}
    r = picklescan.scan(pickle.dumps(holder, protocol=protocol))
    assert r.ok, r


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_getattr_is_never_a_way_to_call_something(protocol):
    import functools
    import inspect

    from torch._inductor.codecache import PyCodeCache

    bad = [
        _Call(_CallResult(getattr, PyCodeCache, "load_by_key_path"), "key", "/tmp/x.py"),  # fetch a method, call it
        _Call(getattr, inspect.Signature, "__init__"),  # a dunder
        _Call(getattr, inspect.Signature, "_hidden"),  # a private name
        _Call(getattr, inspect.Signature, "X", "default"),  # three arguments
        _Call(getattr, _Call(getattr, inspect.Signature, "A"), "B"),  # a member of something computed
        functools.partial(getattr, inspect.Signature),  # getattr handed on, called later by someone else
        [getattr],
        _Call(_CallResult(functools.partial, inspect.Signature)),  # calling anything computed, getattr or not
    ]
    for obj in bad:
        r = picklescan.scan(pickle.dumps(obj, protocol=protocol))
        assert not r.ok, (obj, r)


# --- issue 29: the red team's classes, in every protocol ------------------------------------------
def _ops(obj, protocol):
    """The opcodes that build `obj` (no PROTO/FRAME/STOP), to splice after a crafted global."""
    data = pickle.dumps(obj, protocol=protocol)
    start = end = None
    for op, _arg, pos in pickletools.genops(data):
        if op.name in ("PROTO", "FRAME"):
            continue
        if start is None:
            start = pos
        if op.name == "STOP":
            end = pos
    return data[start:end]


def _global(module, name, protocol):
    if protocol >= 4:
        m, n = module.encode(), name.encode()
        return b"\x8c" + bytes([len(m)]) + m + b"\x8c" + bytes([len(n)]) + n + b"\x93"
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def craft(module, name, args, protocol, op=b"R"):
    """A pickle that calls module.name(*args) (REDUCE; or NEWOBJ with op=b"\\x81"), with the global
    spelled as an attacker would: under any module that re-exports it."""
    head = b"" if protocol < 2 else b"\x80" + bytes([protocol])
    return head + _global(module, name, protocol) + _ops(tuple(args), protocol) + op + b"."


PROTOCOLS = range(0, pickle.HIGHEST_PROTOCOL + 1)
EVAL = "__import__('os').system('touch /tmp/compilewatch-pwned')"


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("module, name", [
    ("torch.utils._sympy.functions", "FloorDiv"), ("torch.utils._sympy.functions", "Max"),
    ("torch.utils._sympy.functions", "CleanDiv"), ("torch.utils._sympy.functions", "ModularIndexing"),
    ("sympy.functions.elementary.miscellaneous", "Max"), ("sympy.core.add", "Add"),
    ("sympy.functions.elementary.integers", "floor"), ("sympy.core.relational", "Eq"),
])
def test_sympy_constructors_that_would_eval_a_string_are_refused(protocol, module, name):
    """Red team: constructors of sympy-based classes sympify their arguments, and sympify evaluates a
    string with eval. A class of a data module is not enough: what it is constructed from is checked."""
    for op in (b"R", b"\x81") if protocol >= 2 else (b"R",):
        r = picklescan.scan(craft(module, name, (EVAL, 1), protocol, op))
        assert not r.ok, (op, r)
        if name[0].isupper():  # a class a data module defines: refused for what it is built from
            assert any("sympy evaluates strings" in x for x in r.refused), (op, r)
    # a container is iterated and each item sympified: refused too
    assert not picklescan.scan(craft(module, name, ([EVAL],), protocol)).ok
    assert not picklescan.scan(craft(module, name, ((EVAL,),), protocol)).ok


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_sympy_numbers_from_containers_of_strings_are_refused(protocol):
    """Rational(p) sympifies a p that is not a str or number (a tuple of strings is evaluated item by item)."""
    for name in ("Rational", "Integer"):
        assert not picklescan.scan(craft("sympy.core.numbers", name, ((EVAL, "1"),), protocol)).ok
    assert picklescan.scan(craft("sympy.core.numbers", "Rational", ("1/3",), protocol)).ok


@pytest.mark.parametrize("protocol", range(4, pickle.HIGHEST_PROTOCOL + 1))
def test_real_sympy_objects_pass(protocol):
    """What real caches hold: sympy expressions built from symbols and numbers (a Symbol's name is a string).
    Protocols 4-5 only, the ones torch's caches write: below 4, a Symbol with assumptions is pickled as
    functools.partial(getattr(Symbol, "__new__"), ...), which the scanner refuses (a dunder)."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv, ModularIndexing

    s0, s1 = sympy.Symbol("s0", integer=True, positive=True), sympy.Symbol("s1", integer=True)
    exprs = [FloorDiv(s0, 2), ModularIndexing(s0 * s1, 1, 4), sympy.Max(s0, 3), s0 + 2 * s1, sympy.Eq(s0, s1),
             sympy.Integer(7), sympy.Rational(1, 3), sympy.Float(0.5), sympy.Float("1e-300")]
    for e in exprs:
        r = picklescan.scan(pickle.dumps(e, protocol=protocol))
        assert r.ok, (e, r)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("module, name, why", [
    ("torch._inductor.codecache", "CDLL", "loads native code"),  # ctypes.CDLL re-exported under torch
    ("ctypes", "CDLL", "ctypes.CDLL"),
    ("torch._inductor.codecache", "DLLWrapper", "loads native code"),
    ("torch.fx.graph_module", "_forward_from_src", "executes source"),
    ("torch.fx.graph_module", "_exec_with_source", "executes source"),
    ("torch._inductor.codecache", "PyCodeCache", "executes source"),
])
def test_native_loaders_and_source_executors_are_refused_whatever_module_names_them(protocol, module, name, why):
    r = picklescan.scan(craft(module, name, ("/tmp/evil.so",), protocol))
    assert not r.ok and any(why in x for x in r.refused), r


def _graph_module_pickle(code, protocol):
    """reduce_graph_module(body, import_block), as GraphModule.__reduce__ writes it, with `code` as source."""
    from torch.fx.graph_module import reduce_graph_module

    class GM:
        def __reduce__(self):
            return (reduce_graph_module, ({"_code": code, "_graphmodule_cls_name": "GraphModule"}, "import torch\n"))

    return pickle.dumps(GM(), protocol=protocol)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("code", [
    f"\ndef forward(self, x):\n    {EVAL}\n    return x\n",
    "\nimport os\ndef forward(self, x):\n    os.system('id')\n    return x\n",
    "\ndef forward(self, x):\n    return torch.ops.load_library('/tmp/evil.so')\n",
    "\ndef forward(self, x):\n    return getattr(torch, '__builtins__')['eval']('1')\n",
    "\ndef forward(self, x):\n    return [c for c in ().__class__.__base__.__subclasses__()]\n",
    "\ndef forward(self, x):\n    return torch.utils.cpp_extension.load_inline('x', 'int x;')\n",
    "\nclass A:\n    pass\ndef forward(self, x):\n    return x\n",
])
def test_graph_module_source_that_is_not_fx_is_refused(protocol, code):
    """Red team: a torch.fx helper executes the source it is given while the pickle loads. The one torch
    uses (reduce_graph_module) is admitted only for FX-shaped source (compilewatch.cache.trust.fxsource)."""
    r = picklescan.scan(_graph_module_pickle(code, protocol))
    assert not r.ok and any("reduce_graph_module" in x for x in r.refused), r


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_real_graph_module_source_passes(protocol):
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, y):
        return (x.sin() @ y).relu()[0] * x.shape[0] + torch.ops.aten.cos(y).sum()

    gm = make_fx(f)(torch.randn(3, 3), torch.randn(3, 3))
    r = picklescan.scan(pickle.dumps(gm, protocol=protocol))
    assert r.ok, r


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_calls_that_smuggle_a_call_are_refused(protocol):
    """A function allowed as a value is never called; wrappers that call what they are given are checked."""
    import copyreg

    import torch
    from torch._tensor import _rebuild_from_type_v2
    from torch.fx.graph_module import reduce_graph_module

    cases = [
        _Call(_rebuild_from_type_v2, reduce_graph_module, torch.Tensor, ({}, ""), {}),  # calls func(*args)
        _Call(copyreg._reconstructor, object, __import__("torch.utils._sympy.functions").utils._sympy.functions.FloorDiv, EVAL),
    ]
    for obj in cases:
        r = picklescan.scan(pickle.dumps(obj, protocol=protocol))
        assert not r.ok, (obj.fn, r)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_load_from_bytes_scans_the_pickle_it_would_load(protocol):
    """torch.storage._load_from_bytes runs torch.load(weights_only=False) on its argument: the bytes are
    scanned as torch.save's pickles, so a payload inside them is refused, a real storage passes."""
    import io as io_

    import torch

    buf = io_.BytesIO()
    torch.save(torch.arange(4).untyped_storage(), buf, _use_new_zipfile_serialization=False)
    real = picklescan.scan(craft("torch.storage", "_load_from_bytes", (buf.getvalue(),), max(protocol, 3)))
    assert real.ok, real
    evil = pickle.dumps(_Call(os.system, "id"), protocol=2)
    inner = b"".join(pickle.dumps(x, protocol=2) for x in (0x1950A86A20F9469CFC6C, 1001, {})) + evil
    r = picklescan.scan(craft("torch.storage", "_load_from_bytes", (inner,), max(protocol, 3)))
    assert not r.ok and any("system" in x for x in r.refused), r


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_pgo_code_state_with_os_system_is_refused(protocol):
    """Red team: a dynamo/code_state_*.pkl whose only global was os.system passed verify, save and load."""
    blob = pickle.dumps(_Call(os.system, "id"), protocol=protocol)
    assert picklescan.is_pickle_file("dynamo/code_state_job_None_.pkl", blob[:1])
    assert not picklescan.scan(blob).ok


def test_is_pickle_file_covers_every_place_torch_unpickles():
    assert all(picklescan.is_pickle_file(rel, b"(") for rel in (
        "fxgraph/ab/fabc/entry", "aotautograd/aabc/entry", "dynamo/code_state_x.pkl", "dynamo/precompile/x",
        "cache/some_on_disk_cache", "ab/anything.pkl"))
    assert picklescan.is_pickle_file("ab/cabc.bin", b"\x80")
    assert not picklescan.is_pickle_file("cache/" + "0" * 64, b"{")  # the JSON local cache
    assert not picklescan.is_pickle_file("ab/cabc.py", b"d") and not picklescan.is_pickle_file("fxgraph/x.lock", b"")


@pytest.mark.parametrize("kind, content, ok", [
    ("autotune", b'{"XBLOCK": 8}', True), ("autotune", pickle.dumps(_Call(os.system, "id")), False),
    ("pgo", pickle.dumps(_Call(os.system, "id"), protocol=0), False),  # protocol 0: no 0x80 first byte
    ("inductor", pickle.dumps({"a": 1}), True), ("precompile", b"not a pickle", False), ("new-kind", None, False),
])
def test_every_mega_cache_artifact_is_checked(kind, content, ok):
    assert picklescan.scan_artifact(kind, content).ok is ok


@pytest.mark.parametrize("shape", ["memo_tuple", "memo_tuple_call", "nested_tuples"])
def test_crafted_pickles_scan_in_linear_time(shape):
    """Issue 31: a 300 KB crafted pickle took > 60 s (a memo-fetched tuple was looked into on every
    POP). A generous bound, 10x what the benchmark measures for this size on a loaded 2-core box."""
    import sys
    import time
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.picklescan_linear import SHAPES

    picklescan.scan(SHAPES[shape](10))
    blob = SHAPES[shape](40_000)
    assert len(blob) >= 80_000
    t0 = time.perf_counter()
    picklescan.scan(blob)
    assert time.perf_counter() - t0 < 20, "superlinear scan"


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_real_signatures_and_triton_configs_pass(protocol):
    """What a real CUDA fxgraph entry of compiled flex attention holds (torch 2.11 + triton 3.6, H200,
    benchmarks/gpu_cache_trust.py): inspect.Signature / Parameter objects and triton autotuner configs,
    each restored by its own audited `__setstate__` (BUILD). The stricter scanner refused all of them
    (`cache verify` called the whole real cache untrusted) until they were audited."""
    import inspect

    def kernel(x, y: int = 2, *args, block=16, **kw):  # noqa: ARG001 - only its signature is pickled
        return x

    objs = [inspect.signature(kernel)]
    try:  # the CUDA wheels (CI's torch 2.11 and 2.15 columns) bring triton; the CPU wheel does not
        from torch._inductor.runtime.triton_heuristics import InductorConfig
        from triton.runtime.autotuner import Config
    except ImportError:
        pass
    else:
        objs += [Config({"XBLOCK": 128}, num_warps=4, num_stages=2),
                 InductorConfig({"XBLOCK": 64, "R0_BLOCK": 8}, num_warps=8, num_stages=1, dynamic_scale_rblock=False)]
    for obj in objs:
        r = picklescan.scan(pickle.dumps({"sig": obj, "n": 1}, protocol=protocol))
        assert r.ok, (type(obj).__name__, r)
