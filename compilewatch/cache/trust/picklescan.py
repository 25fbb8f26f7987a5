"""Check a pickle without running it: what would `pickle.loads` import, call and restore?

A pickle is a program for a small stack machine: GLOBAL / STACK_GLOBAL import any `module.name`,
REDUCE / NEWOBJ / OBJ / INST call it, BUILD runs its `__setstate__`. So `pickle.loads` of a file from
elsewhere runs whatever its author chose. `scan` reads the opcodes with `pickletools.genops` (a
parser) and follows the pickle's stack (pickletools' table says what each opcode pops and pushes),
so it knows what each call calls with which arguments. It decides by what an object IS, not by the
module that names it:

- every name is resolved (importing only the modules these lists name) and compared by identity with
  what evaluates strings, executes source, loads native code, runs commands, imports or unpickles
  (`danger_of`): refused wherever it is named from (`torch._inductor.codecache.CDLL` is `ctypes.CDLL`);
- a name must be listed exactly (`ALLOWED_GLOBALS`) or be a class *defined* in a data module of
  torch's caches (`CLASS_MODULES`);
- a call must run only storing code: functions only if `CALLABLE_GLOBALS` lists them (the rest are
  values); a class called (REDUCE) only if its `__new__`/`__init__` store (object's, builtins',
  enums, dataclass-generated, `CALLABLE_CLASSES`), constructed (NEWOBJ) only if its `__new__` does,
  restored (BUILD) only by builtins' or torch's own `__setstate__`;
- sympy-based classes only from numbers, sympy objects and tuples of them (their constructors
  sympify, and sympify evaluates strings); `reduce_graph_module` only on FX-shaped source
  (`fxsource`), `_load_from_bytes` only on bytes that scan as torch.save's pickles,
  `_rebuild_from_type_v2` only with torch's tensor rebuilders, `copyreg._reconstructor` only with
  base `object`; `getattr` only in the two forms `CHECKED_CALLS` describes.

The lists are what torch's caches really use: collected from CPU caches of torch 2.11, 2.13 and 2.15
and a CUDA cache of 2.11 (H200); the call rules were checked here against a CPU cache of torch 2.13
with dynamic shapes, parameters, SDPA and PGO state. `tests/test_cache_real.py` scans such a fresh
cache under each torch CI runs, so a torch that needs something new fails a test before it fails a
user's `cache load` (which names the member and why; `--trust` overrides).
`scan` is linear in the pickle's size: every opcode does bounded work (a tuple's facts are computed
once, when it is built).

What this does not prove: that a cache is safe to use. It stops code from running while a pickle is
unpickled; an FX-graph entry still carries generated Python and C++ that torch imports on every hit,
guards it evaluates, and `.so` files it loads. A cache archive is code: trust it by who made it
(`provenance`, docs/security.md).
"""

from __future__ import annotations

import _compat_pickle
import gc
import io
import json
import pickletools
import sys
from dataclasses import dataclass
from typing import BinaryIO

from compilewatch.cache.trust import fxsource
from compilewatch.cache.trust.allowlist import (
    _ATTR_NAME,
    _MEMBER_NAME,
    _MISSING,
    CALLABLE_GLOBALS,
    CHECKED_CALLS,
    _import_attr,
    _init_is_data,
    _is_callable_class,
    _is_sympy,
    _new_is_data,
    _setstate_is_data,
    _why_refused,
    is_allowed,
)

MAX_OPS = 50_000_000  # opcodes scanned in one pickle; a real FX-graph entry has tens of thousands


# scan_file reads a pickle up to this size whole; a larger one streams. A streamed scan costs 1.1-1.6x
# the time on opcode-dense pickles (benchmarks/picklescan_linear.py --streamed, docs/benchmarks.md)
READ_WHOLE = 64 << 20


# the largest pickle scan_file scans: what the scan keeps (its bytes constants) must fit in memory, and a
# crafted member may claim anything. Real entries are KB to MB (an 8B model's FX entries: 31 MB for 10)
MAX_SCAN = 4 << 30


MAX_LINE = 64 << 20  # a text opcode's argument (GLOBAL's names, protocol 0's strings); real ones are short


@dataclass(frozen=True, slots=True)
class ScanResult:
    globals: tuple[str, ...]  # every "module.name" the pickle names, in order of first use
    refused: tuple[str, ...]  # the ones not allowed (and calls that are not), each with why
    problem: str | None  # the pickle is malformed, or uses an opcode this check refuses

    @property
    def ok(self) -> bool:
        return not self.refused and self.problem is None


