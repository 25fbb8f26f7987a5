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
  base `object`; `getattr` only in the two forms `CHECKED_CALLS` describes;
- what each opcode does to whatever object it lands on (`stackmodel`, issue 37: a slot-state BUILD
  on an allowed class set `__setstate__ = reduce_graph_module` and `get = str` on it, and the next
  BUILD executed a string): BUILD, SETITEM(S), APPEND(S) and ADDITEMS only on an instance or
  container this pickle made (never a class, function, module attribute, enum member, sympy object
  or call result), BUILD once per instance, its state a dict of plain string keys (no dunder, no
  `append`/`extend`/`add`) that stores no function and no class whose construction runs code; a
  call's result is what the callee declares (an instance, a tensor, a member...) or opaque, which
  nothing may call, build, fill or hand to code that uses it. `reduce_graph_module`'s body may hold
  nothing FX's re-trace could call, and a SerializedGraphModule's stored call is checked at STOP.
- what builtins and torch's restores call on a state (session 14's red team: `CachingAutotuner`'s
  `self.__dict__.update(state)` calls `state.keys()`; a `keys` that was `InductorCacheArtifact.
  populate_cache` wrote a file of the pickle's choosing, and on 2.13 unpickled it unscanned): under
  `keys`, `get` and `items` a BUILD state keeps data only, and a torch restore's state is never an
  instance;
