"""picklescan: what a pickle would import, read from its opcodes without running anything."""

from __future__ import annotations

import collections
import os
import pickle
import subprocess

import pytest

from compilewatch.cache import picklescan


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
