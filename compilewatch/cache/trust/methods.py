"""Where a pickle may keep a bound method (session 16b).

`getattr(<object>, "name")` is how pickle stores a bound method, and the scan lets a pickle make one (it is
never called while loading). But torch calls what it later finds in an object's attributes: a CachingAutotuner's
`_reload_kernel()` (2.11, 2.13, 2.15: `self.fn = self._reload_kernel().fn` when its kernel must be reloaded) and
`save_cache_hook(config, time)` (at its next autotune), a static launcher's `C_impl._unload_kernel(...)`
(session 15)... A state holding `getattr(AutotuneCacheArtifact(key=<any path>, content=<bytes>), 'populate_cache')`
as `_reload_kernel` wrote the pickle's bytes to that path when torch called it (every CacheArtifact subclass's
`populate_cache` writes a file its key names; tests/test_picklescan_s16b.py).

So a bound method may be kept in an object only where torch itself keeps one, bound to what torch binds there:
- a CachingAutotuner's (or subclass's) `save_cache_hook`: `autotune_cache and autotune_cache.save`
  (triton_heuristics, 2.11 / 2.13 / 2.15), an AutotuneCache's `save` (whose local_cache `paths` checks);
- a defaultdict's factory: triton's `JITFunction.device_caches = defaultdict(self.create_binder)` (3.6, 3.9),
  a JITFunction's `create_binder`.
Anywhere else -- under another key or class of a BUILD state, inside a container an instance's state or
constructor holds, a call's argument, a dict key -- it is refused. A pickle's top-level containers (nothing
restores them into an object) may still hold one, as before, and so may a defaultdict's factory there.

What holds one is followed through the stack (`Tracker`): a tuple, list, dict or set that holds a bound
method, or holds such a container, carries it; a container something already holds may not be given one.
Each value is looked at once per opcode that takes it, so this stays linear in the pickle's size.
"""

from __future__ import annotations

from collections.abc import Callable

from compilewatch.cache.trust.stackmodel import _BoundMethod, _Dict, _Node, _Obj, _Seq, _Str, describe

_AUTOTUNER = "torch._inductor.runtime.triton_heuristics.CachingAutotuner"
# (a class whose state keeps it, the key) -> (the class of the instance it is bound to, the method's name)
HOMES: dict[tuple[str, str], tuple[str, str]] = {
    (_AUTOTUNER, "save_cache_hook"): ("torch._inductor.runtime.autotune_cache.AutotuneCache", "save"),
}
# a defaultdict's factory: (the class of the instance it is bound to, the method's name)
FACTORIES: frozenset[tuple[str, str]] = frozenset({("triton.runtime.jit.JITFunction", "create_binder")})
_WHERE = ("torch keeps one only as a CachingAutotuner's save_cache_hook (an AutotuneCache's save) and as a "
          "defaultdict's factory (a JITFunction's create_binder), and calls what it finds in an object")

