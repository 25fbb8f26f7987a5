"""The values on `picklescan`'s model of a pickle's stack, and what the pickle may do to each.

pickle's BUILD, SETITEM(S), APPEND(S) and ADDITEMS act on whatever object is on the stack: BUILD
does `setattr` (its slot state) or a `__dict__` update, or calls the object's `__setstate__`;
APPENDS calls the object's `extend` / `append`, ADDITEMS its `add`. So each value here says what it
is and who made it, and a mutation is admitted only on an instance or container *this pickle made*
through an allowed construct (`fresh`): never on a class, a function, a module attribute, an enum
member, a sympy object (cached, shared) or the result of a call (`_Value`). A value is one of:

- `_Global` (a named global), `_Str` / `_Bytes` / `_NUM` (constants): never mutated;
- `_Seq` (a tuple), `_FSet` (a frozenset): immutable; `_List`, `_Dict`, `_Set`: containers the
  pickle made, mutable; `_Obj`: an instance a constructor made (`fresh` when it is new and unshared);
- `_Value`: what a call returned, by the callee's declared result (a tensor, a storage, a graph
  module, an enum member, bytes) or else `opaque`, which nothing may call, build, mutate or hand to
  something that calls it.

Every aggregate is a node with `live`: the first reason it (transitively) holds something that runs
code when called, iterated, hashed or printed (a function, a class whose construction runs its own
code, an opaque value, an instance whose class has its own protocol methods). The flag propagates to
every container holding the node, also when the node changes after it was put there (each node
flips once, so this stays linear). It decides where a value may go: the arguments of a constructor
that runs code on them, a dict key (hashed), the body of a graph module FX re-traces.
"""

from __future__ import annotations

import dataclasses
import enum
import sys

from compilewatch.cache.trust import fxbounds, fxsource
from compilewatch.cache.trust.allowlist import (
    _MISSING,
    _builtin_owner,
    _import_attr,
    _init_is_data,
    _is_callable_class,
    _is_sympy,
    _new_is_data,
    _owner,
    _setstate_is_data,
)


class _Global(str):
    """A global's "module.name": an object the pickle did not make."""


class _Str(str):
    """A string constant."""


class _Bytes(bytes):
    """A bytes constant."""


class _Num:
    """An int, float, bool or None constant, and its value (`loadcost` hashes it)."""

    __slots__ = ("value", "h")

    def __init__(self, value: object = 0) -> None:
        self.value, self.h = value, hash(value)  # an int's hash costs its length: once


_NUM = _Num()  # a number whose value nothing needs
_NONE = _Num(None)


class _Node:
    """A value the pickle assembled: `live` (why it may run code, or None) and who holds it."""

    # `n`, `icost`, `idepth`, `h`, `chains`: what `loadcost` knows of its items (their count; what hashing
    # them costs and how deep it recurses; a tuple's or a field-hashed instance's own hash; how many share
    # one hash); `held`: something holds it (an instance restored after that changes a holder's hash)
    __slots__ = ("live", "parents", "n", "icost", "idepth", "h", "chains", "held")

    def __init__(self) -> None:
        self.live: str | None = None
        self.parents: list[_Node] | None = None
        self.n = self.icost = self.idepth = 0
        self.h: object = None
        self.chains: dict[object, int] | None = None
        self.held = False

    def hold(self, v: object) -> None:
        if isinstance(v, _Node):
            v.held = True
        why = live_of(v)
        if why:
            self.mark(why)
        if isinstance(v, _Node) and not strong(v.live) and not strong(self.live):
            if v.parents is None:  # v may turn (more) live later: tell self then
                v.parents = []
            v.parents.append(self)

    def mark(self, why: str) -> None:
        """`why` reaches this node and every node holding it; a strong reason replaces a weak one (a
        node changes at most twice, so marking stays linear)."""
        todo: list[_Node] = [self]
        while todo:
            n = todo.pop()
            if n.live is None or (strong(why) and not strong(n.live)):
                n.live = why
                if n.parents:
                    todo.extend(n.parents)
                if strong(why):
                    n.parents = None