# --- the stack model ------------------------------------------------------------------------------
_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING",
               "STRING"}


# storage types the object pickle of torch.save's legacy format names (inside _load_from_bytes only)
_TORCH_SAVE_GLOBALS = frozenset({f"torch.{t}Storage" for t in (
    "Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool", "ComplexFloat",
    "ComplexDouble", "Untyped")} | {"torch.storage.UntypedStorage", "torch.storage.TypedStorage"})


class _Global(str):
    """A global's "module.name" on the scan's model of the pickle stack."""


class _Str(str):
    """A string constant."""


class _Bytes(bytes):
    """A bytes constant."""


class _Num:
    """An int, float, bool or None constant."""


_NUM = _Num()


class _Seq:
    """A tuple the pickle built, with what its items are, computed once when it is built (so
    consuming a tuple fetched from the memo a million times costs nothing per fetch)."""

    __slots__ = ("items", "checked", "sympy_ok", "sympy_tail_ok", "literal")

    def __init__(self, items: list[object]) -> None:
        self.items = items
        self.checked = any((isinstance(x, _Global) and x in CHECKED_CALLS) or (isinstance(x, _Seq) and x.checked)
                           for x in items)
        self.sympy_tail_ok = all(_sympy_arg_ok(x) for x in items[1:])
        self.sympy_ok = self.sympy_tail_ok and (not items or _sympy_arg_ok(items[0]))
        self.literal = all(x is _NUM or isinstance(x, _Str) for x in items)  # numbers and strings only


class _Dict:
    """A dict the pickle built; only what `reduce_graph_module` reads of it is kept (its source)."""

    __slots__ = ("code",)

    def __init__(self) -> None:
        self.code: object = None

    def set(self, key: object, value: object) -> None:
        if isinstance(key, _Str) and key in ("_code", "code") and (key == "_code" or self.code is None):
            self.code = value


class _Obj:
    """An instance the pickle constructed, and its class."""

    __slots__ = ("cls",)

    def __init__(self, cls: type) -> None:
        self.cls = cls


class _Computed:
    """A value a checked call made (its origin, for the message); None on the stack is any other value."""

    def __init__(self, what: str) -> None:
        self.what = what


def _sympy_arg_ok(x: object) -> bool:
    """What a sympy constructor may get: numbers, sympy objects and tuples of them. Never a string,
    bytes or any other container: sympify parses strings (with eval) and iterates containers."""
    return x is _NUM or (isinstance(x, _Obj) and _is_sympy(x.cls)) or (isinstance(x, _Seq) and x.sympy_ok)


_MARK = object()


_CALLS = frozenset({"REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST"})


_NUM_OPS = frozenset({"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT",
                      "NEWTRUE", "NEWFALSE", "NONE"})


_BYTES_OPS = frozenset({"BINBYTES", "SHORT_BINBYTES", "BINBYTES8"})


_MEMO_PUT = {"PUT", "BINPUT", "LONG_BINPUT"}


_MEMO_GET = {"GET", "BINGET", "LONG_BINGET"}


# opcodes that reach the copyreg extension registry: a way to name a global without saying it
_REFUSED_OPS = {"EXT1", "EXT2", "EXT4"}


_TORCH_SAVE_PICKLES = 5  # torch.save's legacy format: magic, protocol, sys info, the object, storage keys


