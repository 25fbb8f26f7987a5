"""Check a pickle without running it: which globals would `pickle.loads` import and call?

A pickle is a program for a small stack machine; its GLOBAL / STACK_GLOBAL instructions import any
`module.name` and REDUCE / BUILD / NEWOBJ call it. So `pickle.loads` of a file from elsewhere runs
whatever the file's author chose (`os.system`, `subprocess.Popen`, ...). `scan` reads the opcodes with
`pickletools.genops` (a parser: it never imports or calls anything) and compares every global the
pickle names with `ALLOWED`: the globals torch's inductor caches really use, collected by compiling
models on CPU with torch 2.11, 2.13 and 2.15 and scanning every fxgraph / aotautograd entry
(`tests/test_picklescan.py` re-derives them from a fresh cache, so a new torch that needs a new one
fails a test instead of a user's load).

What it does not prove: that the allowed classes cannot be misused, and that the generated code an
fxgraph entry carries (Python and C++ source, kernels) is harmless: torch imports that code on every
cache hit. A cache archive is code; load only archives from people you trust (docs/security.md).
"""

from __future__ import annotations

import io
import pickletools
from dataclasses import dataclass

# module -> names, or "*" for every name of a module that holds only data classes (no callables that
# touch the system). Exact names everywhere else.
ALLOWED: dict[str, frozenset[str] | str] = {
    "builtins": frozenset({"set", "frozenset", "slice", "complex", "bytearray", "range", "object", "tuple",
                           "list", "dict", "int", "float", "bool", "str", "bytes", "NotImplemented",
                           "Ellipsis"}),
    "collections": frozenset({"OrderedDict", "defaultdict", "deque", "Counter"}),
    "copyreg": frozenset({"_reconstructor"}),
    "enum": frozenset({"Enum", "IntEnum"}),
    "functools": frozenset({"partial"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "Path"}),
    "_codecs": frozenset({"encode"}),
    "torch": frozenset({"device", "dtype", "Size", "float32", "float64", "float16", "bfloat16", "int64",
                        "int32", "int16", "int8", "uint8", "bool", "complex64", "complex128", "layout",
                        "memory_format", "strided", "sparse_coo", "contiguous_format", "channels_last",
                        "preserve_format", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64",
                        "SymInt", "SymFloat", "SymBool", "Generator"}),
    "torch._utils": frozenset({"_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
                               "_rebuild_device_tensor_from_numpy", "_rebuild_meta_tensor_no_storage",
                               "_rebuild_wrapper_subclass"}),
    "torch.storage": frozenset({"_load_from_bytes"}),
}
# Module prefixes whose every name is allowed: inductor / AOTAutograd / dynamo data classes and
# sympy expressions (what cache entries are made of). Kept to the packages torch's own cache
# entries use; see the module docstring for what that does and does not prove.
ALLOWED_PREFIXES: tuple[str, ...] = (
    "torch._inductor.",
    "torch._functorch.",
    "torch._subclasses.",
    "torch._guards",
    "torch._dynamo.",
    "torch.fx.experimental.symbolic_shapes",
    "torch.fx.experimental._constant_symnode",
    "torch.utils._sympy.",
    "torch.utils._ordered_set",
    "torch._library.",
    "torch._higher_order_ops.",
    "torch._prims_common",
    "torch._export.",
    "torch.export.",
    "torch._ops",
    "torch.types",
    "sympy.",
)


@dataclass(frozen=True, slots=True)
class ScanResult:
    globals: tuple[str, ...]  # every "module.name" the pickle names, in order of first use
    refused: tuple[str, ...]  # the ones not allowed
    problem: str | None  # the pickle is malformed, or uses an opcode this check refuses


def is_allowed(module: str, name: str) -> bool:
    names = ALLOWED.get(module)
    if names == "*":
        return True
    if names is not None and name in names:
        return True
    if "__" in name.replace("__reduce_ex__", ""):  # dunder lookups (`__globals__`, `__builtins__`)
        return module.startswith(ALLOWED_PREFIXES) and name == "__new__"
    return module.startswith(ALLOWED_PREFIXES) or module in {p.rstrip(".") for p in ALLOWED_PREFIXES}


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