def strong(why: str | None) -> bool:
    """A live reason other than a class reference (which runs code only when called: a constructor
    that only stores its arguments may keep one, `inspect.Signature(return_annotation=constexpr)`)."""
    return why is not None and not why.startswith("the class ")


class _Seq(_Node):
    """A tuple the pickle built, with what its items are, computed once when it is built (so
    consuming a tuple fetched from the memo a million times costs nothing per fetch)."""

    __slots__ = ("items", "checked", "sympy_ok", "sympy_tail_ok", "literal", "mutable")

    def __init__(self, items: list[object]) -> None:
        super().__init__()
        self.items = items
        self.checked = any((isinstance(x, _Global) and x == _CHECKED) or (isinstance(x, _Seq) and x.checked) for x in items)
        self.sympy_tail_ok = all(_sympy_arg_ok(x) for x in items[1:])
        self.sympy_ok = self.sympy_tail_ok and (not items or _sympy_arg_ok(items[0]))
        self.literal = all(isinstance(x, (_Num, _Str)) for x in items)  # numbers and strings only
        self.mutable = False  # holds a list, dict or set, at any depth (walking it costs more than hashing it)
        for x in items:
            k = type(x)
            if k is _List or k is _Dict or k is _Set or (k is _Seq and x.mutable) or (
                    k is _Obj and issubclass(x.cls, (list, dict, set))):
                self.mutable = True
                break
        for x in items:
            self.hold(x)


class _FSet(_Node):
    """A frozenset the pickle built (its items were hashed)."""

    __slots__ = ()


class _List(_Node):
    __slots__ = ()


class _Set(_Node):
    __slots__ = ()


# pickle looks these up on an instance (BUILD, APPENDS, ADDITEMS): an instance attribute of that name
# is what it calls. Never a key of a BUILD state (with dunders).
_PROTOCOL_ATTRS = frozenset({"append", "extend", "add"})
# names builtins and torch's own restores look up on an instance and call: dict.update / dict() / `**` call
# its `keys` (CachingAutotuner.__setstate__ is `self.__dict__.update(state)`), Counter.update a mapping's
# `items`, and CachingAutotuner.__setstate__ calls `inductor_meta.get(...)`. Under these names a BUILD
# state (either kind of restore) may keep data only: never a global, a call's result or a live instance
_LOOKED_UP_ATTRS = frozenset({"keys", "get", "items", "values"})  # values: a launcher's __del__ (session 15)
# dunder attributes that are data on an instance, never looked up by a protocol (triton's JITFunction
# keeps these in its state on CUDA): allowed as BUILD keys, their values checked like any other's
_DATA_DUNDERS = frozenset({"__doc__", "__name__", "__qualname__", "__module__", "__globals__"})
# keys of a state whose values torch's restores act on (`build`): AutotuneCache's `remote_cache` makes it
# build a Redis client; CachingAutotuner's `inductor_meta["incremental_autotune"]` makes it import a plugin;
# what torch later makes a path of (`paths`: a local_cache, a launcher's name and hash, a compile_meta's device)
_WATCHED = frozenset({"remote_cache", "inductor_meta", "incremental_autotune", "kernel", "metadata", "packed_metadata",
                      "module", "modules", "function", "functions", "local_cache", "compile_meta", "device", "name",
                      "hash", "artifact_type", "key", "cache_key", "filename", "payload", "kernel_hash",
                      "artifacts", "_reload_kernel", "_cached_launcher", "save_cache_hook", "launchers", "__name__"})
# classes whose own `__del__` (run as the load lets go of an instance) uses its state, and the keys it reads:
# StaticallyLaunchedTritonKernel.close() calls `self.C_impl._unload_kernel(m)` for `self.module` and (2.15)
# each of `self.modules.values()`. torch pickles them None and {} (its __getstate__); so must a pickle.
_FINALIZED = {"torch._inductor.runtime.static_triton_launcher.StaticallyLaunchedTritonKernel":
              ("module", "modules", "function", "functions")}
