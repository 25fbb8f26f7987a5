"""Check a pickle without running it: which globals would `pickle.loads` import and call?

A pickle is a program for a small stack machine: its GLOBAL / STACK_GLOBAL instructions import any
`module.name` and REDUCE / BUILD / NEWOBJ call it. So `pickle.loads` of a file from elsewhere runs
whatever its author chose (`os.system`, `subprocess.Popen`, ...). `scan` reads the opcodes with
`pickletools.genops` (a parser: it never imports or calls anything) and checks every global the
pickle names against `ALLOWED_GLOBALS` (exact names) and `CLASS_MODULES` (data classes of torch's
cache modules): what torch's inductor caches really use, collected by compiling models on CPU with
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
})
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


def scan(data: bytes, *, max_ops: int = 50_000_000) -> ScanResult:
    """Every global a pickle names and which of them are not allowed; never imports or calls anything."""
    names: list[str] = []
    seen: set[str] = set()
    refused: list[str] = []
    memo: dict[int, object] = {}
    memo_next = 0
    last: list[object] = []  # values the last few opcodes pushed (strings; None for anything else)
    problem = None

    def note(module: object, name: object) -> None:
        if not isinstance(module, str) or not isinstance(name, str):
            refused.append("<a global whose name is computed>")
            return
        if (module, name) in _compat_pickle.NAME_MAPPING:  # what pickle's fix_imports does for protocols < 3
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        full = f"{module}.{name}"
        if full not in seen:
            seen.add(full)
            names.append(full)
            if not is_allowed(module, name):
                refused.append(full)

    try:
        for n, (op, arg, _pos) in enumerate(pickletools.genops(io.BytesIO(data))):
            if n > max_ops:
                problem = f"more than {max_ops} pickle opcodes"
                break
            opname = op.name
            if opname in _STRING_OPS:
                last.append(arg if isinstance(arg, str) else arg.decode("latin-1") if isinstance(arg, bytes) else None)
            elif opname == "MEMOIZE":
                memo[memo_next] = last[-1] if last else None
                memo_next += 1
            elif opname in _MEMO_PUT:
                memo[int(arg)] = last[-1] if last else None
            elif opname in _MEMO_GET:
                last.append(memo.get(int(arg)))
            elif opname == "GLOBAL" or opname == "INST":
                module, _, name = str(arg).partition(" ")
                note(module, name)
                last.append(None)
            elif opname == "STACK_GLOBAL":
                module, name = (last[-2], last[-1]) if len(last) >= 2 else (None, None)
                note(module, name)
                last.append(None)
            elif opname in _REFUSED_OPS:
                refused.append(f"<copyreg extension code {arg}>")
                last.append(None)
            elif opname in ("FRAME", "PROTO"):
                pass
            else:
                last.append(None)
            if len(last) > 8:
                del last[:-4]
            if opname == "STOP":
                break
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