class _Scan:
    def __init__(self, max_ops: int, nested: int = 0) -> None:
        self.names: dict[str, None] = {}
        self.refused: dict[str, None] = {}
        self.max_ops = max_ops
        self.nested = nested

    def refuse(self, why: str) -> None:
        if len(self.refused) < 1000:
            self.refused[why] = None

    # globals -----------------------------------------------------------------------------------
    def note(self, module: object, name: object) -> object:
        if not isinstance(module, str) or not isinstance(name, str):
            self.refuse("<a global whose name is computed>")
            return None
        if (module, name) in _compat_pickle.NAME_MAPPING:  # what pickle's fix_imports does for protocols < 3
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        full = f"{module}.{name}"
        if full not in self.names:
            self.names[full] = None
            if full not in CHECKED_CALLS:
                why = _why_refused(module, name)
                if why and not (self.nested and full in _TORCH_SAVE_GLOBALS):
                    self.refuse(full if why == "not used by torch's caches" else f"{full}: {why}")
        return _Global(full)

    def consumed(self, values: list[object]) -> None:
        """A checked global taken off the stack by anything but its own checked call is refused."""
        for v in values:
            items = v if isinstance(v, list) else (v,)  # a mark's slice: each item once
            for x in items:
                if (isinstance(x, _Global) and x in CHECKED_CALLS) or (isinstance(x, _Seq) and x.checked):
                    self.refuse("builtins.getattr used other than as getattr(<class>, 'MEMBER') or getattr(<object>, 'name')")

    # calls -------------------------------------------------------------------------------------
    def checked_call(self, fn: _Global, args: object) -> object:
        """getattr's two allowed forms (see CHECKED_CALLS); what it pushes."""
        items = args.items if isinstance(args, _Seq) else None
        if items is not None and len(items) == 2 and isinstance(items[1], _Str):
            obj, name = items
            if isinstance(obj, _Global) and is_allowed(*obj.rsplit(".", 1)) and _MEMBER_NAME.match(name):
                return None  # an enum member
            if _ATTR_NAME.match(name) and not (isinstance(obj, _Global) and obj in CHECKED_CALLS):
                return _Computed(f"getattr(..., {str(name)!r})")  # a bound method or attribute: never callable here
        shown = (f"getattr({items[0] if isinstance(items[0], str) else '<object>'}, {items[1]!r})"
                 if items is not None and len(items) == 2 else "getattr(<computed arguments>)")
        self.refuse(f"{fn} call {shown}: only getattr(<class>, 'MEMBER') and getattr(<object>, 'name') are allowed")
        return None

    def call(self, opname: str, fn: object, args: object) -> object:
        """Check one call (REDUCE / NEWOBJ / NEWOBJ_EX / OBJ / INST) of `fn` with `args`; what it pushes."""
        if not isinstance(fn, _Global):
            what = fn.what if isinstance(fn, _Computed) else "a computed object"
            self.refuse(f"<a call of {what}: only named, allowed globals may be called>")
            return None
        if fn in CHECKED_CALLS or _why_refused(*fn.rsplit(".", 1)) is not None:
            return None  # refused when it was named
        obj = _import_attr(fn)
        if obj is _MISSING:
            return None  # not importable here: pickle.loads would fail on it too
        items = args.items if isinstance(args, _Seq) else None
        if isinstance(obj, type):
            return self.construct(opname, fn, obj, items, args)
        if opname != "REDUCE" or fn not in CALLABLE_GLOBALS:
            self.refuse(f"{fn} called: it may be a value in a cache pickle, never called by one")
            return None
        if fn == "copyreg._reconstructor":  # (cls, base, state): base.__new__(cls, state) [+ base.__init__]
            base = _import_attr(items[1]) if items and len(items) == 3 and isinstance(items[1], _Global) else _MISSING
            cls = _import_attr(items[0]) if items and isinstance(items[0], _Global) else _MISSING
            if base is not object or not isinstance(cls, type):
                self.refuse("copyreg._reconstructor with a base other than object: it runs that base's constructor")
                return None
            return _Obj(cls)
        if fn == "torch._tensor._rebuild_from_type_v2":  # (func, type, args, state): calls func(*args)
            inner = items[0] if items and len(items) == 4 else None
            if not (isinstance(inner, _Global) and inner.startswith("torch._utils._rebuild_") and inner in CALLABLE_GLOBALS):
                self.refuse(f"{fn} with a function other than torch's tensor rebuilders: it calls that function")
            return None
        if fn == "torch.fx.graph_module.reduce_graph_module":  # exec(import_block + body["_code"])
            body, block = (items if items and len(items) == 2 else (None, None))
            code = body.code if isinstance(body, _Dict) else None
            if not (isinstance(code, _Str) and isinstance(block, _Str)):
                self.refuse(f"{fn} of a source the scan cannot see: it executes that source")
                return None
            why = fxsource.check(str(block) + str(code))
            if why:
                self.refuse(f"{fn} of source that is not an FX graph's ({why}): it executes that source")
            return None
        if fn == "torch.storage._load_from_bytes":  # torch.load(bytes, weights_only=False): scan what it loads
            blob = items[0] if items and len(items) == 1 else None
            if not isinstance(blob, _Bytes):
                self.refuse(f"{fn} of something computed: it unpickles it")
            else:
                self.nested_torch_save(bytes(blob))
            return None
        return None

    def construct(self, opname: str, fn: str, cls: type, items: list[object] | None, args: object) -> object:
        if _is_sympy(cls):
            # sympy constructors sympify their arguments, and sympify evaluates strings: only numbers,
            # sympy objects and tuples of them (a Symbol's first argument, its name, may be a string)
            sympy = sys.modules["sympy"]
            named = issubclass(cls, sympy.Symbol) and bool(items) and isinstance(items[0], _Str)
            if not isinstance(args, _Seq):
                ok = False
            elif issubclass(cls, sympy.Float):  # Float(<numeral str>) or Float((sign, <hex str>, exp, bc)): parsed, never sympified
                ok = all(x is _NUM or isinstance(x, _Str) or (isinstance(x, _Seq) and x.literal) for x in args.items)
            elif issubclass(cls, sympy.Rational):  # Rational/Integer(<numeral str>): fractions/int parse; a container is sympified
                ok = args.literal
            else:
                ok = args.sympy_tail_ok if named else args.sympy_ok
            if not ok:
                self.refuse(f"{fn} constructed from a string or a container: sympy evaluates strings (sympify)")
            elif opname == "NEWOBJ_EX" and not issubclass(cls, (sympy.Symbol, sympy.Float)):  # assumptions / precision
                self.refuse(f"{fn} constructed with keyword arguments")
            return _Obj(cls)
        new_only = opname in ("NEWOBJ", "NEWOBJ_EX")
        if _is_callable_class(cls):
            pass
        elif not _new_is_data(cls):
            self.refuse(f"{fn}.__new__ runs its own code: not a data class")
        elif not new_only and not _init_is_data(cls):
            self.refuse(f"{fn} called: its __init__ runs its own code (only data classes may be called)")
        return _Obj(cls)

    def build(self, obj: object) -> None:
        if isinstance(obj, _Obj) and not _setstate_is_data(obj.cls):
            self.refuse(f"{obj.cls.__module__}.{obj.cls.__qualname__}.__setstate__ runs its own code (BUILD)")

    def nested_torch_save(self, blob: bytes) -> None:
        """The legacy `torch.save` bytes `_load_from_bytes` hands to `torch.load`: a few pickles back to
        back (the object's may name storage types and use persistent ids), then raw storage bytes."""
        if self.nested:
            self.refuse("torch.storage._load_from_bytes inside torch.storage._load_from_bytes")
            return
        f = io.BytesIO(blob)
        for _ in range(_TORCH_SAVE_PICKLES):
            inner = _Scan(self.max_ops, nested=1)
            problem = inner.run(f)
            if problem:
                self.refuse(f"torch.storage._load_from_bytes of bytes that are not torch.save's ({problem})")
                return
            for n in inner.names:
                self.names.setdefault(n, None)
            for r in inner.refused:
                self.refuse(r)

    # the loop ----------------------------------------------------------------------------------
    def run(self, stream) -> str | None:  # io.BytesIO, or _Capped over a file
        memo: dict[int, object] = {}
        stack: list[object] = []

        def pop_args(op) -> list[object]:
            """What `op` takes off the stack, bottom first (a mark's slice as one list)."""
            before = op.stack_before
            if pickletools.markobject in before:
                k = before.index(pickletools.markobject)
                sliced: list[object] = []
                while stack and stack[-1] is not _MARK:
                    sliced.append(stack.pop())
                if stack:
                    stack.pop()
                sliced.reverse()
                under = [stack.pop() if stack else None for _ in range(k)][::-1]
                return [*under, sliced]
            n = len(before)
            taken = stack[len(stack) - n:] if n else []
            del stack[len(stack) - n:]
            return taken

        try:
            for n, (op, arg, _pos) in enumerate(pickletools.genops(stream)):
                if n > self.max_ops:
                    return f"more than {self.max_ops} pickle opcodes"
                opname = op.name
                if opname in ("FRAME", "PROTO"):
                    continue
                if opname == "STOP":
                    return None
                if opname in _REFUSED_OPS:
                    self.refuse(f"<copyreg extension code {arg}>")
                if opname == "MEMOIZE":
                    memo[len(memo)] = stack[-1] if stack else None
                    continue
                if opname in _MEMO_PUT:
                    memo[int(arg)] = stack[-1] if stack else None
                    continue
                if opname in _MEMO_GET:
                    stack.append(memo.get(int(arg)))
                    continue
                if opname == "MARK":
                    stack.append(_MARK)
                    continue
                args = pop_args(op)
                if opname in _STRING_OPS:
                    stack.append(_Str(arg if isinstance(arg, str) else arg.decode("latin-1")))
                elif opname in _BYTES_OPS:
                    stack.append(_Bytes(arg))
                elif opname in _NUM_OPS:
                    stack.append(_NUM)
                elif opname == "GLOBAL":
                    module, _, name = str(arg).partition(" ")
                    stack.append(self.note(module, name))
                elif opname == "STACK_GLOBAL":
                    module, name = args if len(args) == 2 else (None, None)
                    stack.append(self.note(module, name))
                elif opname in ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_TUPLE"):
                    items = args[-1] if opname == "TUPLE" else args
                    stack.append(_Seq(list(items)))
                elif opname == "INST":  # MARK args... INST module name: calls the class with the mark's slice
                    module, _, name = str(arg).partition(" ")
                    self.consumed(args)
                    stack.append(self.call("OBJ", self.note(module, name), _Seq(list(args[-1]))))
                elif opname in _CALLS:
                    if opname == "OBJ":  # MARK cls args... OBJ: the class is the first of the mark's slice
                        sliced = args[-1] if args else []
                        fn, fargs = (sliced[0] if sliced else None), _Seq(list(sliced[1:]))
                    else:
                        fn, fargs = (args[0] if args else None), (args[1] if len(args) >= 2 else None)
                    if opname == "REDUCE" and isinstance(fn, _Global) and fn in CHECKED_CALLS:
                        result = self.checked_call(fn, fargs)
                        stack.append(result)
                        continue
                    self.consumed(args)
                    stack.append(self.call(opname, fn, fargs))
                elif opname == "BUILD":
                    self.consumed(args[1:])
                    self.build(args[0] if args else None)
                    stack.append(args[0] if args else None)
                elif opname in ("EMPTY_DICT", "DICT"):
                    self.consumed(args)
                    d = _Dict()
                    if opname == "DICT" and args:
                        pairs = args[-1]
                        for i in range(0, len(pairs) - 1, 2):
                            d.set(pairs[i], pairs[i + 1])
                    stack.append(d)
                elif opname in ("SETITEM", "SETITEMS", "APPEND", "APPENDS", "ADDITEMS"):
                    self.consumed(args[1:])
                    container = args[0] if args else None
                    if isinstance(container, _Dict):
                        pairs = args[1:] if opname == "SETITEM" else (args[-1] if opname == "SETITEMS" else [])
                        for i in range(0, len(pairs) - 1, 2):
                            container.set(pairs[i], pairs[i + 1])
                    stack.append(container)
                elif opname == "DUP":
                    stack.extend(args * 2)
                elif opname in ("PERSID", "BINPERSID") and self.nested:
                    self.consumed(args)
                    stack.append(None)  # torch.load's persistent_load: a storage
                else:
                    self.consumed(args)
                    stack.extend(None for _ in op.stack_after)
        except Exception as e:  # noqa: BLE001 - genops raises ValueError and friends on malformed input
            return f"not a valid pickle ({type(e).__name__}: {str(e)[:120]})"
        return "not a valid pickle (no STOP opcode)"