_CALLS = frozenset({"REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST"})
_MADE = frozenset({"TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "LIST", "DICT", "FROZENSET"})
_FILLS = frozenset({"SETITEM", "SETITEMS", "APPEND", "APPENDS", "ADDITEMS"})
_PASSED = frozenset({"POP", "POP_MARK", "DUP"})


def _is(cls: type | None, name: str) -> bool:
    """`cls` is the class `name` or a subclass of it (by name: nothing imported)."""
    return cls is not None and any(f"{k.__module__}.{k.__qualname__}" == name for k in cls.__mro__)


def _bound_to(v: object, home: tuple[str, str]) -> bool:
    return isinstance(v, _BoundMethod) and v.attr == home[1] and _is(v.cls, home[0])


class Tracker:
    """Which containers of the scan hold a bound method (directly or through another container)."""

    def __init__(self, refuse: Callable[[str | None], None]) -> None:
        self.refuse = refuse
        self.carriers: dict[int, object] = {}  # id -> the container (kept alive: ids stay unique)
        # a dict's (key, value) that carry one, by key (a key set again replaces its value, as in the dict)
        self.pairs: dict[int, dict[object, tuple[object, object]]] = {}
        self.active = False  # a bound method was made (getattr's REDUCE): before, nothing can carry one

    def carries(self, v: object) -> bool:
        return isinstance(v, _BoundMethod) or id(v) in self.carriers

    def _carry(self, node: object) -> None:
        self.carriers[id(node)] = node

    def after(self, opname: str, args: list[object], out: tuple[object, ...]) -> None:
        """What `opname` did with the values it took (`args`, a mark's slice as one list) and made (`out`)."""
        if not self.active:  # most pickles make none: one check an opcode
            if opname != "REDUCE" or not out or not isinstance(out[0], _BoundMethod):
                return
            self.active = True
        if opname in _PASSED:
            return
        taken = args[1:] if opname in _FILLS or opname == "BUILD" else args  # not the object it acts on
        flat = [x for a in taken for x in (a if isinstance(a, list) else (a,))]
        if not any(self.carries(x) for x in flat):
            return
        if opname in _MADE:
            self._carry(out[0])
            if opname == "DICT":
                self._pairs(out[0], args[-1])
        elif opname in _FILLS:
            self._fill(opname, args)
        elif opname == "BUILD":
            self._build(args[0], args[1])
        elif opname in _CALLS:
            self._call(opname, args, out[0])
        else:
            self.refuse(f"{opname} of {self._what(flat)}: {_WHERE}")

    def _what(self, values: list[object]) -> str:
        v = next(x for x in values if self.carries(x))
        return f"a bound method, {v.what}" if isinstance(v, _BoundMethod) else f"{describe(v)} holding a bound method"

    def _pairs(self, target: object, items: list[object]) -> None:
        for i in range(0, len(items) - 1, 2):
            k, v = items[i], items[i + 1]
            if self.carries(k):
                self.refuse(f"a dict key that is {self._what([k])}: {_WHERE}")
            elif self.carries(v):
                self.pairs.setdefault(id(target), {})[str(k) if isinstance(k, _Str) else id(k)] = (k, v)

    def _fill(self, opname: str, args: list[object]) -> None:
        target = args[0]
        items = list(args[1:]) if opname in ("SETITEM", "APPEND") else list(args[-1])
        if isinstance(target, _Node) and target.held:  # changed after something holds it: the holder sees it
            self.refuse(f"{opname} of {self._what(items)} into {describe(target)} something already holds: {_WHERE}")
        self._carry(target)
        if opname in ("SETITEM", "SETITEMS"):
            self._pairs(target, items)

    def _build(self, obj: object, state: object) -> None:
        cls = obj.cls if isinstance(obj, _Obj) else None
        name = f"{cls.__module__}.{cls.__qualname__}" if cls is not None else describe(obj)
        parts = state.items if isinstance(state, _Seq) and len(state.items) == 2 else [state]
        for d in parts:
            if not self.carries(d):
                continue
            if not isinstance(d, _Dict) or id(d) not in self.pairs:
                self.refuse(f"BUILD of {name} with a state that is {self._what([d])}: {_WHERE}")
                continue
            for key, value in self.pairs[id(d)].values():  # at most one home a key: stops at the first other
                home = next((h for (owner, k), h in HOMES.items() if isinstance(key, _Str) and k == key and _is(cls, owner)),
                            None)
                if home is None or not _bound_to(value, home):
                    shown = f"a bound method, {value.what}" if isinstance(value, _BoundMethod) else (
                        f"{describe(value)} holding a bound method")
                    self.refuse(f"BUILD of {name} storing {shown} as {str(key)[:60]!r}: {_WHERE}")
                    break

    def _call(self, opname: str, args: list[object], made: object) -> None:
        fn = args[0][0] if opname == "OBJ" and args and isinstance(args[0], list) and args[0] else args[0]
        fargs = args[1] if opname not in ("OBJ", "INST") and len(args) > 1 else None
        if (opname == "REDUCE" and fn == "collections.defaultdict" and isinstance(fargs, _Seq) and fargs.items
                and isinstance(fargs.items[0], _BoundMethod) and not any(self.carries(x) for x in fargs.items[1:])):
            if not any(_bound_to(fargs.items[0], f) for f in FACTORIES):  # not torch's: kept where nothing calls it
                self._carry(made)
            return  # defaultdict(<a JITFunction>.create_binder): torch's own, wherever it is
        what = self._what([x for a in args for x in (a if isinstance(a, list) else (a,))])
        self.refuse(f"{fn if isinstance(fn, str) else describe(fn)} called with {what}: {_WHERE}")