FINALIZER = "<a __del__'s dict>"  # how `build` hands picklescan a dict to check again at STOP (still empty)


class _Dict(_Node):
    """A dict the pickle built: what `reduce_graph_module` reads of it (its source, tracer class and
    extras), whether every key is a plain string, and the first value a BUILD may not store."""

    __slots__ = ("code", "tracer", "extras", "str_keys", "bad_attr", "graph_fn", "args", "called", "named",
                 "vcost", "vdepth", "vrandom", "vn", "objects")

    def __init__(self) -> None:
        super().__init__()
        self.named: dict[str, object] | None = None  # the values of the keys `build` asks about (_WATCHED)
        # (key, value) of each value an attribute lookup could reach code through: a global, a call's result,
        # an instance the pickle may still restore (`build`: never over a method or a cached_property)
        self.objects: list[tuple[str, object]] | None = None
        # what `loadcost` knows of its values: what hashing them costs (an instance restored from this
        # dict is hashed by them), how deep, whether one's hash is random, and their own items' count
        self.vcost = self.vdepth = self.vn = 0
        self.vrandom = False
        self.code: object = None
        self.tracer: object = None
        self.extras: object = None
        self.str_keys = True
        self.bad_attr: str | None = None
        self.graph_fn = False  # {"fn": reduce_graph_module, "args": ...}: a SerializedGraphModule's state
        self.args: object = None
        self.called: str | None = None  # a value under a name builtins and torch's restores call (_LOOKED_UP_ATTRS)

    def set(self, key: object, value: object) -> None:
        if isinstance(key, _Str):
            if key in ("_code", "code") and (key == "_code" or self.code is None):
                self.code = value
            if key == "args":
                self.args = value
            if key in _WATCHED:
                self.named = self.named or {}
                self.named[str(key)] = value
            if isinstance(value, _Global) or (isinstance(value, _Value) and value.kind != "member") or (
                    isinstance(value, _Obj) and value.fresh):
                self.objects = self.objects or []
                self.objects.append((str(key), value))
            if key in _LOOKED_UP_ATTRS and self.called is None and (
                    isinstance(value, (_Global, _Value)) or (isinstance(value, _Obj) and value.live)):
                self.called = f"{describe(value)} as {key!r}"
            if key.startswith("__") and key not in _DATA_DUNDERS or key in _PROTOCOL_ATTRS:
                self.bad_attr = self.bad_attr or f"a {key!r} key"
            elif key == "fn" and value == _RGM and isinstance(value, _Global):
                self.graph_fn = True  # checked as the graph it rebuilds (`build`)
            elif self.bad_attr is None:
                why = attr_value_refused(value)
                if why:
                    self.bad_attr = f"{why} as {key!r}"
        else:
            self.str_keys = False
        self.hold(key)
        if key == "_tracer_cls" and isinstance(key, _Str):  # reduce_graph_module checks it by name
            self.tracer = value
            return
        if key == "_tracer_extras" and isinstance(key, _Str):
            self.extras = value
        self.hold(value)


class _Obj(_Node):
    """An instance a constructor made, and its class. `fresh`: a new object nothing else holds (built
    by a data `__new__`), which the pickle may restore once (BUILD) and fill if it is a container."""

    __slots__ = ("cls", "fresh", "built")

    def __init__(self, cls: type, fresh: bool) -> None:
        super().__init__()
        self.cls, self.fresh, self.built = cls, fresh, False
        why = instance_runs_code(cls)
        if why:
            self.mark(why)


class _Value:
    """What a call returned that the pickle did not assemble: `kind` is the callee's declared result
    ("tensor", "storage", "graph module", "member", "opaque"); `what` names its origin."""

    __slots__ = ("kind", "what", "cls")

    def __init__(self, kind: str, what: str, cls: type | None = None) -> None:
        self.kind, self.what, self.cls = kind, what, cls