def scan(data: bytes, *, max_ops: int = MAX_OPS) -> ScanResult:
    """Every global a pickle names and what in it is not allowed; never unpickles.

    Follows the pickle's stack (with pickletools' opcode table: what each opcode pops and pushes) to
    know what each call calls with which arguments. Linear in the pickle's size: every opcode does a
    bounded amount of work (a tuple's facts are computed once, when it is built)."""
    return _scan_stream(io.BytesIO(data), max_ops)


def scan_file(fh: BinaryIO, size: int, *, max_ops: int = MAX_OPS) -> ScanResult:
    """`scan` of the pickle in the next `size` bytes of `fh` (an open file, an archive member as it
    streams), never reading past `size`. Up to READ_WHOLE bytes are read at once (the fastest scan);
    a larger pickle is read as its opcodes ask, so the file is never held whole. What stays in memory
    is what `scan` keeps of any pickle: its bytes constants (a `_load_from_bytes` argument is scanned
    in turn), its strings and its stack; so a pickle over MAX_SCAN is not scanned (a problem: refused
    like a malformed one), and a text argument over MAX_LINE makes the pickle malformed."""
    if size > MAX_SCAN:
        return ScanResult((), (), f"a pickle of {size} bytes, more than the {MAX_SCAN} bytes a scan may hold "
                          "in memory: not scanned")
    if size <= READ_WHOLE:
        return scan(fh.read(max(size, 0)), max_ops=max_ops)
    return _scan_stream(_Capped(fh, size), max_ops)


