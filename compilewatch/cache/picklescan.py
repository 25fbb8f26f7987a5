"""Check a pickle without running it: which globals would `pickle.loads` import and call?

A pickle is a program for a small stack machine: its GLOBAL / STACK_GLOBAL instructions import any
`module.name` and REDUCE / BUILD / NEWOBJ call it. So `pickle.loads` of a file from elsewhere runs
whatever its author chose (`os.system`, `subprocess.Popen`, ...). `scan` reads the opcodes with
`pickletools.genops` (a parser: it never imports or calls anything) and checks every global the
pickle names against `ALLOWED_GLOBALS` (exact names) and `CLASS_MODULES` (data classes of torch's
cache modules), following the pickle's stack to check every call: only named, allowed globals are
called, getattr only in the forms `CHECKED_CALLS` describes. The lists are what torch's inductor
caches really use, collected by compiling models on CPU with
torch 2.11, 2.13 and 2.15 and scanning every fxgraph / aotautograd entry. `tests/test_picklescan.py`
derives them again from a fresh cache, so a torch that needs a new global fails a test before it
fails a user's `cache load` (which names the member and the global; `--trust` overrides).

What this does not prove. It stops a pickle that calls something torch's caches never call (the
`os.system` entry of issue 18, and anything like it). It cannot make an archive from a stranger safe:
the allowed `torch.fx.graph_module.reduce_graph_module` rebuilds an FX graph by executing the Python
source stored in the entry, an fxgraph entry carries generated Python and C++ that torch imports on
every cache hit, and `.so` files are loaded as they are. A cache archive is code; load archives only
from people and machines you trust (docs/security.md).
"""

from __future__ import annotations

import _compat_pickle
import io
import pickletools
import re
from dataclasses import dataclass

