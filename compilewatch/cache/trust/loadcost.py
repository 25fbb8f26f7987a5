"""What `pickle.loads` would allocate and compute for a pickle `picklescan` passed: a budget in proportion to its size.

The scan stops code from running while a pickle is unpickled; this stops the unpickler from being made
to allocate or compute without bound. Most of what a pickle makes costs about what it spells: a
constant holds its bytes, a container a few words per item it lists. What does not (session 15):
- a call that copies or iterates its argument (`bytearray(x)`, `list(x)`, `set(x)`, `OrderedSet(x)`,
  `_codecs.encode(s)`, `_load_from_bytes(b)`, a restore that copies its state): a memo'd value of L
  bytes copied k times holds k*L for a few bytes of pickle each (a 566 KB pickle of `list(GET 1)`s:
  8.3 GB and 72 s; a 1 MB one of `bytearray(GET 1)`s: 1 GB);
- hashing (dict keys, set items, an enum's lookup, sympy's cache): a tuple is hashed item by item, each
  time, by C recursion: a tuple nested 2e5 deep crashes the interpreter (SIGSEGV; a 1 MB pickle), one
  whose items share a tuple 60 times over (`t = (t, t)`) takes 2**60 steps (a 500-byte pickle); keys the
  pickle made share one hash (ints equal mod 2**61-1, tuples solved for CPython's xxHash; session 16:
  floats, 201 distinct ones on one hash, and numbers a call made, `complex(h - 1000003 * b, b)`) make
  each insertion probe every earlier one, and each copy of the container (`set(GET n)`) probe again (a
  33 KB pickle of 1400 `set(GET 1)`s of 1231 such keys: 36 s, modeled at 1.8e6 steps);
- torch.load's storages (in `_load_from_bytes`): allocated at the size their persistent id declares;
  `torch.Tensor(n)` allocates n elements;
- sympy's own evaluation: `sympy.Max` of n arguments ~0.5 ms * n**2 (250 symbols, a 9 KB pickle: 38 s).

So `LoadCost` keeps two totals of a model of the load -- `alloc`, the bytes it allocates (every
allocation, freed or not, so it also measures the copies' time), and `work`, steps of hashing and of
sympy's evaluation (a step ~10 ns) -- and refuses a pickle whose totals pass its caps (below, with why
they are what they are). A key hashed deeper than MAX_HASH_DEPTH, a container whose keys share one
hash MAX_CHAIN times, and a storage of a size the scan cannot see are refused whatever the totals;
keys sharing a hash (or whose hash the scan cannot compute: counted as if they shared one) are charged
PROBE_STEP a probe, at each insertion and again at each copy of their container.
"""

from __future__ import annotations

import collections
import enum
import sys
from collections.abc import Callable

from compilewatch.cache.trust.allowlist import _builtin_owner, _import_attr, _is_sympy, _owner
from compilewatch.cache.trust.stackmodel import _Bytes, _Dict, _FSet, _List, _Node, _Num, _Obj, _Seq, _Set, _Str

# What the load may allocate: CPython's unpickler itself holds ~1.7x a real torch cache pickle at its peak
# (tracemalloc, FX-graph and AOTAutograd entries of 2.13 and 2.15: strings, small instances); the model
# counts every allocation at its CPython size, freed or not (a real entry: ~2-3x its size). 8x leaves room
# for pickles denser in small objects; the floor keeps small files (a 600-byte PGO state models ~15x) free.
MIN_ALLOC = 64 << 20
ALLOC_PER_BYTE = 8
# What hashing and sympy may compute: a real entry hashes each key a step or two (strings cache their
# hash). The floor (~2.7 s of steps) bounds a small pickle's worst case; 256 a byte keeps a large one linear.
MIN_WORK = 1 << 28
WORK_PER_BYTE = 256
MAX_HASH_DEPTH = 1000  # C recursion per nesting level (tuplehash checks no depth); Python's default limit
MAX_CHAIN = 32  # keys of one container on one hash the scan computed: a real pickle's are distinct
MAX_BLIND = 1024  # keys whose hash the pickle chooses but the scan cannot compute (int(...) results, ...)
MAX_PAIRS = 64  # a dict built from an iterable of pairs (pickle itself fills dicts by SETITEMS)
SYMPY_STEP = 10_000  # ~100 us, per argument of a sympy constructor (FloorDiv 40 us, Add 600 us, Max 2 ms)
SYMPY_PAIR = 100_000  # ~1 ms, per pair of arguments of sympy's Min / Max / Exclusive (quadratic in them)
PY_STEP = 64  # a step of Python code walking a value (is_literal, sympify of a tuple's items): ~0.5 us
_SAT = 1 << 62  # costs saturate here (a shared tuple's is 2**k)

