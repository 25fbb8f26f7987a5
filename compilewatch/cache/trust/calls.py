"""What each call a pickle makes may do, and what it returns (`picklescan`'s `_Calls`).

REDUCE / NEWOBJ / NEWOBJ_EX / OBJ / INST call a global with arguments off the stack: a function only
if `CALLABLE_GLOBALS` lists it, a class only if its construction stores (allowlist), each with the
rules its arguments need (sympy's, `_load_from_bytes`', `reduce_graph_module`'s, the tensor
rebuilders'); what it returns is what the callee declares (stackmodel). What the call would
allocate, copy and hash is charged to the scan's `loadcost.LoadCost`.
"""

from __future__ import annotations

import collections
import enum
import inspect
import sys
from collections.abc import Callable

from compilewatch.cache.trust.allowlist import (
    _ATTR_NAME,
    _MEMBER_NAME,
    _MISSING,
    CALLABLE_GLOBALS,
    CHECKED_CALLS,
    STORING_CONSTRUCTORS,
    _builtin_owner,
    _import_attr,
    _init_is_data,
    _is_callable_class,
    _is_sympy,
    _new_is_data,
    _owner,
    _setstate_is_data,
    _why_refused,
    is_allowed,
)
from compilewatch.cache.trust import fxbounds, paths
from compilewatch.cache.trust.loadcost import LoadCost
from compilewatch.cache.trust.stackmodel import (
    _BoundMethod,
    _Bytes,
    _Dict,
    _Global,
    _List,
    _Num,
    _Obj,
    _Seq,
    _Str,
    _Value,
    _generated,
    describe,
    fresh_class,
    graph_args,
    live_of,
    stores_only,
    strong,
)

_CODECS = frozenset({"latin1", "latin-1", "utf-8", "utf8", "ascii"})  # how protocols 0-2 pickle bytes


_TENSOR_RESULTS = frozenset({"torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3",
                             "torch._utils._rebuild_parameter", "torch._tensor._rebuild_from_type_v2"})


def _opaque(what: str) -> _Value:
    return _Value("opaque", what)


def _is_defaultdict(cls: type) -> bool:
    return cls is collections.defaultdict


