"""Which globals a pickle from torch's caches may name, and what each name IS.

`picklescan` follows a pickle's stack; this module answers its questions about names: is
`module.name` allowed (listed exactly in `ALLOWED_GLOBALS`, or a class defined in a data module of
`CLASS_MODULES`), what does it resolve to (imported only from the modules these lists name), is that
object dangerous by identity (`danger_of`: evaluates strings, executes source, loads native code,
runs commands, imports or unpickles), and do a class's `__new__`/`__init__`/`__setstate__` only
store. The lists are what torch's caches really use (see `picklescan`'s docstring for how they were
collected and how CI keeps them honest).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import re
import sys

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
    # rebuilds an FX GraphModule by running its Python source: an AOTAutograd entry keeps it as a
    # value (SerializedGraphModule.fn) that torch calls after loading; it is never called by a pickle
    # (CALLABLE_GLOBALS), which is one reason a cache is code (module docstring)
    "torch.fx.graph_module.reduce_graph_module",
    # the tracer class a GraphModule body names (`_tracer_cls`; reduce_graph_module subclasses it to
    # re-trace): compiled flex_attention's AOTAutograd entries on CUDA (torch 2.11, H200, issue 16)
    "torch.fx.experimental.proxy_tensor.PythonKeyTracer",
    "torch.fx._symbolic_trace.Tracer",
    # a CUDA fxgraph entry's statically launched Triton kernels (torch 2.11, H200: the triton bundler's
    # "static autotuners"): the kernel objects and their signatures, as data
    "triton.runtime.jit.JITFunction", "triton.runtime.jit.KernelParam", "triton.runtime.autotuner.Config",
    "triton.language.core.constexpr",
    "inspect.Signature", "inspect.Parameter", "inspect._ParameterKind", "inspect._empty",
    # an AutotuneCache's `artifact_recorder` (2.13, 2.15: what torch pickles with every autotuner's cache);
    # its key and type are checked (`paths`): torch records best configs under them for the Mega-Cache
    "torch.compiler._cache.CacheArtifactRecorder",
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
    "torch._dynamo.pgo",  # dynamo/code_state_*.pkl: PGO's CodeState, CodeId, FrameStateSizeEntry, ...
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


# modules the scanner imports to see what a name IS (only these: naming a module makes nothing import)
_KNOWN_MODULES: frozenset[str] = frozenset(
    {n.rsplit(".", 1)[0] for n in ALLOWED_GLOBALS} | {"torch", "torch._utils", "torch._tensor", "torch.storage"})


# --- what an object IS ----------------------------------------------------------------------------
# Callables that evaluate strings, execute source, load native code, run commands, import or unpickle,
# by identity: refused wherever a pickle names them from (`torch._inductor.codecache.CDLL` is
# `ctypes.CDLL`), even as a value nothing in the pickle calls (torch may call a stored value later).
_DANGEROUS_NAMES: dict[str, tuple[str, ...]] = {
    "evaluates strings": ("builtins.eval", "builtins.exec", "builtins.compile", "sympy.sympify",
                          "sympy.core.sympify.sympify", "sympy.parsing.sympy_parser.parse_expr",
                          "sympy.parsing.sympy_parser.eval_expr"),
    "executes source": ("torch.fx.graph_module._forward_from_src", "torch.fx.graph_module._method_from_src",
                        "torch.fx.graph_module._exec_with_source", "torch._inductor.codecache.PyCodeCache"),
    "loads native code": ("ctypes.CDLL", "ctypes.PyDLL", "ctypes.LibraryLoader", "ctypes.cdll", "ctypes.pydll",
                          "torch._inductor.codecache.DLLWrapper", "torch.ops.load_library"),
    "runs commands": ("os.system", "os.popen", "os.execv", "os.execve", "os.spawnv", "subprocess.Popen",
                      "subprocess.run", "subprocess.call", "subprocess.check_call", "subprocess.check_output",
                      "subprocess.getoutput", "pty.spawn"),
    "imports modules": ("builtins.__import__", "importlib.import_module"),
    "unpickles": ("pickle.loads", "pickle.load", "_pickle.loads", "_pickle.load", "marshal.loads", "torch.load"),
    "opens files or sets attributes": ("builtins.setattr", "builtins.delattr", "builtins.globals", "builtins.vars", "builtins.open"),
}


# Classes whose construction or restoring is the danger whatever the arguments (and their subclasses).
_DANGEROUS_BASES = ("ctypes.CDLL", "ctypes.LibraryLoader", "subprocess.Popen", "threading.Thread")


# Functions a pickle may call (REDUCE) besides classes: the rest of ALLOWED_GLOBALS are values only.
CALLABLE_GLOBALS: frozenset[str] = frozenset({
    "copyreg._reconstructor", "functools.partial", "_codecs.encode",
    "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3", "torch._utils._rebuild_parameter",
    "torch._tensor._rebuild_from_type_v2", "torch.storage._load_from_bytes",
    "torch._inductor.decomposition.select_decomp_table",
    "torch.fx.graph_module.reduce_graph_module",  # executes body["_code"]: admitted only when FX-shaped (fxsource)
})


# Classes a pickle may call (REDUCE runs `__init__`) although their `__init__` is their own: audited,
# they only store their arguments. (A class whose `__init__` is object's, a dataclass's generated one
# or an enum lookup needs no entry; `_init_is_data`.)
CALLABLE_CLASSES: frozenset[str] = frozenset({
    "torch.utils._ordered_set.OrderedSet",  # __reduce__ = (OrderedSet, (list,)): dict.fromkeys
    "torch.Size", "torch.device",
    "inspect.Signature", "inspect.Parameter",
})


_MISSING = object()
# what each name resolved to, the dangerous objects by id, and each global's verdict: computed once
_resolved: dict[str, object] = {}
_dangerous: dict[int, str] | None = None
_keep: list[int] = []
_callable_class_ids: set[int] | None = None
_verdicts: dict[str, str | None] = {}


def _import_attr(full: str) -> object:
    """The object `full` names, importing its module only when it is one compilewatch knows
    (`_resolvable_module`), or _MISSING."""
    if full in _resolved:
        return _resolved[full]
    obj: object = _MISSING
    parts = full.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        if not _resolvable_module(module):
            continue
        try:
            found = importlib.import_module(module)
        except Exception:  # noqa: BLE001 - not a module (a dotted attribute), or not importable here
            continue
        try:
            for p in parts[i:]:
                found = getattr(found, p)
            obj = found
        except Exception:  # noqa: BLE001 - no such attribute: pickle.loads would fail on it too
            pass
        break
    _resolved[full] = obj
    return obj


def _resolvable_module(module: str) -> bool:
    return module in CLASS_MODULES or module in _KNOWN_MODULES


def _dangerous_ids() -> dict[int, str]:
    global _dangerous
    if _dangerous is None:
        d: dict[int, str] = {}
        for why, names in _DANGEROUS_NAMES.items():
            for n in names:
                obj = _import_dangerous(n)
                if obj is not _MISSING:
                    d.setdefault(id(obj), f"{why} (it is {n})")
        _keep.extend(d)  # ids stay valid: the objects are module attributes, alive for the process
        _dangerous = d
    return _dangerous


def _is_callable_class(cls: type) -> bool:
    global _callable_class_ids
    if _callable_class_ids is None:
        _callable_class_ids = {id(o) for o in map(_import_attr, CALLABLE_CLASSES) if o is not _MISSING}
    return id(cls) in _callable_class_ids


def _import_dangerous(full: str) -> object:
    parts = full.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:  # noqa: BLE001
            continue
        try:
            for p in parts[i:]:
                obj = getattr(obj, p)
            return obj
        except AttributeError:
            return _MISSING
    return _MISSING


def danger_of(obj: object) -> str | None:
    """Why `obj` must never be reached from a pickle (None: nothing known against it)."""
    why = _dangerous_ids().get(id(obj))
    if why:
        return why
    if isinstance(obj, type):
        for base in _DANGEROUS_BASES:
            b = _import_dangerous(base)
            if isinstance(b, type) and issubclass(obj, b):
                return f"{'loads native code' if base.startswith('ctypes') else 'runs code'} (a subclass of {base})"
    if type(obj).__module__ == "ctypes" or (type(obj).__name__ == "LibraryLoader"):
        return "loads native code (a ctypes library loader)"
    return None


def _is_sympy(cls: object) -> bool:
    mod = sys.modules.get("sympy")
    return mod is not None and isinstance(cls, type) and issubclass(cls, mod.Basic)


def _owner(cls: type, attr: str) -> type | None:
    for k in cls.__mro__:
        if attr in vars(k):
            return k
    return None


def _builtin_owner(k: type | None) -> bool:
    return k is None or k.__module__ in ("builtins", "enum", "collections") or k.__module__.startswith("torch._C")


def _new_is_data(cls: type) -> bool:
    """`cls.__new__` (what NEWOBJ runs) only makes an instance: object's, a builtin's, an enum lookup,
    a namedtuple's, torch's tensor base."""
    if isinstance(cls, enum.EnumMeta):  # Enum.__new__: a lookup of an existing member by value
        return True
    k = _owner(cls, "__new__")
    if _builtin_owner(k):
        return True
    return issubclass(cls, tuple) and hasattr(cls, "_fields")  # namedtuple: tuple.__new__ of its fields


def _init_is_data(cls: type) -> bool:
    """`cls.__init__` (what a REDUCE of the class runs too) only stores: object's, a builtin's, an
    enum's, a dataclass's generated one without __post_init__, or audited (CALLABLE_CLASSES)."""
    if _is_callable_class(cls) or isinstance(cls, enum.EnumMeta):
        return True
    k = _owner(cls, "__init__")
    if _builtin_owner(k):
        return True
    init = vars(k)["__init__"]
    generated = dataclasses.is_dataclass(k) and getattr(getattr(init, "__code__", None), "co_filename", "") == "<string>"
    # a __post_init__ is the class's own code: allowed for torch's data modules, whose __post_init__s
    # were read (torch 2.11, 2.13, 2.15): asserts and field normalisation, nothing that evaluates, loads or runs
    post = _owner(cls, "__post_init__")
    return generated and (post is None or (post.__module__ in CLASS_MODULES
                                           and f"{post.__module__}.{post.__qualname__}" not in POST_INIT_RUNS))


# __post_init__s of those modules that load or write (session 16): CompiledAOTI's, under
# `config.enable_autograd_for_aot`, loads its `filename` as an AOTInductor .so (a runner dlopens it) and
# writes each of its `_cached_files` to the path it names. torch pickles it by its state (NEWOBJ, BUILD:
# no __post_init__); called by a pickle (REDUCE), it is refused.
POST_INIT_RUNS: frozenset[str] = frozenset({"torch._inductor.output_code.CompiledAOTI"})


# `__setstate__`s outside torch that a real CUDA inductor cache runs (fxgraph entries of compiled flex
# attention, torch 2.11 + triton 3.6 on an H200, benchmarks/gpu_cache_trust.py), audited: each only
# assigns its state's values to attributes (inspect 3.10-3.13; triton 3.6-3.9's autotuner.Config, the
# base of inductor's InductorConfig). Without them `cache verify` called every real CUDA cache untrusted.
AUDITED_SETSTATE: frozenset[str] = frozenset({
    "inspect.Parameter", "inspect.Signature", "triton.runtime.autotuner.Config",
})


# constructors that keep a class they are given without calling it (audited: inspect 3.10-3.13 validates
# parameters by their kind and name, and stores annotations): a CUDA entry's kernel signatures hold
# triton's `constexpr` class as annotations
STORING_CONSTRUCTORS = frozenset({"inspect.Signature", "inspect.Parameter"})


def _setstate_is_data(cls: type) -> bool:
    """BUILD on an instance of `cls` runs its `__setstate__` if it has one: allowed when that is a
    builtin's or torch's / sympy's own restore of its data class, or audited (`AUDITED_SETSTATE`):
    `__dict__` updates and attribute assignments only."""
    k = _owner(cls, "__setstate__")
    return _builtin_owner(k) or k.__module__ in CLASS_MODULES or k.__module__.startswith("sympy.") \
        or k.__module__ in ("torch._tensor", "torch.nn.parameter") \
        or f"{k.__module__}.{k.__qualname__}" in AUDITED_SETSTATE


def is_allowed(module: str, name: str) -> bool:
    """May a pickle name `module.name`? Exact allowed names, or a class *defined* in a data module,
    and in both cases not something `danger_of` knows (the object is resolved and compared by
    identity, so a re-export does not pass). A dotted name (`Class.method`) must be listed exactly."""
    return _why_refused(module, name) is None


def _why_refused(module: str, name: str) -> str | None:
    full = f"{module}.{name}"
    if full not in _verdicts:
        _verdicts[full] = _judge_global(module, name, full)
    return _verdicts[full]


def _judge_global(module: str, name: str, full: str) -> str | None:
    obj = _import_attr(full)  # imports only modules the lists name
    why = danger_of(obj) if obj is not _MISSING else None
    if why:
        return why
    by_name = full in ALLOWED_GLOBALS or (module in CLASS_MODULES and "." not in name and bool(_CLASS_NAME.match(name)))
    if not by_name:
        return "not used by torch's caches"
    if obj is _MISSING:
        return None  # not importable here: pickle.loads could not import it either
    if full not in ALLOWED_GLOBALS and not (isinstance(obj, type) and obj.__module__ in CLASS_MODULES):
        return f"not a class defined in {module}" + (f" (it is {type(obj).__name__} from {getattr(obj, '__module__', '?')})")
    return None