class _Capped:
    """`fh` as pickletools reads it, never past `left` bytes. An opcode's length field can claim up
    to 2**63 bytes (BINBYTES8), and a file object allocates what it is asked for before it reads."""

    __slots__ = ("fh", "left", "pos")

    def __init__(self, fh: BinaryIO, size: int) -> None:
        self.fh, self.left, self.pos = fh, max(size, 0), 0

    def _take(self, data: bytes) -> bytes:
        self.left -= len(data)
        self.pos += len(data)
        return data

    def tell(self) -> int:  # pickletools names an opcode's position in its errors
        return self.pos

    def read(self, n: int | None = -1) -> bytes:
        n = self.left if n is None or n < 0 else min(n, self.left)
        return self._take(self.fh.read(n)) if n > 0 else b""

    def readline(self, limit: int | None = -1) -> bytes:
        # a line past MAX_LINE comes back without its newline: pickletools calls the pickle malformed
        limit = min(self.left if limit is None or limit < 0 else limit, self.left, MAX_LINE + 1)
        return self._take(self.fh.readline(limit)) if limit > 0 else b""


def _scan_stream(stream, max_ops: int) -> ScanResult:
    s = _Scan(max_ops)
    collecting = gc.isenabled()
    gc.disable()  # the model's objects form no cycles; a collection pass per allocation burst is wasted work
    try:
        problem = s.run(stream)
    finally:
        if collecting:
            gc.enable()
    return ScanResult(tuple(s.names), tuple(s.refused), problem)