class _Calls:
    """What each call (REDUCE / NEWOBJ / NEWOBJ_EX / OBJ / INST, and getattr) may do, and what it
    returns, by the callee's declared result (stackmodel)."""

    refuse: Callable[[str | None], None]
    nested_torch_save: Callable[[bytes], None]
    cost: LoadCost  # what the load would allocate and compute (loadcost)
    # bytes already scanned for _load_from_bytes, and what _codecs.encode made of each string constant: by
    # the object (kept alive here), so a memo'd constant loaded or encoded again and again costs nothing more
    loaded: dict[int, _Bytes]
    encoded: dict[tuple[int, str], tuple[_Str, _Bytes]]

    def checked_call(self, fn: _Global, args: object) -> object:
        """getattr's two allowed forms (see CHECKED_CALLS); what it pushes."""
        items = args.items if isinstance(args, _Seq) else None
        if items is not None and len(items) == 2 and isinstance(items[1], _Str):
            obj, name = items
            target = _import_attr(obj) if isinstance(obj, _Global) else _MISSING
            if isinstance(obj, _Global) and is_allowed(*obj.rsplit(".", 1)) and isinstance(target, enum.EnumMeta) and (
                    _MEMBER_NAME.match(name) or str(name) in target.__members__):
                return _Value("member", f"{obj}.{name}", target)  # an enum member (Python 3.12+: by its name)
            if isinstance(obj, _Global) and is_allowed(*obj.rsplit(".", 1)) and _MEMBER_NAME.match(name):
                return _opaque(f"getattr({obj}, {str(name)!r})")  # a class attribute: anything
            if _ATTR_NAME.match(name) and not (isinstance(obj, _Global) and obj in CHECKED_CALLS):
                cls = target if isinstance(target, type) else obj.cls if isinstance(obj, _Obj) else None
                found = inspect.getattr_static(cls, str(name), None) if cls is not None else None
                if isinstance(found, (classmethod, staticmethod)):  # session 15: CppCodeCache().load compiles C++
                    self.refuse(f"getattr({obj if isinstance(obj, str) else f'<{cls.__qualname__} instance>'}, "
                                f"{str(name)!r}): a {type(found).__name__} of {cls.__qualname__}, kept where torch may call it "
                                "(a bound method of an instance's own function may be kept)")
                    return _opaque(f"getattr(..., {str(name)!r})")
                # a bound method (of an instance this pickle made: its class known) or an attribute: never
                # called here, and kept only where torch keeps one (`methods`: it calls what it finds there)
                if isinstance(obj, _Obj):
                    return _BoundMethod(f"getattr(<{obj.cls.__qualname__} instance>, {str(name)!r})", obj.cls, str(name))
                return _BoundMethod(f"getattr({obj if isinstance(obj, _Global) else '<object>'}, {str(name)!r})", None,
                                    str(name))
        shown = (f"getattr({items[0] if isinstance(items[0], str) else '<object>'}, {items[1]!r})"
                 if items is not None and len(items) == 2 else "getattr(<computed arguments>)")
        self.refuse(f"{fn} call {shown}: only getattr(<class>, 'MEMBER') and getattr(<object>, 'name') are allowed")
        return _opaque("a refused getattr")

    def call(self, opname: str, fn: object, args: object, kwargs: object = None) -> object:
        """Check one call of `fn` with `args`; what it pushes."""
        if not isinstance(fn, _Global):
            what = fn.what if isinstance(fn, _Value) else describe(fn)
            self.refuse(f"<a call of {what}: only named, allowed globals may be called>")
            return _opaque("the result of a refused call")
        if fn in CHECKED_CALLS or _why_refused(*fn.rsplit(".", 1)) is not None:
            return _opaque(f"{fn}(...)")  # refused when it was named
        obj = _import_attr(fn)
        if obj is _MISSING:
            return _opaque(f"{fn}(...)")  # not importable here: pickle.loads would fail on it too
        items = args.items if isinstance(args, _Seq) else None
        if isinstance(obj, type):
            return self.construct(opname, fn, obj, items, args, kwargs)
        if opname != "REDUCE" or fn not in CALLABLE_GLOBALS:
            self.refuse(f"{fn} called: it may be a value in a cache pickle, never called by one")
            return _opaque(f"{fn}(...)")
        return self.call_function(fn, items)

    def call_function(self, fn: _Global, items: list[object] | None) -> object:
        if fn == "copyreg._reconstructor":  # (cls, base, state): base.__new__(cls, state) [+ base.__init__]
            base = _import_attr(items[1]) if items and len(items) == 3 and isinstance(items[1], _Global) else _MISSING
            cls = _import_attr(items[0]) if items and isinstance(items[0], _Global) else _MISSING
            if base is not object or not isinstance(cls, type):
                self.refuse("copyreg._reconstructor with a base other than object, or of something not a named "
                            "class: it runs that base's constructor")
                return _opaque(f"{fn}(...)")
            if not fresh_class(cls):
                self.refuse(f"copyreg._reconstructor of {items[0]}: an instance made without its constructor")
            self.cost.take(56, fn)
            return _Obj(cls, fresh=fresh_class(cls))
        if fn in _TENSOR_RESULTS:
            self.tensor_call(fn, items)
            self.cost.take(256, fn)
            return _Value("tensor", f"{fn}(...)")
        if fn == "_codecs.encode":  # (str, encoding): how protocols 0-2 pickle bytes
            if not (items and len(items) == 2 and isinstance(items[0], _Str) and isinstance(items[1], _Str)
                    and items[1] in _CODECS):
                self.refuse(f"{fn} of something other than a string constant and a plain text codec")
                return _Value("bytes", f"{fn}(...)")
            key = (id(items[0]), str(items[1]))
            self.cost.take(33 + len(items[0]) * (1 if "8" not in items[1] else 4), f"{fn} of a string of {len(items[0])}")
            try:
                if key not in self.encoded:
                    self.encoded[key] = (items[0], _Bytes(str(items[0]).encode(str(items[1]))))
                return self.encoded[key][1]
            except UnicodeError:
                return _Value("bytes", f"{fn}(...)")  # pickle.loads would fail on it too
        if fn == "torch.fx.graph_module.reduce_graph_module":  # exec(import_block + body["_code"])
            why = graph_args(_Seq(list(items)) if items is not None else None)
            if why:
                self.refuse(f"{fn} of {why}")
            else:  # it compiles and re-traces the source, each call anew: what that runs eagerly allocates
                source = str(items[1]) + str(items[0].code) if isinstance(items[0], _Dict) else ""
                self.cost.take(16 * len(source) + fxbounds.check(source)[1],
                               f"{fn} of a source of {len(source)} characters (and the torch calls it runs)")
            return _Value("graph module", f"{fn}(...)")
        if fn == "torch.storage._load_from_bytes":  # torch.load(bytes, weights_only=False): scan what it loads
            blob = items[0] if items and len(items) == 1 else None
            if not isinstance(blob, _Bytes):
                self.refuse(f"{fn} of something computed: it unpickles it")
            elif id(blob) not in self.loaded:  # scanned once; its load's allocations charged at each call
                self.loaded[id(blob)] = blob
                before = self.cost.alloc
                self.nested_torch_save(bytes(blob))
                self.cost.loads[id(blob)] = self.cost.alloc - before
            else:
                self.cost.take(self.cost.loads.get(id(blob), 0), f"{fn} of the same bytes again")
            return _Value("storage", f"{fn}(...)")
        return _opaque(f"{fn}(...)")  # select_decomp_table(): a table of functions

    def tensor_call(self, fn: _Global, items: list[object] | None) -> None:
        if fn != "torch._tensor._rebuild_from_type_v2":  # (storage, offset, size, stride, grad, hooks, ...)
            why = next((live_of(x) for x in items or () if live_of(x)), None)
            if why:
                self.refuse(f"{fn} with an argument holding {why} (backward hooks are called)")
            return
        # (func, type, args, state): ret = func(*args).as_subclass(type), then its state set by setattr
        inner, new_type, inner_args, state = items if items and len(items) == 4 else (None,) * 4
        if not (isinstance(inner, _Global) and inner.startswith("torch._utils._rebuild_") and inner in CALLABLE_GLOBALS):
            self.refuse(f"{fn} with a function other than torch's tensor rebuilders: it calls that function")
        cls = _import_attr(new_type) if isinstance(new_type, _Global) else _MISSING
        torch = sys.modules.get("torch")
        if not (isinstance(cls, type) and torch is not None and issubclass(cls, torch.Tensor)):
            self.refuse(f"{fn} with a type that is not a named tensor class: it makes one of it")
        elif not _setstate_is_data(cls):
            self.refuse(f"{fn} of {new_type}: its __setstate__ runs its own code")
        if not isinstance(inner_args, _Seq) or inner_args.live:
            self.refuse(f"{fn} with rebuild arguments the scan cannot see")
        parts = state.items if isinstance(state, _Seq) and len(state.items) == 2 else [state]
        for d in parts:
            if d is None or isinstance(d, _Num):
                continue
            self.cost.take(48 * d.n if isinstance(d, _Dict) else 0, f"{fn}'s state")  # set item by item
            if not (isinstance(d, _Dict) and d.str_keys and not d.bad_attr and not d.graph_fn and not d.live):
                why = (d.bad_attr or d.live) if isinstance(d, _Dict) else describe(d)
                self.refuse(f"{fn} with a state that is not plain data ({why}): it is set on the tensor")

    def construct(self, opname: str, fn: str, cls: type, items: list[object] | None, args: object,
                  kwargs: object) -> object:
        if cls in (bytes, bytearray, str) and items:  # bytes(n) allocates n bytes; (x, encoding) looks the codec up
            if cls is not str and not (isinstance(items[0], (_Bytes, _Str, _Seq, _List)) or (
                    isinstance(items[0], _Obj) and items[0].cls in (bytes, bytearray, str, list, tuple))):
                self.refuse(f"{fn} of {describe(items[0])}: of a number it allocates that many bytes")
            if len(items) > 1 and not (isinstance(items[1], _Str) and items[1] in _CODECS):
                self.refuse(f"{fn} with a codec other than a plain text one: the codec's module is imported")
        stores = _owner(cls, "__new__") in (None, object) and (opname in ("NEWOBJ", "NEWOBJ_EX") or stores_only(cls))
        if not stores and any(isinstance(x, _Obj) and x.cls is range for x in items or ()):
            self.refuse(f"{fn} constructed from a range: it iterates it (a range of 2**40 numbers is a few bytes)")
        if _is_sympy(cls):
            self.construct_sympy(opname, fn, cls, items, args)
            obj = _Obj(cls, fresh=False)  # sympy caches its objects (and has singletons)
            self.cost.sympy(cls, args, obj)
            return obj
        torch = sys.modules.get("torch")
        if torch is not None and issubclass(cls, torch.Tensor) and items:
            self.refuse(f"{fn} constructed with arguments: torch.Tensor(n, ...) allocates n elements, torch.Tensor(x) "
                        "copies x")
        stored = paths.BY_STATE.get(f"{cls.__module__}.{cls.__qualname__}")
        if stored is not None and opname not in ("NEWOBJ", "NEWOBJ_EX") and (
                len(items or ()) > stored or kwargs is not None):  # a dataclass __init__ stores what `paths` checks
            self.refuse(f"{fn} called with arguments: torch pickles it by its state, where the paths torch makes "
                        "of it (a local_cache, a recorder's key, a triton artifact's name) and its remote_cache are checked")
        if isinstance(cls, enum.EnumMeta) and items:  # a lookup by value: it hashes the value
            self.cost.hashed(items[0], None, f"{fn}'s lookup of a value")
        new_only = opname in ("NEWOBJ", "NEWOBJ_EX")
        if not new_only and not _builtin_owner(_owner(type(cls), "__call__")):
            self.refuse(f"{fn} called: its metaclass's __call__ runs its own code")
        if _is_callable_class(cls):
            pass
        elif not _new_is_data(cls):
            self.refuse(f"{fn}.__new__ runs its own code: not a data class")
        elif not new_only and not _init_is_data(cls):
            self.refuse(f"{fn} called: its __init__ runs its own code (only data classes may be called)")
        new = _owner(cls, "__new__")
        ignores = new is None or new is object or _generated(vars(new)["__new__"])  # stores, or ignores, its args
        if _is_defaultdict(cls) and kwargs is None and isinstance(args, _Seq) and args.items \
                and (isinstance(args.items[0], _BoundMethod) or not live_of(args.items[0])) \
                and not any(live_of(x) for x in args.items[1:]):
            pass  # defaultdict(factory) stores its factory (called only on a missing key, after loading);
            # the dict holds it, so it is live: nothing may call, hash or hand it on (a CUDA entry keeps
            # `launcher.create_binder` this way)
        elif not (ignores and (new_only or stores_only(cls))):
            weak_ok = f"{cls.__module__}.{cls.__qualname__}" in STORING_CONSTRUCTORS
            for a in (args, kwargs):
                if live_of(a) and (strong(live_of(a)) or not weak_ok):
                    self.refuse(f"{fn} constructed from {live_of(a)}: its constructor uses what it is given")
        if kwargs is not None and not isinstance(kwargs, _Dict):
            self.refuse(f"{fn} constructed with keyword arguments the scan cannot see")
        obj = _Obj(cls, fresh=fresh_class(cls))
        obj.hold(args)
        if kwargs is not None:
            obj.hold(kwargs)
        self.cost.take(56, fn)
        post = _owner(cls, "__post_init__")
        if not new_only and post is not None and not _builtin_owner(post):
            self.refuse(self.cost.post_init(fn, items or []))
        if items or isinstance(kwargs, _Dict):  # what it copies of an iterable (defaultdict: of its mapping)
            arg = (items[1] if len(items) > 1 else None) if _is_defaultdict(cls) and items else (
                items[0] if items else kwargs)
            self.refuse(arg is not None and self.cost.copied(fn, cls, arg, obj) or None)
        self.refuse(self.cost.fields(obj, [a for a in (args, kwargs) if a is not None]))
        return obj

    def construct_sympy(self, opname: str, fn: str, cls: type, items: list[object] | None, args: object) -> None:
        # sympy constructors sympify their arguments, and sympify evaluates strings: only numbers,
        # sympy objects and tuples of them (a Symbol's first argument, its name, may be a string)
        sympy = sys.modules["sympy"]
        named = issubclass(cls, sympy.Symbol) and bool(items) and isinstance(items[0], _Str)
        if not isinstance(args, _Seq):
            ok = False
        elif issubclass(cls, sympy.Float):  # Float(<numeral str>) or Float((sign, <hex str>, exp, bc)): parsed, never sympified
            ok = all(isinstance(x, (_Num, _Str)) or (isinstance(x, _Seq) and x.literal) for x in args.items)
        elif issubclass(cls, sympy.Rational):  # Rational/Integer(<numeral str>): fractions/int parse; a container is sympified
            ok = args.literal
        else:
            ok = args.sympy_tail_ok if named else args.sympy_ok
        if not ok:
            self.refuse(f"{fn} constructed from a string or a container: sympy evaluates strings (sympify)")
        elif opname == "NEWOBJ_EX" and not issubclass(cls, (sympy.Symbol, sympy.Float)):  # assumptions / precision
            self.refuse(f"{fn} constructed with keyword arguments")
