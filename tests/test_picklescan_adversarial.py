"""picklescan against hand-crafted exploit pickles (issue 37 and its relatives), and a property test.

Issue 37: pickle's BUILD with a `(None, {...})` state does `setattr` on whatever object is on the
stack, and the scanner checked BUILD on instances only. A pickle set `__setstate__ =
reduce_graph_module` and `get = str` on an allowed class (`torch._dynamo.pgo.CodeId`), then built an
instance of it from a source string: unpickling executed it. Every pickle below is assembled opcode
by opcode (`Asm`), and every one must be refused. The property test generates opcode sequences over
the allowed globals: each must be refused, or unpickle (in one child process, under the tripwire of
tests/pickle_tripwire_child.py) without running code or changing any allowed class; the same child
unpickles issue 37's exploit last, which must trip the wire (so the wire is real).
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compilewatch.cache.trust import picklescan

ROOT = Path(__file__).resolve().parents[1]
PAYLOAD = "import os\nos.system('touch /tmp/compilewatch-issue37')\n"


class Asm:
    """A tiny pickle assembler: each method appends one opcode (protocol 4 spelling unless `text`)."""

    def __init__(self, proto: int = 4) -> None:
        self.b = bytearray(b"\x80" + bytes([proto]) if proto >= 2 else b"")

    def raw(self, b: bytes) -> Asm:
        self.b += b
        return self

    def s(self, x: str) -> Asm:
        e = x.encode()
        return self.raw((b"\x8c" + bytes([len(e)]) if len(e) < 256 else b"X" + struct.pack("<I", len(e))) + e)

    def by(self, x: bytes) -> Asm:
        return self.raw(b"C" + bytes([len(x)]) + x if len(x) < 256 else b"B" + struct.pack("<I", len(x)) + x)

    def i(self, n: int) -> Asm:
        return self.raw(b"J" + struct.pack("<i", n))

    def g(self, module: str, name: str) -> Asm:  # STACK_GLOBAL
        return self.s(module).s(name).raw(b"\x93")

    def glob(self, module: str, name: str) -> Asm:  # GLOBAL (protocol 0's text form)
        return self.raw(b"c" + module.encode() + b"\n" + name.encode() + b"\n")

    def put(self, k: int) -> Asm:
        return self.raw(b"q" + bytes([k]))

    def get(self, k: int) -> Asm:
        return self.raw(b"h" + bytes([k]))

    def op(self, name: str) -> Asm:
        return self.raw(OPS[name])

    def state(self, items: dict[str, object], *, slots: bool = True) -> Asm:
        """Push a BUILD state: (None, {items}) (slot state: setattr) or {items}; a value is an Asm
        fragment (bytes) or a str."""
        if slots:
            self.op("NONE")
        self.op("EMPTY_DICT").op("MARK")
        for k, v in items.items():
            self.s(k)
            self.raw(v) if isinstance(v, bytes) else self.s(v)
        self.op("SETITEMS")
        return self.op("TUPLE2") if slots else self

    def done(self) -> bytes:
        return bytes(self.b + b".")


OPS = {"NONE": b"N", "EMPTY_DICT": b"}", "EMPTY_LIST": b"]", "EMPTY_TUPLE": b")", "EMPTY_SET": b"\x8f",
       "MARK": b"(", "TUPLE": b"t", "TUPLE1": b"\x85", "TUPLE2": b"\x86", "TUPLE3": b"\x87", "REDUCE": b"R",
       "BUILD": b"b", "SETITEM": b"s", "SETITEMS": b"u", "APPEND": b"a", "APPENDS": b"e", "ADDITEMS": b"\x90",
       "FROZENSET": b"\x91", "NEWOBJ": b"\x81", "NEWOBJ_EX": b"\x92", "OBJ": b"o", "DICT": b"d", "LIST": b"l",
       "MEMOIZE": b"\x94", "POP": b"0", "DUP": b"2", "BINPERSID": b"Q", "STACK_GLOBAL": b"\x93",
       "NEWTRUE": b"\x88"}


def g(module: str, name: str) -> bytes:
    return bytes(Asm(2).g(module, name).b[2:])


RGM = g("torch.fx.graph_module", "reduce_graph_module")
STR = g("builtins", "str")
ALLOWED_CLASSES = [("torch._dynamo.pgo", "CodeId"), ("torch._dynamo.source", "AttrSource"),
                   ("torch._inductor.utils", "BoxedBool"), ("torch._functorch._aot_autograd.schemas", "PlainTensorMeta")]


def issue_37(module: str = "torch._dynamo.pgo", name: str = "CodeId", *, reach: str = "stack_global") -> bytes:
    """The exploit of issue 37: set __setstate__ / get on an allowed class, then build an instance of it."""
    a = Asm()
    reach_cls = {"stack_global": lambda: a.g(module, name), "global": lambda: a.glob(module, name)}[reach]
    reach_cls().op("MEMOIZE")  # memo 0: the class
    a.state({"__setstate__": RGM, "get": STR}).op("BUILD").op("POP")
    a.get(0).op("EMPTY_TUPLE").op("NEWOBJ").s(PAYLOAD).op("BUILD")
    return a.done()


def _class_setattr_family() -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for module, name in ALLOWED_CLASSES:
        out[f"issue 37 on {name}"] = issue_37(module, name)
        out[f"issue 37 on {name} via GLOBAL"] = issue_37(module, name, reach="global")
    a = Asm().g("torch._dynamo.pgo", "CodeId").state({"__setstate__": RGM}, slots=False).op("BUILD")
    out["BUILD with a dict state on a class"] = a.done()
    a = Asm().g("torch._dynamo.pgo", "CodeId").put(1).op("POP").get(1).state({"__reduce__": STR}).op("BUILD")
    out["BUILD on a class fetched from the memo"] = a.done()
    a = Asm().g("builtins", "getattr").g("inspect", "_ParameterKind").s("POSITIONAL_ONLY").op("TUPLE2").op("REDUCE")
    out["BUILD on an enum member from getattr"] = a.state({"get": STR}).op("BUILD").done()
    a = Asm().g("builtins", "getattr").g("torch._dynamo.pgo", "CodeId").s("SOME_ATTR").op("TUPLE2").op("REDUCE")
    out["BUILD on a class attribute from getattr"] = a.state({"x": STR}).op("BUILD").done()
    a = Asm().g("builtins", "getattr").g("torch._dynamo.pgo", "CodeId").s("name").op("TUPLE2").op("REDUCE")
    out["SETITEM on getattr(<class>, name)"] = a.s("k").s("v").op("SETITEM").done()
    a = Asm().g("torch._inductor.output_code", "CompiledFxGraph").s("__setstate__").raw(RGM).op("SETITEM")
    out["SETITEM onto a class"] = a.done()
    a = Asm().g("torch._inductor.output_code", "CompiledFxGraph").op("MARK").s("x").op("APPENDS")
    out["APPENDS onto a class"] = a.done()
    a = Asm().g("torch._inductor.output_code", "CompiledFxGraph").op("MARK").s("x").op("ADDITEMS")
    out["ADDITEMS onto a class"] = a.done()
    a = Asm().g("torch", "float32").state({"is_floating_point": STR}).op("BUILD")
    out["BUILD on a module attribute (torch.float32)"] = a.done()
    a = Asm().raw(RGM).state({"__defaults__": b"(\x8c\x01xt"}).op("BUILD")
    out["BUILD on a function (its __defaults__)"] = a.done()
    a = Asm().raw(RGM).state({"__code__": b"N"}, slots=False).op("BUILD")
    out["BUILD with a dict state on a function"] = a.done()
    a = Asm().g("torch._inductor.decomposition", "select_decomp_table").op("EMPTY_TUPLE").op("REDUCE")
    out["SETITEM into a call's result (the global decomp table)"] = a.s("k").raw(STR).op("SETITEM").done()
    a = Asm().g("copyreg", "_reconstructor").g("torch._dynamo.pgo", "CodeId").g("builtins", "object").op("NONE")
    a.op("TUPLE3").op("REDUCE").state({"__setstate__": RGM}, slots=False).op("BUILD")
    out["copyreg._reconstructor, then a __setstate__ attribute"] = a.done()
    a = Asm().g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op("NEWOBJ").state({"get": RGM}, slots=False)
    out["an instance storing a function"] = a.op("BUILD").done()
    a = Asm().g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op("NEWOBJ").state({"__class__": STR})
    out["an instance's __class__ set by slot state"] = a.op("BUILD").done()
    a = Asm().g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op("NEWOBJ").put(3)
    a.state({"x": b"\x8c\x01y"}, slots=False).op("BUILD").op("POP").get(3).state({"y": b"\x8c\x01z"}, slots=False)
    out["BUILD twice on one instance"] = a.op("BUILD").done()
    a = Asm().g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op("NEWOBJ").s("not a dict").op("BUILD")
    out["an instance built from a string"] = a.done()
    a = Asm().g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op("NEWOBJ").op("EMPTY_DICT").put(5)
    a.g("builtins", "getattr").g("torch._dynamo.pgo", "CodeId").s("name").op("TUPLE2").op("REDUCE").raw(STR)
    out["a state dict with a computed key"] = a.op("SETITEM").op("BUILD").done()
    # the class reached through a call that returns a class, through partial, defaultdict, OBJ, INST
    a = Asm().g("collections", "defaultdict").g("torch._dynamo.pgo", "CodeId").op("TUPLE1").op("REDUCE")
    out["defaultdict's factory swapped by slot state"] = a.state({"default_factory": RGM}).op("BUILD").done()
    a = Asm().g("functools", "partial").g("torch._dynamo.pgo", "CodeId").op("TUPLE1").op("REDUCE")
    a.raw(RGM).op("MARK").op("EMPTY_DICT").s("import os").op("TUPLE").op("NONE").op("NONE").op("TUPLE").op("BUILD")
    out["functools.partial re-aimed by BUILD"] = a.done()
    a = Asm().op("MARK").g("torch._dynamo.pgo", "CodeId").op("OBJ").state({"__setstate__": RGM}, slots=False)
    out["OBJ, then a __setstate__ attribute"] = a.op("BUILD").done()
    a = Asm(0).raw(b"(itorch._dynamo.pgo\nCodeId\n").raw(b"(dS'__setstate__'\nctorch.fx.graph_module\n"
                                                         b"reduce_graph_module\nsb")
    out["protocol 0: INST, then a __setstate__ attribute"] = a.done()
    a = Asm(0).raw(b"ctorch._dynamo.pgo\nCodeId\n(N(dS'get'\ncbuiltins\nstr\nstb")
    out["protocol 0: BUILD on a GLOBAL class"] = a.done()
    a = Asm().g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op("EMPTY_DICT").op("NEWOBJ_EX")
    out["NEWOBJ_EX, then a __setstate__ attribute"] = a.state({"__setstate__": RGM}, slots=False).op("BUILD").done()
    a = Asm().g("sympy.core.add", "Add").op("EMPTY_TUPLE").op("EMPTY_DICT").s("evaluate").s(PAYLOAD)
    out["NEWOBJ_EX of a sympy class with keyword arguments"] = a.op("SETITEM").op("NEWOBJ_EX").done()
    a = Asm().s("pid").op("BINPERSID").state({"__setstate__": RGM}).op("BUILD")
    out["BUILD on a persistent id's object"] = a.done()
    a = Asm().g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op("NEWOBJ").state({"append": RGM}, slots=False)
    out["an instance whose `append` APPENDS would call"] = a.op("BUILD").op("MARK").s("x").op("APPENDS").done()
    a = Asm().g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op("NEWOBJ").op("MARK").s("x").op("APPENDS")
    out["APPENDS on an instance that is not a list"] = a.done()
    a = Asm().g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op("NEWOBJ").s("k").s("v").op("SETITEM")
    out["SETITEM on an instance that is not a dict"] = a.done()
    a = Asm().g("builtins", "str").s("x").op("TUPLE1").op("REDUCE").state({"a": b"N"}, slots=False).op("BUILD")
    out["BUILD on a str"] = a.done()
    a = Asm().s("x").op("TUPLE1").state({"a": b"N"}, slots=False).op("BUILD")
    out["BUILD on a tuple"] = a.done()
    a = Asm().g("torch._dynamo.pgo", "CodeId").put(1).op("POP").op("EMPTY_LIST").get(1).op("APPEND")
    a.raw(b"h\x01").state({"__setstate__": RGM}).op("BUILD")
    out["BUILD on a class reached through a list"] = a.done()
    return out


def _graph_body(code: str, extra: bytes = b"") -> bytes:
    """reduce_graph_module({'_code': code, ...extra}, 'import torch\\n')."""
    return RGM + b"}(" + bytes(Asm(2).s("_code").s(code).b[2:]) + extra + b"u" + bytes(Asm(2).s("import torch\n").b[2:]) + b"\x86R"


def _code_family() -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    fx = "\ndef forward(self, x):\n    return self.foo(b'x')\n"
    out["FX source calling a function stored in its body"] = Asm().raw(_graph_body(fx, bytes(Asm(2).s("foo").g(
        "torch.storage", "_load_from_bytes").b[2:]))).done()
    out["FX source calling a class stored in its body"] = Asm().raw(_graph_body(fx, bytes(Asm(2).s("foo").g(
        "sympy.core.add", "Add").b[2:]))).done()
    out["FX source with a tracer class of the attacker's choosing"] = Asm().raw(_graph_body(
        "\ndef forward(self, x):\n    return x\n", bytes(Asm(2).s("_tracer_cls").g("torch._dynamo.pgo", "CodeId").b[2:]))).done()
    out["FX source reaching torch.storage._load_from_bytes"] = Asm().raw(_graph_body(
        "\ndef forward(self, x):\n    return torch.storage._load_from_bytes(b'x')\n")).done()
    out["FX source reaching torch._inductor"] = Asm().raw(_graph_body(
        "\ndef forward(self, x):\n    return torch._inductor.cpp_builder.run_compile_cmd('id', '.')\n")).done()
    out["reduce_graph_module with non-FX source"] = Asm().raw(_graph_body(PAYLOAD)).done()
    # a body whose `_code` is replaced after a check: a computed key
    a = Asm().raw(RGM).op("EMPTY_DICT").put(1).s("_code").s("\ndef forward(self, x):\n    return x\n").op("SETITEM")
    a.g("builtins", "getattr").g("torch._dynamo.pgo", "CodeId").s("name").op("TUPLE2").op("REDUCE").s(PAYLOAD)
    out["a graph body with a computed key"] = a.op("SETITEM").s("import torch\n").op("TUPLE2").op("REDUCE").done()
    # a SerializedGraphModule whose args torch calls later, its body changed after BUILD
    sgm = ("torch._functorch._aot_autograd.aot_autograd_result", "SerializedGraphModule")
    a = Asm().g(*sgm).op("EMPTY_TUPLE").op("NEWOBJ").op("EMPTY_DICT").s("fn").raw(RGM).op("SETITEM").s("args")
    a.op("EMPTY_DICT").put(2).s("_code").s("\ndef forward(self, x):\n    return x\n").op("SETITEM")
    a.s("import torch\n").op("TUPLE2").op("SETITEM").op("BUILD").op("POP").get(2).s("_code").s(PAYLOAD).op("SETITEM")
    out["a SerializedGraphModule's source replaced after BUILD"] = a.done()
    a = Asm().g(*sgm).op("EMPTY_TUPLE").op("NEWOBJ").op("EMPTY_DICT").s("fn").raw(RGM).op("SETITEM").s("args")
    a.op("EMPTY_DICT").s("_code").s(PAYLOAD).op("SETITEM").s("").op("TUPLE2").op("SETITEM").op("BUILD")
    out["a SerializedGraphModule of non-FX source"] = a.done()
    a = Asm().g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op("NEWOBJ").op("EMPTY_DICT").s("fn").raw(RGM)
    out["reduce_graph_module stored on another class"] = a.op("SETITEM").op("BUILD").done()
    # sympy: sympify of strings
    for name in ("Add", "Mul"):
        out[f"sympy {name} of a string"] = Asm().g(f"sympy.core.{name.lower()}", name).s(PAYLOAD).op("TUPLE1").op("REDUCE").done()
    a = Asm().g("sympy.core.symbol", "Symbol").s("x").op("TUPLE1").op("NEWOBJ").state({"_args": b"N"}).op("BUILD")
    out["BUILD on a sympy object (cached, shared)"] = a.done()
    a = Asm().g("copyreg", "_reconstructor").g("sympy.core.add", "Add").g("builtins", "object").op("NONE").op("TUPLE3")
    out["a sympy object made without its constructor"] = a.op("REDUCE").done()
    # _codecs.encode making bytes that are then unpickled or executed
    a = Asm().g("torch.storage", "_load_from_bytes").g("_codecs", "encode").s(
        "\x80\x02cposix\nsystem\nq\x00X\x02\x00\x00\x00idq\x01\x85q\x02Rq\x03.").s("latin1").op("TUPLE2").op("REDUCE")
    out["_load_from_bytes of _codecs.encode bytes running os.system"] = a.op("TUPLE1").op("REDUCE").done()
    a = Asm().g("_codecs", "encode").s(PAYLOAD).s("rot13").op("TUPLE2").op("REDUCE")
    out["_codecs.encode with a codec of the pickle's choosing"] = a.done()
    a = Asm().g("_codecs", "encode").g("builtins", "getattr").g("torch._dynamo.pgo", "CodeId").s("name").op("TUPLE2")
    out["_codecs.encode of something computed"] = a.op("REDUCE").s("latin1").op("TUPLE2").op("REDUCE").done()
    # torch.save blobs nested in _load_from_bytes
    evil = b"\x80\x02cposix\nsystem\nq\x00X\x02\x00\x00\x00idq\x01\x85q\x02Rq\x03."
    inner = b"\x80\x02\x8a\x0alp\xf9\x20j\xa8\x50\x19.\x80\x02M\xe9\x03.\x80\x02}q\x00." + evil
    out["nested torch.save running os.system"] = Asm().g("torch.storage", "_load_from_bytes").by(inner).op("TUPLE1").op("REDUCE").done()
    nested_37 = issue_37()
    inner = b"\x80\x02\x8a\x0alp\xf9\x20j\xa8\x50\x19.\x80\x02M\xe9\x03.\x80\x02}q\x00." + nested_37
    out["nested torch.save carrying issue 37"] = Asm().g("torch.storage", "_load_from_bytes").by(inner).op("TUPLE1").op("REDUCE").done()
    # tensors: state set on the tensor by setattr, hooks that are functions
    tv2 = g("torch._utils", "_rebuild_tensor_v2")
    a = Asm().g("torch._tensor", "_rebuild_from_type_v2").raw(tv2).g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE")
    out["_rebuild_from_type_v2 to a class that is not a tensor"] = a.op("NONE").op("MARK").op("TUPLE").op("REDUCE").done()
    a = Asm().g("torch._tensor", "_rebuild_from_type_v2").raw(tv2).g("torch", "Tensor").op("EMPTY_TUPLE")
    a.op("EMPTY_DICT").s("__class__").g("torch._dynamo.pgo", "CodeId").op("SETITEM")
    out["_rebuild_from_type_v2 setting __class__ on a tensor"] = a.op("MARK").op("TUPLE").op("REDUCE").done()
    a = Asm().raw(tv2).op("MARK").s("pid").op("BINPERSID").i(0).op("EMPTY_TUPLE").op("EMPTY_TUPLE").op("NEWTRUE")
    a.g("collections", "OrderedDict").op("EMPTY_TUPLE").op("REDUCE").i(0).raw(RGM).op("SETITEM").op("TUPLE")
    out["a tensor whose backward hook is a function"] = a.op("REDUCE").done()
    # calls of what a call returned, and opaque values used as callables
    a = Asm().g("builtins", "getattr").g("torch._inductor.codecache", "CppCodeCache").s("load").op("TUPLE2")
    out["calling getattr(CppCodeCache, 'load')"] = a.op("REDUCE").s("int x;").op("TUPLE1").op("REDUCE").done()
    a = Asm().g("collections", "defaultdict").g("builtins", "getattr").g("torch._inductor.codecache", "CppCodeCache")
    out["a defaultdict whose factory is getattr's result"] = a.s("load").op("TUPLE2").op("REDUCE").op("TUPLE1").op("REDUCE").done()
    a = Asm().g("builtins", "str").g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op("NEWOBJ")
    a.g("builtins", "getattr").g("torch._inductor.codecache", "CppCodeCache").s("load").op("TUPLE2").op("REDUCE")
    out["a builtin constructor handed an opaque value"] = a.op("TUPLE2").op("REDUCE").done()
    a = Asm().g("torch._inductor.output_code", "CompiledFxGraph").op("EMPTY_TUPLE").op("NEWOBJ").op("EMPTY_DICT")
    a.s("current_callable").g("torch.storage", "_load_from_bytes").op("SETITEM").op("BUILD")
    out["CompiledFxGraph whose current_callable is _load_from_bytes"] = a.done()
    a = Asm().g("builtins", "list").g("torch._inductor.output_code", "CompiledFxGraph").op("EMPTY_TUPLE").op("NEWOBJ")
    out["iterating an instance whose class runs __call__ code"] = a.op("TUPLE1").op("REDUCE").done()
    a = Asm().op("EMPTY_DICT").g("torch._inductor.output_code", "CompiledFxGraph").op("EMPTY_TUPLE").op("NEWOBJ")
    out["a dict key whose class runs code"] = a.s("v").op("SETITEM").done()
    a = Asm().raw(b"\x82\x01").op("EMPTY_TUPLE").op("REDUCE")
    out["a copyreg extension code"] = a.done()
    a = Asm().g("builtins", "getattr").g("torch._dynamo.pgo", "CodeId").s("__init__").op("TUPLE2").op("REDUCE")
    out["getattr of a dunder"] = a.done()
    a = Asm().g("builtins", "setattr").g("torch._dynamo.pgo", "CodeId").s("get").raw(STR).op("TUPLE3").op("REDUCE")
    out["builtins.setattr on a class"] = a.done()
    a = Asm().g("functools", "partial").raw(RGM).op("TUPLE1").op("REDUCE")
    out["functools.partial of reduce_graph_module"] = a.done()
    return out


EXPLOITS = {**_class_setattr_family(), **_code_family()}


@pytest.mark.parametrize("name", sorted(EXPLOITS))
def test_exploit_pickles_are_refused(name):
    r = picklescan.scan(EXPLOITS[name])
    assert not r.ok, (name, r)


def test_the_family_is_large():
    assert len(EXPLOITS) >= 60


def _unpickle_in_child(blobs: list[bytes], timeout: float = 120) -> dict:
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "pickle_tripwire_child.py")], cwd=ROOT,
                         input=json.dumps([b.hex() for b in blobs]), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _issue_37_tripwire_blobs() -> tuple[bytes, bytes]:
    """A real shape (an instance restored from plain data), and issue 37's exploit with a payload the
    tripwire sees (compile) and that does nothing."""
    plain = Asm().g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op("NEWOBJ").state(
        {"filename": "f.py", "name": "f"}, slots=False).op("BUILD").done()
    payload = "compile('1', 'x', 'eval')\n"
    blob = issue_37().replace(PAYLOAD.encode(), payload.encode()).replace(
        bytes([len(PAYLOAD)]), bytes([len(payload)]), 1)
    return plain, blob


# --- the property test: generated opcode sequences over the allowed globals --------------------
_GLOBALS = [("builtins", n) for n in ("list", "dict", "set", "tuple", "str", "int", "bytes", "frozenset",
                                        "object", "getattr")] + [
    ("collections", "OrderedDict"), ("collections", "defaultdict"), ("collections", "Counter"),
    ("collections", "deque"), ("copyreg", "_reconstructor"), ("_codecs", "encode"), ("functools", "partial"),
    ("torch.fx.graph_module", "reduce_graph_module"), ("torch.storage", "_load_from_bytes"),
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._tensor", "_rebuild_from_type_v2"), ("torch", "Tensor"),
    ("torch", "Size"), ("torch", "device"), ("torch", "float32"), ("inspect", "_ParameterKind"),
    ("inspect", "Parameter"), ("inspect", "_empty"), ("torch.utils._ordered_set", "OrderedSet"),
    ("torch._dynamo.pgo", "CodeId"), ("torch._dynamo.source", "AttrSource"), ("torch._dynamo.source", "LocalSource"),
    ("torch._inductor.utils", "BoxedBool"), ("torch._inductor.output_code", "CompiledFxGraph"),
    ("torch._functorch._aot_autograd.aot_autograd_result", "SerializedGraphModule"),
    ("torch._functorch._aot_autograd.schemas", "MutationType"), ("sympy.core.symbol", "Symbol"),
    ("sympy.core.numbers", "Integer"), ("torch.utils._sympy.functions", "FloorDiv"),
]
_STRINGS = ["x", "__setstate__", "get", "_code", "code", "append", "extend", "add", "fn", "args", "name", "POINTWISE",
            "POSITIONAL_ONLY", "__class__", "__dict__", "__reduce__", "latin1", "import torch\n", PAYLOAD,
            "\ndef forward(self, x):\n    return x\n", "compile('1', 'x', 'eval')\n"]
_SIMPLE = ["NONE", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "EMPTY_SET", "MARK", "TUPLE", "TUPLE1", "TUPLE2",
           "TUPLE3", "REDUCE", "BUILD", "SETITEM", "SETITEMS", "APPEND", "APPENDS", "ADDITEMS", "FROZENSET",
           "NEWOBJ", "NEWOBJ_EX", "OBJ", "DICT", "LIST", "MEMOIZE", "POP", "DUP", "NEWTRUE", "BINPERSID"]
_INSTR = st.one_of(
    st.sampled_from(_GLOBALS).map(lambda mn: ("g", mn)),
    st.sampled_from(_STRINGS).map(lambda s: ("s", s)),
    st.sampled_from(_SIMPLE).map(lambda o: ("op", o)),
    st.integers(0, 7).map(lambda k: ("get", k)),
    st.integers(0, 3).map(lambda n: ("i", n)),
)


def _assemble(program: list[tuple[str, object]]) -> bytes:
    a = Asm()
    for kind, x in program:
        {"g": lambda: a.g(*x), "s": lambda: a.s(x), "op": lambda: a.op(x), "get": lambda: a.get(x),
         "i": lambda: a.i(x)}[kind]()
    return a.done()


def test_generated_pickles_are_refused_or_harmless():
    """Generated opcode sequences over the allowed globals: refused, or (unpickled in one child
    process under the tripwire) no code runs and no allowed class, function or module changes."""
    accepted: list[bytes] = []
    seen = {"refused": 0}

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(_INSTR, min_size=1, max_size=24))
    def one(program):
        blob = _assemble(program)
        r = picklescan.scan(blob)
        if r.ok:
            accepted.append(blob)
        else:
            seen["refused"] += 1

    one()
    # and the exploits' near misses: each exploit with one opcode dropped
    for blob in list(EXPLOITS.values())[:40]:
        for cut in range(2, min(len(blob) - 1, 60), 3):
            mutated = blob[:cut] + blob[cut + 1:]
            if picklescan.scan(mutated).ok:
                accepted.append(mutated)
    # the tripwire is real: issue 37's exploit trips it under pickle.loads (the scan refuses it), a
    # real shape does not (one child for all: its start, importing torch, is most of the time)
    plain, exploit = _issue_37_tripwire_blobs()
    assert picklescan.scan(plain).ok and not picklescan.scan(exploit).ok
    report = _unpickle_in_child([plain, *accepted, exploit])  # the exploit last: it changes CodeId
    exploit_at = len(accepted) + 1
    assert any(i == exploit_at and e.split(" ")[0] in ("exec", "compile") for i, e in report["tripped"]), report
    tripped = [(i - 1, e) for i, e in report["tripped"] if i != exploit_at]
    assert tripped == [], [(e, accepted[i].hex() if i >= 0 else 'plain') for i, e in tripped[:5]]
    assert seen["refused"] > 0 and len(accepted) > 50, (seen, len(accepted))


# --- what a real CUDA fxgraph entry needs (torch 2.11 + triton 3.6, H200: benchmarks/gpu_cache_trust.py) ---
def _instance(a: Asm) -> Asm:
    return a.g("torch._dynamo.pgo", "CodeId").op("EMPTY_TUPLE").op("NEWOBJ")


def test_a_docstring_key_holds_data_only():
    """triton's JITFunction keeps `__doc__` in its state: a constant passes, anything else is refused."""
    ok = _instance(Asm()).op("EMPTY_DICT").s("__doc__").s("Adds two tensors.").op("SETITEM").op("BUILD").done()
    assert picklescan.scan(ok).ok
    bad = _instance(Asm()).op("EMPTY_DICT").s("__doc__").g("torch.fx.graph_module", "reduce_graph_module")
    assert not picklescan.scan(bad.op("SETITEM").op("BUILD").done()).ok
    for key in ("__setstate__", "__reduce__", "__getattr__", "__class__"):
        bad = _instance(Asm()).op("EMPTY_DICT").s(key).s("x").op("SETITEM").op("BUILD").done()
        assert not picklescan.scan(bad).ok, key