PROBE_STEP = 3  # steps per probe of a key sharing a hash: a rich comparison (floats 23 ns, complex 34 ns measured)
_RANDOM = object()  # a hash nobody can choose: a string's (salted), an object's address
_PROBES = object()  # a key of `_Node.chains`: the probes inserting its items made (what a copy re-does)
_UNKNOWN = object()  # a hash the pickle chooses that the scan does not compute
_SALTED = bool(sys.flags.hash_randomization)
_M64 = (1 << 64) - 1
_XX1, _XX2, _XX5 = 11400714785074694791, 14029467366897019727, 2870177450012600261

# bytes per item of what a constructor builds from an iterable (CPython 3.11, 64-bit, with its spare room)
_PER_ITEM = ((collections.OrderedDict, 104), (dict, 48), (set, 32), (frozenset, 32), (list, 9), (tuple, 8),
             (collections.deque, 9), (bytearray, 1), (bytes, 1), (str, 4))
# own constructors (allowlist.CALLABLE_CLASSES) that iterate their first argument, and into what
_OWN_ITERATING = {"torch.utils._ordered_set.OrderedSet": dict, "inspect.Signature": collections.OrderedDict,
                  "torch.Size": tuple}
_STORAGE_ITEM = {"Double": 8, "Long": 8, "ComplexFloat": 8, "ComplexDouble": 16, "Float": 4, "Int": 4, "Half": 2,
                 "BFloat16": 2, "Short": 2, "Char": 1, "Byte": 1, "Bool": 1, "Untyped": 1}
_hash_kinds: dict[int, tuple[type, str]] = {}


def _tuplehash(lanes: list[int]) -> int:
    """CPython's tuple hash (xxHash, 3.8+) of items with these hashes."""
    acc = _XX5
    for lane in lanes:
        acc = (acc + (lane & _M64) * _XX2) & _M64
        acc = (((acc << 31) | (acc >> 33)) * _XX1) & _M64
    acc = (acc + (len(lanes) ^ (_XX5 ^ 3527539))) & _M64
    if acc == _M64:
        return 1546275796
    return acc - (1 << 64) if acc >> 63 else acc


def hash_kind(cls: type) -> str:
    """How an instance of `cls` hashes: "fields" (by what it holds: tuples, dataclasses, torch's own
    `__hash__`es), "value" (a number a call made), or "random" (its address, a salted string, a cached
    or unhashable one: nothing a pickle can grow or aim)."""
    got = _hash_kinds.get(id(cls))
    if got is None or got[0] is not cls:
        got = (cls, _hash_kind(cls))
        _hash_kinds[id(cls)] = got
    return got[1]


# classes whose own __hash__ hashes one string they keep, whatever else they hold: triton's JITFunction
# (`hash(self.cache_key)`, triton 3.6 and 3.9), which a CUDA entry's CachingAutotuner keeps as `fn` and pickles
# after `getattr(<it>, 'create_binder')` holds it (its `device_caches` defaultdict): a salted string's hash
_HASHED_BY_A_STRING = frozenset({"triton.runtime.jit.JITCallable"})


def _hash_kind(cls: type) -> str:
    k = _owner(cls, "__hash__")
    torch = sys.modules.get("torch")
    if k is not None and f"{k.__module__}.{k.__qualname__}" in _HASHED_BY_A_STRING:
        return "random"
    if k is None or vars(k)["__hash__"] is None or k is object or issubclass(cls, (enum.Enum, str, bytes)) \
            or _is_sympy(cls) or (torch is not None and issubclass(cls, torch.Tensor)):
        return "random"
    if issubclass(cls, (int, float, complex, range, slice)) and _builtin_owner(k):
        return "value"
    return "fields"