class _BoundMethod(_Value):
    """getattr(<an instance this pickle made>, 'name'): opaque like every getattr result (never called,
    built or hashed here); the one use allowed beyond storing it is a defaultdict's factory, which a
    CUDA fxgraph entry keeps so (`launcher.create_binder`, torch 2.11 + triton 3.6 on an H200). A
    getattr of a class (`getattr(CppCodeCache, 'load')`) is one with no `cls`. Where one may be kept: `methods`."""

    __slots__ = ("attr",)

    def __init__(self, what: str, cls: type | None, attr: str) -> None:
        super().__init__("opaque", what, cls)
        self.attr = attr


_CHECKED = _Global("builtins.getattr")
_RGM = "torch.fx.graph_module.reduce_graph_module"
_SGM = "torch._functorch._aot_autograd.aot_autograd_result.SerializedGraphModule"
# the tracer classes a GraphModule body names (`_tracer_cls`): FX subclasses and instantiates it
_TRACERS = frozenset({"torch.fx._symbolic_trace.Tracer", "torch.fx.experimental.proxy_tensor.PythonKeyTracer"})  # the one checked call (allowlist.CHECKED_CALLS)


def _sympy_arg_ok(x: object) -> bool:
    """What a sympy constructor may get: numbers, sympy objects and tuples of them. Never a string,
    bytes or any other container: sympify parses strings (with eval) and iterates containers."""
    return isinstance(x, _Num) or (isinstance(x, _Obj) and _is_sympy(x.cls)) or (isinstance(x, _Seq) and x.sympy_ok)


# --- what an object may do when used ----------------------------------------------------------------
# methods of an instance that run when a builtin, pickle or torch merely uses it: calling it, deleting
# it, looking up an attribute. (The other protocol methods of the classes in CLASS_MODULES -- __repr__,
# __hash__, __eq__, __iter__, __index__, ... -- were audited: none calls an instance attribute,
# evaluates, imports, opens or loads; module docstring of picklescan.) An instance that *holds*
# something live is live too (`_Node.hold`): a dataclass's generated methods reach its fields.
_PROTOCOL_DUNDERS = ("__call__", "__del__", "__getattr__", "__getattribute__", "__missing__")
_class_facts: dict[int, tuple[type, str | None, str | None]] = {}


def _generated(fn: object) -> bool:
    """A dataclass's or namedtuple's generated method (it only compares, hashes or shows fields)."""
    return getattr(getattr(fn, "__code__", None), "co_filename", "") == "<string>"


def instance_runs_code(cls: type) -> str | None:
    """Why an instance of `cls` runs its class's own code when a builtin uses it, or None."""
    return _facts(cls)[1]


def class_runs_code(cls: type) -> str | None:
    """Why calling `cls` with arbitrary arguments may run its own code, or None."""
    return _facts(cls)[2]


def _facts(cls: type) -> tuple[type, str | None, str | None]:
    f = _class_facts.get(id(cls))
    if f is None or f[0] is not cls:
        f = (cls, _instance_code(cls), _call_code(cls))
        _class_facts[id(cls)] = f
    return f


def _instance_code(cls: type) -> str | None:
    if _is_sympy(cls):
        return None  # built only from numbers and sympy objects (picklescan's sympy rule)
    for d in _PROTOCOL_DUNDERS:
        k = _owner(cls, d)
        if not _builtin_owner(k) and not _generated(vars(k)[d]):
            return f"an instance of {cls.__module__}.{cls.__qualname__} (its own {d})"
    return None


def _call_code(cls: type) -> str | None:
    name = f"{cls.__module__}.{cls.__qualname__}"
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(cls, torch.Tensor):
        return None  # a tensor type: a marker (`raw_type`), as_subclass' target
    if isinstance(cls, enum.EnumMeta):
        return None  # a lookup of an existing member
    if _is_sympy(cls):
        return f"the class {name} (sympy: its constructor sympifies, and sympify evaluates strings)"
    if not _builtin_owner(_owner(type(cls), "__call__")):
        return f"the class {name} (its metaclass's __call__ runs its own code)"
    if not (_is_callable_class(cls) or (_new_is_data(cls) and _init_is_data(cls))):
        return f"the class {name} (its constructor runs its own code)"
    return None