def test_a_defaultdict_may_keep_an_instances_bound_method_as_its_factory():
    """`defaultdict(launcher.create_binder)`: stored, never called while loading; the same factory from a
    class (`getattr(CppCodeCache, 'load')`) stays refused, and the dict is live: it may not be handed to
    a constructor that uses what it is given."""
    a = Asm().g("collections", "defaultdict").g("builtins", "getattr")
    ok = _instance(a).s("create_binder").op("TUPLE2").op("REDUCE").op("TUPLE1").op("REDUCE").done()
    assert picklescan.scan(ok).ok, picklescan.scan(ok)
    a = Asm().g("builtins", "list").g("collections", "defaultdict").g("builtins", "getattr")
    bad = _instance(a).s("create_binder").op("TUPLE2").op("REDUCE").op("TUPLE1").op("REDUCE")
    assert not picklescan.scan(bad.op("TUPLE1").op("REDUCE").done()).ok  # list(d) iterates it
    a = Asm().g("collections", "defaultdict").g("builtins", "getattr")
    a = _instance(a).s("create_binder").op("TUPLE2").op("REDUCE").op("EMPTY_DICT").op("TUPLE2").op("REDUCE")
    assert picklescan.scan(a.done()).ok  # a plain mapping beside it: iterated, holds nothing live