def hash_of(v: object) -> tuple[int, int, object]:
    """What hashing `v` costs (steps), how deep it recurses, and its hash (an int the scan computed,
    _UNKNOWN or _RANDOM)."""
    if isinstance(v, _Num):
        x = v.value
        return (1 + x.bit_length() // 64 if isinstance(x, int) else 1), 0, v.h
    if isinstance(v, (_Str, _Bytes)):
        return 1, 0, (_RANDOM if _SALTED else hash(v))
    if isinstance(v, _Seq):
        return 1 + v.icost, 1 + v.idepth, v.h
    if isinstance(v, _FSet):
        return 1 + v.n, 1, (_RANDOM if v.h is _RANDOM else _UNKNOWN)
    if isinstance(v, _Obj):
        if isinstance(v.h, int):
            return 1, 0, v.h  # sympy's Integer(n): hash(n)
        kind = hash_kind(v.cls)
        if kind == "fields":
            return 1 + v.icost, 1 + v.idepth, (_RANDOM if v.h is _RANDOM else _UNKNOWN)
        return 1, 0, (_UNKNOWN if kind == "value" else _RANDOM)
    return 1, 0, _RANDOM  # a global (by address), a call's result


def _collides(v: object, h: object) -> bool:
    """May `v` share its hash with many other keys on purpose? A tuple, an instance hashed by its fields,
    an int past 2**61 (its hash is its value mod 2**61-1), a float other than the integral one equal to
    its hash (session 16: a float m * 2**e hashes as m * 2**(e mod 61) mod 2**61-1, so 201 distinct floats
    share one hash, beside ints and complex numbers: 8000 copies of such a set, a 50 KB pickle, took 5 s
    to load). Not a smaller int or the float equal to it (its hash is itself: one key per hash; 1, 1.0
    and True are one key, as are 0.0 and -0.0), a string (salted) or an object (by address)."""
    if isinstance(v, _Num):
        return isinstance(v.value, (int, float)) and h != v.value
    return h is not _RANDOM


def _length(v: object) -> int | None:
    """How many items iterating `v` yields, where the scan knows."""
    if isinstance(v, (_Str, _Bytes)):
        return len(v)
    if isinstance(v, _Node):
        return v.n
    return None


def add_items(node: _Node, items: list[object]) -> str | None:
    """`items` are now held by `node` as items (a tuple's, a list's, a set's): its facts for what
    iterating and hashing them costs (a tuple's: its own hash). Why too many share one hash, or None
    (a tuple's are counted when something hashes them: it keeps its items)."""
    cost, depth, rnd, why = node.icost, node.idepth, node.h is _RANDOM, None
    seq = type(node) is _Seq
    lanes: list[int] = []
    for x in items:
        c, d, h = hash_of(x)
        cost += c
        if d > depth:
            depth = d
        if h is _RANDOM:
            rnd = True
        elif seq:
            if h is not _UNKNOWN:
                lanes.append(h)
        elif _collides(x, h):
            why = _chain(node, h) or why
    node.n += len(items)
    node.icost, node.idepth = min(cost, _SAT), depth
    if seq:
        node.h = _RANDOM if rnd else (_tuplehash(lanes) if len(lanes) == len(items) and cost < 4096 else _UNKNOWN)
    elif rnd:
        node.h = _RANDOM
    return why


def _chain(node: _Node, h: object) -> str | None:
    """One more key of `node` on hash `h`: it probes each earlier one on `h` (a key the scan cannot hash,
    as if all such shared one hash); the probes are summed under _PROBES, what copying `node` re-does."""
    chains = node.chains
    if chains is None:
        chains = node.chains = {}
    count = chains[h] = chains.get(h, 0) + 1
    chains[_PROBES] = chains.get(_PROBES, 0) + count - 1
    if h is not _UNKNOWN and count > chains.get(None, 0):
        chains[None] = count  # the longest chain, so a later check is one lookup
    if h is _UNKNOWN:
        if count > MAX_BLIND:
            return (f"more than {MAX_BLIND} keys in one container whose hashes the pickle chooses (numbers a call "
                    "made, instances hashed by their fields): each may probe every earlier one")
    elif count > MAX_CHAIN:
        return (f"{count} keys in one container sharing the hash {h}: each insertion probes every earlier one "
                "(quadratic)")
    return None


def probes(node: _Node) -> int:
    """The probes inserting `node`'s items made (as a set's or a dict's keys)."""
    return node.chains.get(_PROBES, 0) if node.chains else 0


def _worst(chains: dict[object, int] | None) -> str | None:
    if not chains:
        return None
    count = max(chains.get(None, 0) - MAX_CHAIN, chains.get(_UNKNOWN, 0) - MAX_BLIND)
    return f"items of which too many share a hash the pickle chose ({count} past the limit)" if count > 0 else None


class LoadCost:
    """The two totals for one top-level pickle (and the torch.save pickles `_load_from_bytes` nests in it)."""

    __slots__ = ("alloc", "work", "alloc_cap", "work_cap", "size", "refuse", "over", "loads")

    def __init__(self, size: int, refuse: Callable[[str | None], None]) -> None:
        self.size, self.refuse = max(size, 0), refuse
        self.alloc = self.work = 0
        self.alloc_cap = max(MIN_ALLOC, ALLOC_PER_BYTE * self.size)
        self.work_cap = max(MIN_WORK, WORK_PER_BYTE * self.size)
        self.over = False  # a cap was passed (said once; the model stops copying facts)
        self.loads: dict[int, int] = {}  # what one `_load_from_bytes` blob's load allocates, by the blob

    def take(self, nbytes: int, what: str) -> None:
        """The load allocates `nbytes` for `what`."""
        self.alloc += nbytes
        if self.alloc > self.alloc_cap and not self.over:
            self.over = True
            self.refuse(f"the load would allocate more than {self.alloc_cap} bytes (max({MIN_ALLOC >> 20} MiB, "
                        f"{ALLOC_PER_BYTE} x the pickle's {self.size} bytes)), passed at {what}")

    def spend(self, steps: int, what: str) -> None:
        """The load computes `steps` (~10 ns each) for `what`."""
        self.work += steps
        if self.work > self.work_cap and not self.over:
            self.over = True
            self.refuse(f"the load would take more than {self.work_cap} steps of hashing and sympy evaluation "
                        f"(max(2**28, {WORK_PER_BYTE} x the pickle's {self.size} bytes)), passed at {what}")

    def hashed(self, v: object, into: _Node | None, what: str) -> None:
        """`v` is hashed (a dict key, a set item, a lookup); `into`: the container it goes into."""
        cost, depth, h = hash_of(v)
        if depth > MAX_HASH_DEPTH:
            self.refuse(f"{what} nested {depth} deep: hashing it recurses in C without a limit (a crash past "
                        f"~1e5 levels), at most {MAX_HASH_DEPTH}")
        self.spend(cost, what)
        if into is not None and _collides(v, h):
            before = probes(into)
            self.refuse(_chain(into, h))
            self.spend(PROBE_STEP * (probes(into) - before), f"{what} sharing a hash with earlier keys")

    def hashed_items(self, v: object, into: _Node | None, what: str) -> None:
        """Every item of `v` is hashed (set(v), dict.fromkeys(v), Counter(v)); `into` gets them."""
        if isinstance(v, _Node):
            if v.idepth > MAX_HASH_DEPTH:
                self.refuse(f"{what} of items nested {v.idepth} deep: hashing them recurses in C without a limit")
            if isinstance(v, _Seq) and v.chains is None and not self.over:  # a tuple's, counted now
                v.chains = {}
                for x in v.items:
                    _c, _d, h = hash_of(x)
                    if _collides(x, h):
                        _chain(v, h)
            self.spend(min(v.icost + PROBE_STEP * probes(v), _SAT), what)  # every item re-inserted, re-probed
            worst = _worst(v.chains)
            self.refuse(worst and f"{what} of {worst}")
            if into is not None and not self.over:
                into.chains = v.chains  # shared, not copied: the scan stays linear (a later fill over-counts both)
                into.icost, into.idepth, into.n = v.icost, v.idepth, v.n
        elif isinstance(v, (_Str, _Bytes)):
            self.spend(len(v), what)

    # --- what opcodes, calls and restores do ---------------------------------------------------------
    def filled(self, opname: str, target: object, items: list[object]) -> None:
        """SETITEM(S) / APPEND(S) / ADDITEMS / FROZENSET of `items` into `target` (the scan admitted it)."""
        if not isinstance(target, _Node):
            return
        if opname in ("SETITEM", "SETITEMS"):
            for i in range(0, len(items) - 1, 2):
                self.hashed(items[i], target, f"{opname} key")
                self.keyed(target, items[i], items[i + 1])
            self.take(48 * (len(items) // 2), opname)
            return
        hashes = opname in ("ADDITEMS", "FROZENSET")
        for x in items if hashes else ():
            self.hashed(x, None, f"{opname} item")
        before = probes(target)
        why = add_items(target, items)
        if hashes:
            self.refuse(why)
            self.spend(PROBE_STEP * (probes(target) - before), f"{opname} items sharing a hash")
        self.take((32 if hashes else 9) * len(items), opname)

    @staticmethod
    def keyed(d: _Node, key: object, value: object) -> None:
        """A dict's facts after `d[key] = value`: its keys' hashing, and its values' (an instance restored
        from it is hashed by them)."""
        c, depth, _h = hash_of(key)
        d.n += 1
        d.icost, d.idepth = min(d.icost + c, _SAT), max(d.idepth, depth)
        if isinstance(d, _Dict):
            c, depth, h = hash_of(value)
            d.vcost, d.vdepth = min(d.vcost + c, _SAT), max(d.vdepth, depth)
            d.vrandom = d.vrandom or h is _RANDOM
            d.vn = min(d.vn + (value.n if isinstance(value, _Node) else 0), _SAT)  # copied by `{**value}`

    def copied(self, what: str, cls: type, arg: object, into: _Obj) -> str | None:
        """`cls(arg)` builds `into` from `arg`'s items: what it allocates and hashes; why it is refused."""
        if cls is str:
            if not isinstance(arg, (_Str, _Bytes, _Num)):
                return f"{what} of a container or an object: str() of one is its repr (a shared tuple's is 2**k long)"
            self.take(49 + 4 * (_length(arg) or 0), what)
            return None
        if issubclass(cls, (int, float, complex)) and isinstance(arg, (_Str, _Bytes)):
            self.spend(len(arg), what)  # parsed
            return None
        own = _OWN_ITERATING.get(f"{cls.__module__}.{cls.__qualname__}")
        if own is None and not (_builtin_owner(_owner(cls, "__new__")) and _builtin_owner(_owner(cls, "__init__"))):
            return None  # a data class: it stores its arguments
        per = next((b for t, b in _PER_ITEM if issubclass(own or cls, t)), None)
        if per is None or isinstance(arg, _Num):
            return None  # not a container, or a number (bytes(n) is refused by the call rules)
        n = _length(arg)
        if n is None:
            return f"{what} of {type(arg).__name__.strip('_').lower()}: it iterates something the scan cannot size"
        if isinstance(arg, _Str) and issubclass(cls, (bytes, bytearray)):
            n *= 4  # encoded: up to 4 bytes a character
        mapping = isinstance(arg, _Dict) or (isinstance(arg, _Obj) and issubclass(arg.cls, dict))
        if issubclass(cls, dict) and not issubclass(cls, collections.Counter) and not mapping and n > MAX_PAIRS:
            return f"{what} of {n} pairs from an iterable: only from a mapping (pickle fills a dict by SETITEMS)"
        self.take(64 + per * n, f"{what} copying a value of {n} items")
        into.n = n
        if issubclass(own or cls, (set, frozenset, dict)):
            self.hashed_items(arg, into, what)
        elif isinstance(arg, _Node) and not self.over:
            into.icost, into.idepth, into.chains = arg.icost, arg.idepth, arg.chains
        return None

    def built(self, obj: _Obj, state: object, torch_restore: bool) -> str | None:
        """BUILD of `obj` from `state` (the scan admitted it): the copy into its `__dict__` (a torch restore
        may copy the state's values too: TritonCompileResult's `{**state["kernel"]}`), OrderedSet's
        `dict.fromkeys(state)`, and the fields an instance hashed by them now has."""
        name = f"{obj.cls.__module__}.{obj.cls.__qualname__}"
        if torch_restore and name == "torch.utils._ordered_set.OrderedSet":
            self.hashed_items(state, obj, f"{name}.__setstate__")
        parts = state.items if isinstance(state, _Seq) and not torch_restore else [state]
        for p in parts:
            n = _length(p) or 0
            extra = p.vn if torch_restore and isinstance(p, _Dict) else 0
            kernel = (p.named or {}).get("kernel") if torch_restore and isinstance(p, _Dict) else None
            if isinstance(kernel, _Dict):  # TritonCompileResult: `{**state["kernel"]}`, its metadata as a namedtuple
                extra += kernel.vn
            self.take(104 + 48 * (n + extra), f"BUILD of {name} from a state of {n} items")
        return self.fields(obj, [state] if torch_restore else [p for p in parts if isinstance(p, _Dict)])

    @staticmethod
    def fields(obj: _Obj, parts: list[object]) -> str | None:
        """`obj`, if hashed by its fields, now holds `parts` (constructor arguments, a restore's state):
        what hashing it costs. Why not, if something already holds it and counted what it cost then."""
        if hash_kind(obj.cls) != "fields":
            return None
        cost, depth, rnd = obj.icost, obj.idepth, obj.h is _RANDOM
        for p in parts:
            if isinstance(p, _Dict):
                c, d, r = p.vcost, p.vdepth, p.vrandom
            elif isinstance(p, (_Seq, _List)):  # a dataclass restore's tuple or list: its items are the fields
                c, d, r = p.icost, p.idepth, p.h is _RANDOM
            else:
                c, d, h = hash_of(p)
                r = h is _RANDOM
            if obj.held and (d > 0 or c > max(_length(p) or 1, 1)):
                return (f"BUILD of {obj.cls.__module__}.{obj.cls.__qualname__} after something holds it, with fields "
                        "that are tuples or objects: what hashing its holders costs would change unseen")
            cost, depth, rnd = min(cost + c, _SAT), max(depth, d), rnd or r
        obj.icost, obj.idepth, obj.h = cost, depth, (_RANDOM if rnd else _UNKNOWN)
        return None

    def post_init(self, what: str, items: list[object]) -> str | None:
        """A torch data class's own `__post_init__` runs on its arguments (`"." in member`, `ConstantVariable.
        is_literal(index)`, a walk of every tuple, list and set in it): each call anew, so a memo'd argument
        walked k times costs k times its size. Charged as its strings' length and its tuples' size."""
        for x in items:
            if isinstance(x, (_Str, _Bytes)):
                self.spend(len(x) // 16, what)
            elif isinstance(x, _Seq) and not x.mutable:
                self.spend(PY_STEP * x.icost, what)
            elif isinstance(x, (_Seq, _List, _Dict, _Set)) or (isinstance(x, _Obj) and issubclass(x.cls, (list, dict, set))):
                return f"{what} of a list, dict or set: its __post_init__ walks it, each call anew"
        return None

    def storage(self, pid: object, seen: set[str]) -> str | None:
        """torch.load's persistent_load of a legacy storage id ('storage', type, key, location, numel, ...):
        `torch.UntypedStorage(numel * element size)`, once per key."""
        items = pid.items if isinstance(pid, _Seq) else None
        if not (items and len(items) >= 5 and items[0] == "storage" and isinstance(items[4], _Num)
                and isinstance(items[4].value, int) and items[4].value >= 0):
            return "a torch.save persistent id whose storage size the scan cannot see (torch.load allocates it)"
        key = str(items[2]) if isinstance(items[2], _Str) else None
        if key is None or key not in seen:
            seen.add(key or "")
            name = str(items[1]).rsplit(".", 1)[-1].removesuffix("Storage")
            self.take(items[4].value * _STORAGE_ITEM.get(name, 16), f"a storage of {items[4].value} elements")
        return None

    def sympy(self, cls: type, args: object, into: _Obj | None = None) -> None:
        """A sympy constructor: its evaluation, and sympy's cache hashing its arguments."""
        n = len(args.items) if isinstance(args, _Seq) else 1
        quadratic = _import_attr("sympy.functions.elementary.miscellaneous.MinMaxBase"), \
            _import_attr("sympy.logic.boolalg.Exclusive")
        steps = SYMPY_STEP * (n + 1) + PY_STEP * (args.icost if isinstance(args, _Seq) else 0) + (
            SYMPY_PAIR * n * n if issubclass(cls, tuple(q for q in quadratic if isinstance(q, type))) else 0)
        self.spend(steps, f"{cls.__module__}.{cls.__qualname__} of {n} arguments")
        one = args.items[0] if isinstance(args, _Seq) and n == 1 else None
        sympy = sys.modules.get("sympy")
        if into is not None and sympy is not None and issubclass(cls, sympy.Integer) and isinstance(one, _Num) \
                and isinstance(one.value, int):
            into.h = one.h  # Integer.__hash__ is hash(self.p): a key the pickle may aim
        self.hashed(args, None, f"{cls.__qualname__}'s arguments")
        self.take(64 + 8 * n, "a sympy object")