def fresh_class(cls: type) -> bool:
    """Does constructing `cls` make a new object nothing else holds? Not an enum (a lookup), not
    sympy (cached and singleton instances), not a class whose metaclass's __call__ decides, not an
    immutable builtin."""
    if cls.__module__ == "builtins" and cls not in (list, dict, set, bytearray, object):
        return False  # str, int, tuple, frozenset, ...: immutable, and may hand back a shared object
    return not (isinstance(cls, enum.EnumMeta) or _is_sympy(cls)) and _builtin_owner(_owner(type(cls), "__call__"))


def stores_only(cls: type) -> bool:
    """Construction only stores its arguments (a dataclass's generated `__init__` without
    `__post_init__`, or object's): it calls nothing on them."""
    k = _owner(cls, "__init__")
    if _builtin_owner(k):
        return k is None or k is object
    return dataclasses.is_dataclass(k) and _generated(vars(k)["__init__"]) and _owner(cls, "__post_init__") is None


_global_live: dict[str, str | None] = {}


def live_of(v: object) -> str | None:
    """Why using `v` (calling, iterating, hashing, printing it) may run code nobody checked, or None."""
    if isinstance(v, _Node):
        return v.live
    if isinstance(v, _Global):
        if v not in _global_live:
            _global_live[v] = _live_global(v)
        return _global_live[v]
    if isinstance(v, _Value):
        if v.kind == "opaque":
            return f"{v.what} (a value the scan cannot see)"
        return instance_runs_code(v.cls) if v.cls is not None else None
    return None


def _live_global(name: str) -> str | None:
    if name == _CHECKED:
        return "builtins.getattr"
    obj = _import_attr(name)
    if obj is _MISSING:
        return f"{name} (not importable here)"
    if isinstance(obj, type):
        return class_runs_code(obj)
    if callable(obj):
        return f"the function {name}"
    return None


def attr_value_refused(v: object) -> str | None:
    """Why `v` may not be stored as an instance attribute by BUILD (a function, or a class whose
    construction runs code: whatever later calls the attribute would run it), or None. An opaque
    value (a bound method a CUDA entry keeps) may be stored under a plain name, never called here."""
    if isinstance(v, _Global):
        return live_of(v)
    return None


# --- what the pickle does to a value ----------------------------------------------------------------
def describe(v: object) -> str:
    if isinstance(v, _Global):
        return f"the global {v} (an object this pickle did not make)"
    if isinstance(v, _Value):
        return f"{v.what} (a {v.kind} this pickle did not make)"
    if isinstance(v, _Obj):
        what = f"an instance of {_name(v.cls)}"
        return what if v.fresh else f"{what} that may be shared (cached, a singleton or a member)"
    return {_Seq: "a tuple", _FSet: "a frozenset", _List: "a list", _Set: "a set", _Dict: "a dict"}.get(
        type(v), "a constant" if isinstance(v, (_Str, _Bytes, _Num)) else "a value the scan cannot see")


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _setter_descriptor(cls: type) -> str | None:
    """A class attribute with a `__set__` of its own code (a property's setter): `setattr` runs it."""
    for k in cls.__mro__:
        if _builtin_owner(k):
            continue
        for attr, v in vars(k).items():
            if hasattr(type(v), "__set__") and type(v).__name__ not in ("member_descriptor", "getset_descriptor"):
                return attr
    return None


def _shadowed(cls: type, key: str) -> str | None:
    """What of `cls` an instance attribute `key` would hide from torch's code: a method, a classmethod or
    staticmethod, a cached_property (a non-data descriptor), or None (nothing, or a data descriptor)."""
    for k in cls.__mro__:
        if k is object:
            return None
        v = vars(k).get(key, _MISSING)
        if v is not _MISSING:
            if hasattr(type(v), "__set__"):
                return None  # a property or slot: it wins over the instance's __dict__
            if isinstance(v, (classmethod, staticmethod)) or callable(v) or hasattr(type(v), "__get__"):
                return f"{type(v).__name__} {k.__qualname__}.{key}"
            return None
    return None