# Exact "module.name" globals seen in real inductor caches (CPU; fwd+bwd, dynamic shapes, buffers,
# constants, SDPA, no_grad) of torch 2.11, 2.13 and 2.15, plus what a CUDA cache was seen to need
# (benchmarks/gpu_cache_trust.py scans one). Functions are allowed by exact name only.
ALLOWED_GLOBALS: frozenset[str] = frozenset({
    "builtins.list", "builtins.dict", "builtins.set", "builtins.frozenset", "builtins.tuple", "builtins.slice",
    "builtins.int", "builtins.float", "builtins.bool", "builtins.str", "builtins.bytes", "builtins.complex",
    "builtins.range", "builtins.object", "builtins.bytearray",
    "collections.Counter", "collections.OrderedDict", "collections.defaultdict", "collections.deque",
    "copyreg._reconstructor", "functools.partial", "_codecs.encode",
    "torch.Size", "torch.Tensor", "torch.device", "torch.dtype", "torch.layout", "torch.memory_format",
    "torch.float32", "torch.float64", "torch.float16", "torch.bfloat16", "torch.int64", "torch.int32",
    "torch.int16", "torch.int8", "torch.uint8", "torch.bool", "torch.complex64", "torch.complex128",
    "torch.strided", "torch.contiguous_format", "torch.channels_last", "torch.preserve_format",
    "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3", "torch._utils._rebuild_parameter",
    "torch._tensor._rebuild_from_type_v2", "torch.storage._load_from_bytes",
    # torch 2.11 pickles memory formats as a dotted name through torch._utils' `torch` attribute
    "torch._utils.torch.contiguous_format", "torch._utils.torch.channels_last",
    "torch._utils.torch.channels_last_3d", "torch._utils.torch.preserve_format",
    "torch._inductor.decomposition.select_decomp_table",
    # rebuilds an FX GraphModule by running its Python source: torch's AOTAutograd entries need it,
    # which is one reason a cache is code (module docstring)
    "torch.fx.graph_module.reduce_graph_module",
    "torch.fx.graph_module._forward_from_src",
    # the tracer class a GraphModule body names (`_tracer_cls`; reduce_graph_module subclasses it to
    # re-trace): compiled flex_attention's AOTAutograd entries on CUDA (torch 2.11, H200, issue 16)
    "torch.fx.experimental.proxy_tensor.PythonKeyTracer",
    "torch.fx._symbolic_trace.Tracer",
    # a CUDA fxgraph entry's statically launched Triton kernels (torch 2.11, H200: the triton bundler's
    # "static autotuners"): the kernel objects and their signatures, as data
    "triton.runtime.jit.JITFunction", "triton.runtime.jit.KernelParam", "triton.runtime.autotuner.Config",
    "triton.language.core.constexpr",
    "inspect.Signature", "inspect.Parameter", "inspect._ParameterKind", "inspect._empty",
})
# getattr is allowed in two forms only, checked by following the pickle's stack: `getattr(<an allowed
# class>, "UPPER_CASE")`, how Python 3.12+ pickles an enum member (inspect._ParameterKind.POSITIONAL_
# OR_KEYWORD, inductor's HeuristicType.POINTWISE), and `getattr(<object>, "lower_name")`, how a bound
# method is pickled (a CUDA entry keeps `launcher.create_binder`, `cache.save`): a value that nothing
# in the pickle may call, because no call of anything but a named, allowed global is allowed at all.
# Refused: a dunder or private name, a computed name, getattr handed on instead of called.
CHECKED_CALLS: frozenset[str] = frozenset({"builtins.getattr"})
_MEMBER_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
_ATTR_NAME = re.compile(r"^[a-z][A-Za-z0-9_]*$")
# Modules whose classes (CamelCase names) hold data: constructing one runs no user-chosen code.
CLASS_MODULES: frozenset[str] = frozenset({
    "torch._dynamo.source",
    "torch._functorch._aot_autograd.aot_autograd_result",
    "torch._functorch._aot_autograd.autograd_cache",
    "torch._functorch._aot_autograd.descriptors",
    "torch._functorch._aot_autograd.runtime_wrappers",
    "torch._functorch._aot_autograd.schemas",
    "torch._functorch._aot_autograd.subclass_parametrization",
    "torch._inductor.cudagraph_utils",
    "torch._inductor.metrics",
    "torch._inductor.output_code",
    "torch._inductor.triton_bundler",
    "torch._inductor.utils",
    "torch._inductor.codecache",
    "torch._inductor.ir",
    # CUDA: the autotuner inductor pickles with its statically launched kernels (torch 2.11, H200)
    "torch._inductor.runtime.triton_heuristics",
    "torch._inductor.runtime.hints",
    "torch._inductor.runtime.static_triton_launcher",
    "torch._inductor.runtime.coordinate_descent_tuner",
    "torch._inductor.runtime.autotune_cache",
    "torch._inductor.remote_cache",
    "torch._subclasses.functional_tensor",
    "torch._subclasses.fake_tensor",
    "torch.utils._ordered_set",
    "torch.utils._sympy.functions",
    "torch.utils._sympy.symbol",
    "torch.fx.experimental.symbolic_shapes",
    "torch.fx.immutable_collections",
    "torch._guards",
    "torch.types",
    "sympy.core.symbol",
    "sympy.core.numbers",
    "sympy.core.add",
    "sympy.core.mul",
    "sympy.core.power",
    "sympy.core.relational",
    "sympy.logic.boolalg",
    "sympy.functions.elementary.miscellaneous",
    "sympy.functions.elementary.integers",
})
_CLASS_NAME = re.compile(r"^_?[A-Z][A-Za-z0-9_]*$")


@dataclass(frozen=True, slots=True)
class ScanResult:
    globals: tuple[str, ...]  # every "module.name" the pickle names, in order of first use
    refused: tuple[str, ...]  # the ones not allowed
    problem: str | None  # the pickle is malformed, or uses an opcode this check refuses

    @property
    def ok(self) -> bool:
        return not self.refused and self.problem is None


def is_allowed(module: str, name: str) -> bool:
    """Exact allowed globals, or a class of a data-only module. A dotted name (`Class.method`, which
    pickle resolves attribute by attribute) is never a class: refused unless listed exactly."""
    if f"{module}.{name}" in ALLOWED_GLOBALS:
        return True
    return module in CLASS_MODULES and "." not in name and bool(_CLASS_NAME.match(name))


_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING",
               "STRING"}
_MEMO_PUT = {"PUT", "BINPUT", "LONG_BINPUT"}
_MEMO_GET = {"GET", "BINGET", "LONG_BINGET"}
# opcodes that reach the copyreg extension registry: a way to name a global without saying it
_REFUSED_OPS = {"EXT1", "EXT2", "EXT4"}


class _Global(str):
    """A global's "module.name" on the scan's model of the pickle stack."""


class _Str(str):
    """A string constant on the scan's model of the pickle stack."""


class _Computed:
    """A value some call made (its origin, for the message); None on the stack is any other value."""

    def __init__(self, what: str) -> None:
        self.what = what


_MARK = object()
_CALLS = frozenset({"REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ"})  # opcodes that call (or construct) what they pop first