def _signature_annotated_with(a: Asm, module: str, name: str) -> Asm:
    """inspect.Signature((Parameter('x', POSITIONAL_OR_KEYWORD) restored with `_annotation`,)): how a
    CUDA entry pickles a triton kernel's signature (annotations: triton's constexpr class)."""
    a.g("inspect", "Signature").g("inspect", "Parameter").s("x").g("builtins", "getattr")
    a.g("inspect", "_ParameterKind").s("POSITIONAL_OR_KEYWORD").op("TUPLE2").op("REDUCE").op("TUPLE2").op("REDUCE")
    a.op("EMPTY_DICT").s("_annotation").g(module, name).op("SETITEM").op("BUILD")
    return a.op("TUPLE1").op("TUPLE1").op("REDUCE")


def test_a_signature_may_keep_a_class_as_an_annotation_but_nothing_that_runs():
    ok = _signature_annotated_with(Asm(), "torch._inductor.output_code", "CompiledFxGraph").done()
    assert picklescan.scan(ok).ok, picklescan.scan(ok)
    bad = _signature_annotated_with(Asm(), "torch.fx.graph_module", "reduce_graph_module").done()
    assert not picklescan.scan(bad).ok  # a function, not a class
    a = Asm().g("inspect", "Signature").g("builtins", "getattr").g("torch._inductor.codecache", "CppCodeCache")
    bad = a.s("load").op("TUPLE2").op("REDUCE").op("TUPLE1").op("TUPLE1").op("REDUCE").done()
    assert not picklescan.scan(bad).ok  # an opaque value handed to a constructor