# what torch itself puts over a method (2.11-2.15 prepare_for_pickle: `fn.repr = _ConstRepr(fn.repr(fn))`, whose
# __call__ returns the string it keeps): every CUDA entry's static autotuner pickles its JITFunction so
_OVERRIDES = {("triton.runtime.jit.JITFunction", "repr"): "torch._inductor.runtime.triton_heuristics._ConstRepr"}


def _hides_code(cls: type, state: object) -> str | None:
    """A state storing, over a method or cached_property of `cls`, something whose attributes the pickle
    chose (an instance it made, a global, a call's result): torch's code then calls what the pickle
    put there. (Session 15: StaticallyLaunchedTritonKernel.__del__, run as the load lets go of it, calls
    `self.C_impl._unload_kernel(self.module)`: a C_impl instance whose `_unload_kernel` was
    `getattr(CppCodeCache(), 'load')` compiled and loaded the pickle's C++ on 2.13 and 2.15.)"""
    for d in (state, *(state.items if isinstance(state, _Seq) else ())):
        for key, value in (d.objects or ()) if isinstance(d, _Dict) else ():
            hidden = _shadowed(cls, key)
            if hidden and not (isinstance(value, _Obj) and _OVERRIDES.get((_name(cls), key)) == _name(value.cls)):
                return f"storing {describe(value)} as {key!r}, over its {hidden}: torch calls what it finds there"
    return None


def build(obj: object, state: object, graphs: list[tuple[object, object]]) -> str | None:
    """Why BUILD(obj, state) is refused, or None (then `obj` holds `state`). A pending graph (a
    SerializedGraphModule's fn and args, which torch calls later) goes to `graphs`, checked at STOP."""
    if not isinstance(obj, _Obj) or not obj.fresh:
        return f"BUILD on {describe(obj)}: only an instance this pickle made may be restored"
    cls, name = obj.cls, _name(obj.cls)
    if obj.built:
        return f"BUILD twice on one instance of {name}"
    obj.built = True
    for d in ("__getattr__", "__getattribute__"):  # BUILD looks up __setstate__ on the instance
        if not _builtin_owner(_owner(cls, d)):
            return f"{name}.{d} runs its own code (BUILD looks the instance up)"
    if not _setstate_is_data(cls):
        return f"{name}.__setstate__ runs its own code (BUILD)"
    if isinstance(state, (_Global, _Value)):
        return f"BUILD of {name} with {describe(state)} as its state"
    called = next((d.called for d in (state, *(state.items if isinstance(state, _Seq) else ()))
                   if isinstance(d, _Dict) and d.called), None)
    if called:
        return f"BUILD of {name} storing {called}: builtins and torch's restores look it up and call it"
    hidden = _hides_code(cls, state)
    if hidden:
        return f"BUILD of {name} {hidden}"
    keys = _FINALIZED.get(_name(_owner(cls, "__del__") or object), ())
    if keys and not (isinstance(state, _Dict) and state.str_keys):
        return f"BUILD of {name} with a state the scan cannot read key by key: its own __del__ reads it"
    named = (state.named or {}) if isinstance(state, _Dict) else {}
    for key in keys:
        v = named.get(key, _NONE)
        if not (v is _NONE or isinstance(v, _Dict)):
            return (f"BUILD of {name} with {describe(v)} as {key!r}: its own __del__ reads it as the load lets go "
                    "of it (only None or an empty dict)")
        if isinstance(v, _Dict):
            graphs.append((v, FINALIZER))  # empty at STOP, or its values are unloaded as CUDA module handles
    if not _builtin_owner(_owner(cls, "__setstate__")):  # an audited or torch's own restore of its data
        if isinstance(state, _Obj):  # `self.__dict__.update(state)` calls the instance's `keys`
            return f"BUILD of {name} with {describe(state)} as its state: its restore looks up the state's methods"
        why = _restore_acts(_name(_owner(cls, "__setstate__")), state)
        if why:
            return f"BUILD of {name} {why}"
        # Its state may hold what torch's own entries keep there (a real CUDA fxgraph entry: triton's
        # JITFunction, constexpr classes, bound methods like `launcher.create_binder` in a defaultdict):
        # these restores assign, they do not call what they store. The class-mutation family stays
        # closed above (BUILD only on an instance this pickle made; no dunder keys on the builtin path).
        obj.hold(state)
        return None
    parts = state.items if isinstance(state, _Seq) and len(state.items) == 2 else [state, None]
    for d, slots in ((parts[0], False), (parts[1], True)):
        if d is None or isinstance(d, _Num):
            continue
        if not isinstance(d, _Dict):
            return f"BUILD of {name} with {describe(d)} as its {'slot ' if slots else ''}state: only a dict"
        if not d.str_keys:
            return f"BUILD of {name} with a state key that is not a string"
        if d.bad_attr:
            return f"BUILD of {name} storing {d.bad_attr}: an instance attribute is looked up and called"
        if d.graph_fn:
            if name != _SGM or slots:
                return f"BUILD of {name} storing {_RGM}: only a SerializedGraphModule keeps it"
            graphs.append((d.args, name))
        if slots:  # setattr(obj, key, value) for each item
            if not _builtin_owner(_owner(cls, "__setattr__")):
                return f"{name}.__setattr__ runs its own code (BUILD's slot state)"
            setter = _setter_descriptor(cls)
            if setter:
                return f"BUILD of {name} with a slot state: {name}.{setter} has a setter of its own code"
    obj.hold(state)
    return None