- what the loader allocates: a memo index past the opcodes read so far (the unpickler's memo is an
  array: `LONG_BINPUT 2**31` asks for 32 GiB), `bytes(n)` / `bytearray(n)` of a number, a container
  built from a `range`, a codec other than a plain text one (its module is imported) are refused;
  a memo'd constant loaded or encoded again and again is scanned once. Beyond those, `loadcost`
  models what the load allocates (every constant, container, copy a call or a restore makes, storage
  torch.load sizes) and computes (hashing, sympy's evaluation, `__post_init__` walks), and refuses a
  pickle past max(64 MiB, 8x its size) of memory or max(2**28, 256x its size) steps; a hashed key
  nested deeper than 1000 (CPython's tuple hash recurses in C: a crash past ~1e5) and keys made to
  share one hash are refused (session 15: a memo'd value copied k times held k*L bytes; session 16: floats
  sharing a hash are counted, and each probe of such keys is charged, again at each copy of a container);
- what torch's code does with a state during the load (session 15): AutotuneCache's restore with a
  `remote_cache` builds a Redis client (RemoteAutotuneCache) under a key of the pickle's choosing,
  CachingAutotuner's with `incremental_autotune` imports a plugin, TritonCompileResult's looks into its
  `kernel`: refused unless they are local data in plain dicts. Session 16 (`paths`): where torch later
  writes what a state holds -- an AutotuneCache's `local_cache` and recorder key, a CompiledFxGraph's
  `cache_key`, a static launcher's cubin -- only the path torch makes; CompiledAOTI's __post_init__ (it
  may dlopen its `filename`) is never called. Session 16b: a CachingAutotuner's `filename` and a triton
  bundle's artifact names too; a bound method is kept in an object only where torch keeps one (`methods`:
  a `populate_cache` kept as `_reload_kernel`, which torch calls, wrote a file of the pickle's). No state may put an instance, a global or
  a call's result over a method or cached_property of its class (StaticallyLaunchedTritonKernel's
  `__del__` called `self.C_impl._unload_kernel(self.module)`: a C_impl holding `getattr(CppCodeCache(),
  'load')` compiled and loaded the pickle's C++), and what that `__del__` reads is None or {}.
- what FX's re-trace runs for real (`fxbounds`): a GraphModule's source may not compute on its own
  constants past small bounds (`"a" * 10**9`, `10 ** 10 ** 8`), and what its torch calls on constant
  shapes allocate is charged to the load (`full([16384, 16384])`: 1 GiB during pickle.loads).

Audit of what the allowed names reach (torch 2.13, issue 37): the protocol methods of the 630
classes of CLASS_MODULES (`__repr__`, `__hash__`, `__eq__`, `__iter__`, `__index__`, ...) call no
instance attribute and evaluate, import, open or load nothing; nine `__call__`s call an instance
attribute (`CompiledFxGraph.current_callable`, `SerializableCompiledFunction.compiled_fn`, ...), and
some classes have their own `__del__` (static triton launchers), `__getattr__`/`__getattribute__`
(`FakeIndentedBuffer`, `FakeTensorTLS`) or metaclass `__call__`: such instances are live (never a
constructor's argument, a dict key or in a graph body), BUILD refuses the attribute hooks. Real FX
source reaches `torch.storage._load_from_bytes` (torch.load) or `torch._inductor.cpp_builder`
(commands) as attributes of `torch`: `fxsource` refuses them. `functools.partial` stays refused
(its BUILD re-aims it). Still trusted, as before: torch's own code run after loading on the values
an entry holds (a bound method kept as a value, `CompiledFxGraph.source_code`) -- a cache is code.

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

from compilewatch.cache.trust import methods, paths
from compilewatch.cache.trust.allowlist import CHECKED_CALLS, _builtin_owner, _owner, _why_refused
from compilewatch.cache.trust.calls import _Calls, _opaque
from compilewatch.cache.trust.loadcost import LoadCost, add_items
from compilewatch.cache.trust.stackmodel import (
    FINALIZER,
    _NONE,
    _Bytes,
    _Dict,
    _FSet,
    _Global,
    _List,
    _Num,
    _Obj,
    _Seq,
    _Set,
    _Str,
    _Value,
    build,
    fill,
    graph_args,
    key_refused,
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


# --- the stack model (the values: stackmodel) -------------------------------------------------------
_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING",
               "STRING"}


# storage types the object pickle of torch.save's legacy format names (inside _load_from_bytes only)
_TORCH_SAVE_GLOBALS = frozenset({f"torch.{t}Storage" for t in (
    "Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool", "ComplexFloat",
    "ComplexDouble", "Untyped")} | {"torch.storage.UntypedStorage", "torch.storage.TypedStorage"})


_MARK = object()


_CALLS = frozenset({"REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST"})


_NUM_OPS = frozenset({"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT",
                      "NEWTRUE", "NEWFALSE", "NONE"})


_BYTES_OPS = frozenset({"BINBYTES", "SHORT_BINBYTES", "BINBYTES8"})


_MEMO_PUT = {"PUT", "BINPUT", "LONG_BINPUT"}


_MEMO_GET = {"GET", "BINGET", "LONG_BINGET"}


_FILLS = frozenset({"SETITEM", "SETITEMS", "APPEND", "APPENDS", "ADDITEMS"})


# opcodes that reach the copyreg extension registry: a way to name a global without saying it
_REFUSED_OPS = {"EXT1", "EXT2", "EXT4"}


_TORCH_SAVE_PICKLES = 5  # torch.save's legacy format: magic, protocol, sys info, the object, storage keys


class _Scan(_Calls):
    def __init__(self, max_ops: int, nested: int = 0, *, size: int = 0, cost: LoadCost | None = None) -> None:
        self.cost = cost if cost is not None else LoadCost(size, self.refuse)  # a nested scan shares its parent's
        self.storages: set[str] = set()  # torch.load's storage keys (nested), each allocated once
        self.names: dict[str, None] = {}
        self.refused: dict[str, None] = {}
        self.max_ops = max_ops
        self.nested = nested
        self.graphs: list[tuple[object, object]] = []  # SerializedGraphModules' (args, class): checked at STOP
        self.loaded: dict[int, _Bytes] = {}
        self.encoded: dict[tuple[int, str], tuple[_Str, _Bytes]] = {}
        self.methods = methods.Tracker(self.refuse)  # where a bound method is kept (session 16b)

    def refuse(self, why: str | None) -> None:
        if why and len(self.refused) < 1000:
            self.refused[why] = None

    # globals -----------------------------------------------------------------------------------
    def note(self, module: object, name: object) -> object:
        if not isinstance(module, str) or not isinstance(name, str):
            self.refuse("<a global whose name is computed>")
            return _opaque("a global whose name is computed")
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

    def nested_torch_save(self, blob: bytes) -> None:
        """The legacy `torch.save` bytes `_load_from_bytes` hands to `torch.load`: a few pickles back to
        back (the object's may name storage types and use persistent ids), then raw storage bytes."""
        if self.nested:
            self.refuse("torch.storage._load_from_bytes inside torch.storage._load_from_bytes")
            return
        f = io.BytesIO(blob)
        for _ in range(_TORCH_SAVE_PICKLES):
            inner = _Scan(self.max_ops, nested=1, cost=self.cost)
            problem = inner.run(f)
            if problem:
                self.refuse(f"torch.storage._load_from_bytes of bytes that are not torch.save's ({problem})")
                return
            for n in inner.names:
                self.names.setdefault(n, None)
            for r in inner.refused:
                self.refuse(r)

    def stop(self) -> None:
        for args, cls in self.graphs:  # torch calls reduce_graph_module(*args) when it deserializes
            if cls == paths.CUBIN_DEVICE:
                self.refuse(paths.device_refused(args))
                continue
            if cls == paths.LAUNCHERS:
                self.refuse(paths.launchers_refused(args))
                continue
            if cls == FINALIZER:
                self.refuse(isinstance(args, _Dict) and args.n and "a StaticallyLaunchedTritonKernel's module dict "
                            "filled after its BUILD: its own __del__ unloads each value as a CUDA module handle" or None)
                continue
            why = graph_args(args)
            if why:
                self.refuse(f"{cls} holding torch.fx.graph_module.reduce_graph_module of {why}")

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
            return [*([None] * (n - len(taken))), *taken]

        try:
            for n, (op, arg, pos) in enumerate(pickletools.genops(stream)):
                if n > self.max_ops:
                    return f"more than {self.max_ops} pickle opcodes"
                opname = op.name
                if opname == "FRAME" and not self.nested and int(arg) > self.cost.size - (pos or 0) - 9:
                    # pickle.load(file) reads a frame whole (torch's OnDiskCache): 2**33 declared in 13 bytes
                    # allocated 8 GiB before it found the data short (pickletools checks no frame length)
                    return f"not a valid pickle (a frame of {int(arg)} bytes, past the pickle's end)"
                if opname in ("FRAME", "PROTO"):
                    continue
                if opname == "STOP":
                    self.stop()
                    return None
                if opname in _REFUSED_OPS:
                    self.refuse(f"<copyreg extension code {arg}>")
                if opname == "MEMOIZE":
                    memo[len(memo)] = stack[-1] if stack else None
                    self.cost.take(8, opname)
                    continue
                if opname in _MEMO_PUT:
                    if int(arg) > n:  # pickle's memo is an array: a PUT grows it to twice the index (8 bytes a slot)
                        self.refuse(f"a memo index {int(arg)} past the pickle's {n} opcodes so far: the unpickler "
                                    "allocates memory for twice that many entries")
                    memo[int(arg)] = stack[-1] if stack else None
                    self.cost.take(8, opname)
                    continue
                if opname in _MEMO_GET:
                    stack.append(memo.get(int(arg), _opaque("a memo entry never stored")))
                    continue
                if opname == "MARK":
                    stack.append(_MARK)
                    continue
                args = pop_args(op)
                out = self.step(opname, arg, args)
                self.methods.after(opname, args, out)
                stack.extend(out)
        except Exception as e:  # noqa: BLE001 - genops raises ValueError and friends on malformed input
            return f"not a valid pickle ({type(e).__name__}: {str(e)[:120]})"
        return "not a valid pickle (no STOP opcode)"

    def step(self, opname: str, arg: object, args: list[object]) -> tuple[object, ...]:
        """One opcode's effect: what it pushes (its arguments already taken off the stack)."""
        if opname in _STRING_OPS:
            s = _Str(arg if isinstance(arg, str) else arg.decode("latin-1"))
            self.cost.take(sys.getsizeof(s), opname)
            return (s,)
        if opname in _BYTES_OPS:
            self.cost.take(33 + len(arg), opname)
            return (_Bytes(arg),)
        if opname in _NUM_OPS:
            if opname == "NONE":
                return (_NONE,)
            value = True if opname == "NEWTRUE" else False if opname == "NEWFALSE" else arg
            self.cost.take(32 + (value.bit_length() >> 3 if isinstance(value, int) else 0), opname)
            return (_Num(value),)
        if opname == "GLOBAL":
            module, _, name = str(arg).partition(" ")
            return (self.note(module, name),)
        if opname == "STACK_GLOBAL":
            return (self.note(*args),)
        if opname in ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_TUPLE"):
            t = _Seq(list(args[-1] if opname == "TUPLE" else args))
            add_items(t, t.items)  # what hashing it costs, and its hash
            self.cost.take(40 + 8 * len(t.items), opname)
            return (t,)
        if opname == "INST":  # MARK args... INST module name: calls the class with the mark's slice
            module, _, name = str(arg).partition(" ")
            self.consumed(args)
            return (self.call("OBJ", self.note(module, name), _Seq(list(args[-1]))),)
        if opname in _CALLS:
            kwargs = None
            if opname == "OBJ":  # MARK cls args... OBJ: the class is the first of the mark's slice
                sliced = args[-1] if args else []
                fn, fargs = (sliced[0] if sliced else None), _Seq(list(sliced[1:]))
            else:
                fn, fargs = args[0], args[1]
                kwargs = args[2] if opname == "NEWOBJ_EX" else None
            if opname == "REDUCE" and isinstance(fn, _Global) and fn in CHECKED_CALLS:
                return (self.checked_call(fn, fargs),)
            self.consumed(args)
            return (self.call(opname, fn, fargs, kwargs),)
        if opname == "BUILD":
            self.consumed(args[1:])
            why = build(args[0], args[1], self.graphs)
            self.refuse(why)
            obj = args[0]
            if why is None and isinstance(obj, _Obj):
                self.refuse(paths.refused(obj, args[1], self.graphs))
                self.refuse(self.cost.built(obj, args[1], not _builtin_owner(_owner(obj.cls, "__setstate__"))))
            return (obj,)
        if opname in ("EMPTY_DICT", "DICT"):
            self.consumed(args)
            d = _Dict()
            self.cost.take(64, opname)
            if opname == "DICT":
                why = fill("SETITEMS", d, args[-1])
                self.refuse(why)
                if why is None:
                    self.cost.filled("SETITEMS", d, args[-1])
            return (d,)
        if opname in ("EMPTY_LIST", "LIST"):
            self.consumed(args)
            lst = _List()
            self.cost.take(56, opname)
            for x in args[-1] if opname == "LIST" else ():
                lst.hold(x)
            if opname == "LIST":
                self.cost.filled("APPENDS", lst, args[-1])
            return (lst,)
        if opname in ("EMPTY_SET", "FROZENSET"):
            self.consumed(args)
            s = _Set() if opname == "EMPTY_SET" else _FSet()
            self.cost.take(216, opname)
            for x in args[-1] if opname == "FROZENSET" else ():
                self.refuse(key_refused(x) and f"FROZENSET of an item whose hashing runs code: {key_refused(x)}")
                s.hold(x)
            if opname == "FROZENSET":
                self.cost.filled("FROZENSET", s, args[-1])
            return (s,)
        if opname in _FILLS:
            self.consumed(args[1:])
            items = args[1:] if opname in ("SETITEM", "APPEND") else args[-1]
            why = fill(opname, args[0], items)
            self.refuse(why)
            if why is None:
                self.cost.filled(opname, args[0], items)
            return (args[0],)
        if opname == "DUP":
            return (*args, *args)
        if opname in ("POP", "POP_MARK"):
            return ()
        self.consumed(args)
        if opname in ("PERSID", "BINPERSID"):  # torch.load's persistent_load: a storage (pickle.loads: an error)
            if self.nested:
                self.refuse(self.cost.storage(args[0], self.storages))
            return (_Value("storage", "a persistent id") if self.nested else _opaque("a persistent id"),)
        if opname == "BYTEARRAY8":
            self.cost.take(57 + len(arg), opname)
        return tuple(_opaque(opname) for _ in range(len(_OPS[opname].stack_after)))


_OPS = {op.name: op for op in pickletools.opcodes}


def scan(data: bytes, *, max_ops: int = MAX_OPS) -> ScanResult:
    """Every global a pickle names and what in it is not allowed; never unpickles.

    Follows the pickle's stack (with pickletools' opcode table: what each opcode pops and pushes) to
    know what each call calls with which arguments. Linear in the pickle's size: every opcode does a
    bounded amount of work (a tuple's facts are computed once, when it is built)."""
    return _scan_stream(io.BytesIO(data), max_ops, len(data))


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
    return _scan_stream(_Capped(fh, size), max_ops, size)


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


def _scan_stream(stream, max_ops: int, size: int) -> ScanResult:
    s = _Scan(max_ops, size=size)
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