def is_pickle_file(rel: str, head: bytes) -> bool:
    """Does torch unpickle the cache file `rel` (or could it be a pickle)? Every file under the
    sub-caches torch reads with pickle.load: `fxgraph/`, `aotautograd/` (FX graph and AOTAutograd
    entries), `dynamo/` (PGO code-state files and precompile entries); files under `cache/` that are
    not JSON (`torch._inductor.cache.OnDiskCache` pickles dicts there, beside the JSON local cache);
    and anywhere, a file named *.pkl / *.pickle or starting with a pickle's PROTO opcode (0x80)."""
    head_dir = rel.split("/", 1)[0]
    if head_dir in ("fxgraph", "aotautograd", "dynamo"):
        return not rel.endswith(".lock")
    if head_dir == "cache":
        return head[:1] not in (b"{", b"[", b" ", b"\n", b"")
    return rel.endswith((".pkl", ".pickle")) or head[:1] == b"\x80"


def scan_artifact(kind: str, content: object) -> ScanResult:
    """Check one Mega-Cache artifact before torch's `populate_caches` writes or unpickles it: the
    autotune kind is JSON (torch's RemoteCacheJsonSerde) and must parse as JSON; every other kind
    (inductor, aot_autograd, pgo, precompile, and any a newer torch adds) is scanned as a pickle."""
    if not isinstance(content, bytes):
        return ScanResult((), (), f"{kind} artifact content is {type(content).__name__}, not bytes")
    if kind == "autotune":
        try:
            json.loads(content)
            return ScanResult((), (), None)
        except ValueError:
            return ScanResult((), (), "an autotune artifact that is not JSON")
    return scan(content)


def strings(data: bytes, *, limit: int = 100_000) -> list[str]:
    """The string constants of a pickle (no code runs): how `verify` finds the FX-graph keys an
    AOTAutograd entry points at without unpickling it."""
    out: list[str] = []
    try:
        for op, arg, _pos in pickletools.genops(io.BytesIO(data)):
            if op.name in _STRING_OPS and isinstance(arg, str):
                out.append(arg)
                if len(out) >= limit:
                    break
            if op.name == "STOP":
                break
    except Exception:  # noqa: BLE001 - a malformed pickle: what was read so far
        pass
    return out