def _restore_acts(restore: str, state: object) -> str | None:
    """Why a torch restore (`restore` names the class whose `__setstate__` it is) would do more with
    `state` than store it, or None. torch 2.13 / 2.15: AutotuneCache's, given a `remote_cache` key
    that is not None, calls `create_cache(state["remote_cache_full_key"], state["is_fbcode"], ...)`,
    which builds a `RemoteAutotuneCache`: a Redis client (TORCHINDUCTOR_REDIS_URL / _HOST / _PORT, else
    localhost:6379, connected on first use) whose keys are `pt2:<remote_cache_full_key>::...` -- a
    namespace of the pickle's choosing that torch then reads best configs from and writes them to
    (with is_fbcode, it imports torch._inductor.fb.remote_cache). CachingAutotuner's, given
    `inductor_meta["incremental_autotune"]`, imports a plugin module (`.fb.incremental`)."""
    named = (state.named or {}) if isinstance(state, _Dict) else {}
    if restore.endswith(("AutotuneCache", "CachingAutotuner", "TritonCompileResult")) and not (
            isinstance(state, _Dict) and state.str_keys):
        return "with a state the scan cannot read key by key (only a dict of string keys)"
    if restore == "torch._inductor.runtime.triton_heuristics.TritonCompileResult" and "kernel" in named:
        # `state["kernel"]["metadata"]`, `{**state["kernel"], ...}`: only plain dicts, looked up by torch
        kernel = named["kernel"]
        inner = (kernel.named or {}) if isinstance(kernel, _Dict) else {}
        meta = [inner[k] for k in ("metadata", "packed_metadata") if k in inner]
        if not (isinstance(kernel, _Dict) and kernel.str_keys) or any(
                isinstance(v, (_Obj, _Value, _Global, _List, _Set)) for v in meta):
            return "with a kernel state that is not a plain dict (its restore looks it up and copies it)"
    if restore == "torch._inductor.runtime.autotune_cache.AutotuneCache" and named.get("remote_cache", _NONE) is not _NONE:
        return ("with a remote_cache: its __setstate__ builds a RemoteAutotuneCache, a Redis client under a key "
                "of the pickle's choosing that torch reads and writes (only local data may be restored)")
    meta = named.get("inductor_meta")
    if restore == "torch._inductor.runtime.triton_heuristics.CachingAutotuner" and meta is not None:
        flag = (meta.named or {}).get("incremental_autotune", _NONE) if isinstance(meta, _Dict) else None
        if not (isinstance(meta, _Dict) and meta.str_keys and isinstance(flag, _Num) and not flag.value):
            return "with an inductor_meta asking for incremental_autotune: its __setstate__ imports a plugin module"
    return None