def scan(data: bytes, *, max_ops: int = 50_000_000) -> ScanResult:
    """Every global a pickle names and which of them are not allowed; never imports or calls anything.
    Follows the pickle's stack (with pickletools' opcode table: what each opcode pops and pushes) far
    enough to know what each REDUCE calls with which arguments, for `CHECKED_CALLS`."""
    names: list[str] = []
    seen: set[str] = set()
    refused: list[str] = []
    memo: dict[int, object] = {}
    stack: list[object] = []
    problem = None

    def note(module: object, name: object) -> object:
        if not isinstance(module, str) or not isinstance(name, str):
            refused.append("<a global whose name is computed>")
            return None
        if (module, name) in _compat_pickle.NAME_MAPPING:  # what pickle's fix_imports does for protocols < 3
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        full = f"{module}.{name}"
        if full not in seen:
            seen.add(full)
            names.append(full)
            if not is_allowed(module, name) and full not in CHECKED_CALLS:
                refused.append(full)
        return _Global(full)

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

    def consumed(values: list[object], ok_callable: object = None) -> None:
        """A checked global taken off the stack by anything but its own checked call is refused."""
        for v in values:
            items = v if isinstance(v, (list, tuple)) else (v,)
            for x in items:
                if isinstance(x, _Global) and x in CHECKED_CALLS and x is not ok_callable:
                    refused.append(f"{x} used other than as getattr(<class>, 'MEMBER')")

    def checked_call(fn: _Global, args: object) -> object:
        """getattr's two allowed forms (see CHECKED_CALLS); what it pushes."""
        if isinstance(args, tuple) and len(args) == 2 and isinstance(args[1], _Str):
            obj, name = args
            if isinstance(obj, _Global) and is_allowed(*obj.rsplit(".", 1)) and _MEMBER_NAME.match(name):
                return None  # an enum member
            if _ATTR_NAME.match(name) and not (isinstance(obj, _Global) and obj in CHECKED_CALLS):
                return _Computed(f"getattr(..., {str(name)!r})")  # a bound method or attribute: never callable here
        shown = (f"getattr({args[0] if isinstance(args[0], str) else '<object>'}, {args[1]!r})"
                 if isinstance(args, tuple) and len(args) == 2 else "getattr(<computed arguments>)")
        refused.append(f"{fn} call {shown}: only getattr(<class>, 'MEMBER') and getattr(<object>, 'name') are allowed")
        return None

    try:
        for n, (op, arg, _pos) in enumerate(pickletools.genops(io.BytesIO(data))):
            if n > max_ops:
                problem = f"more than {max_ops} pickle opcodes"
                break
            opname = op.name
            if opname in ("FRAME", "PROTO"):
                continue
            if opname == "STOP":
                break
            if opname in _REFUSED_OPS:
                refused.append(f"<copyreg extension code {arg}>")
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
            elif opname == "GLOBAL":
                module, _, name = str(arg).partition(" ")
                stack.append(note(module, name))
            elif opname == "INST":  # calls the class with the mark's slice
                module, _, name = str(arg).partition(" ")
                consumed(args)
                note(module, name)
                stack.append(None)
            elif opname == "STACK_GLOBAL":
                module, name = args if len(args) == 2 else (None, None)
                stack.append(note(module, name))
            elif opname in ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_TUPLE"):
                items = args[-1] if opname == "TUPLE" else args
                consumed(items)
                stack.append(tuple(items))
            elif opname in _CALLS:
                fn = args[0] if args else None
                if opname == "OBJ":  # MARK cls args... OBJ: the class is the first of the mark's slice
                    fn = args[-1][0] if args and args[-1] else None
                fargs = args[1] if opname == "REDUCE" and len(args) == 2 else None
                if isinstance(fn, _Global) and fn in CHECKED_CALLS and opname == "REDUCE":
                    result = checked_call(fn, fargs)
                    consumed([fargs])
                    stack.append(result)
                    continue
                if not isinstance(fn, _Global):
                    what = fn.what if isinstance(fn, _Computed) else "a computed object"
                    refused.append(f"<a call of {what}: only named, allowed globals may be called>")
                consumed(args)
                stack.append(None)
            elif opname == "DUP":
                stack.extend(args * 2)
            else:
                consumed(args)
                stack.extend(None for _ in op.stack_after)
    except Exception as e:  # noqa: BLE001 - genops raises ValueError and friends on malformed input
        problem = f"not a valid pickle ({type(e).__name__}: {str(e)[:120]})"
    return ScanResult(tuple(names), tuple(dict.fromkeys(refused)), problem)


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