def _container_ok(cls: type, opname: str) -> bool:
    """May pickle fill an instance of `cls` this way (builtin methods only)?"""
    if opname in ("SETITEM", "SETITEMS"):
        return issubclass(cls, dict) and _builtin_owner(_owner(cls, "__setitem__"))
    if opname in ("APPEND", "APPENDS"):  # pickle calls extend, else append
        import collections

        return issubclass(cls, (list, collections.deque)) and all(
            _builtin_owner(_owner(cls, m)) for m in ("extend", "append"))
    return issubclass(cls, set) and _builtin_owner(_owner(cls, "add"))  # ADDITEMS


def key_refused(key: object) -> str | None:
    """A dict key or set item is hashed (and compared): why that may run code, or None."""
    return None if isinstance(key, _Global) else live_of(key)


def fill(opname: str, target: object, items: list[object]) -> str | None:
    """Why SETITEM(S) / APPEND(S) / ADDITEMS of `items` (keys and values alternating for SETITEMS)
    into `target` is refused, or None (then `target` holds them)."""
    kind = {"SETITEM": _Dict, "SETITEMS": _Dict, "APPEND": _List, "APPENDS": _List, "ADDITEMS": _Set}[opname]
    ok = isinstance(target, kind) or (isinstance(target, _Obj) and target.fresh and _container_ok(target.cls, opname))
    if not ok:
        return f"{opname} on {describe(target)}: only a container this pickle made may be filled"
    assert isinstance(target, _Node)
    if kind is _Dict:
        if len(items) % 2:
            return f"{opname} with an odd number of items"
        for i in range(0, len(items), 2):
            why = key_refused(items[i])
            if why:
                return f"{opname} with a key whose hashing runs code: {why}"
            if isinstance(target, _Dict):
                target.set(items[i], items[i + 1])
            else:
                target.hold(items[i])
                target.hold(items[i + 1])
        return None
    for x in items:
        why = key_refused(x) if kind is _Set else None
        if why:
            return f"ADDITEMS of an item whose hashing runs code: {why}"
        target.hold(x)
    return None


def graph_body(body: object, block: object) -> str | None:
    """Why `reduce_graph_module(body, block)` may not run (it executes block + body["_code"] and then
    re-traces it with FX, calling what the source calls on `self`, which is `body`), or None."""
    if not isinstance(body, _Dict) or not isinstance(block, _Str) or not isinstance(body.code, _Str):
        return "a source the scan cannot see: it executes that source"
    if not body.str_keys:
        return "a body with a key that is not a string: it executes that source"
    if body.live:
        return f"a body holding {body.live}: the re-traced source may call it"
    tracer = body.tracer
    if not (tracer is None or isinstance(tracer, _Num) or (isinstance(tracer, _Global) and tracer in _TRACERS)):
        return f"a tracer class other than FX's ({describe(tracer)}): FX subclasses and instantiates it"
    if not (body.extras is None or isinstance(body.extras, _Dict)):
        return "tracer extras that are not a dict"
    why = fxsource.check(str(block) + str(body.code))
    if why:
        return f"source that is not an FX graph's ({why}): it executes that source"
    why = fxbounds.check(str(block) + str(body.code))[0]
    return f"{why} (FX re-traces it while it is unpickled)" if why else None


def graph_args(args: object) -> str | None:
    """A SerializedGraphModule's `args`: what torch hands `reduce_graph_module` when it deserializes."""
    items = args.items if isinstance(args, _Seq) else None
    if items is None or len(items) != 2:
        return "arguments the scan cannot see: torch executes the source they hold"
    return graph_body(*items)
