"""What an FX graph's source computes on its own constants while it is unpickled (session 15).

`torch.fx.graph_module.reduce_graph_module(body, import_block)` executes the source `fxsource` admitted,
then FX re-traces `forward` with proxies for its arguments. What does not touch a proxy runs for real,
during `pickle.loads`: `"a" * 10**9` (1 GB), `10 ** 10 ** 8` or `sum(range(10**12))` (hours of CPU), and
a torch op on constants, `torch.ops.aten.full.default([16384, 16384], 1.0)` (1 GiB), all in a pickle of
a few hundred bytes that the scan passed. Real FX source computes on proxies, and calls ops on small
constant shapes (`full([8, 16], 0)`).

`check` follows the source's names in order: a function argument (and `self`, the module) is traced;
a name bound to an expression over traced names is traced, one bound to constants is evaluated here
with bounds (numbers of at most MAX_BITS bits, strings and sequences of at most MAX_LEN items), one
bound to a torch call on constants is a real tensor of the size its constant shapes give. It returns
why the source computes too much, or the bytes its eager calls allocate (`loadcost` charges them).
"""

from __future__ import annotations

import ast
import math

MAX_BITS = 256  # an int a constant expression may make (FX source: shapes, dims, small scalars)
MAX_LEN = 1 << 20  # a string, bytes, list or range a constant expression may make or walk
_TRACED = object()  # depends on a proxy: FX records it, nothing runs
_UNKNOWN = object()  # a constant the scan does not evaluate (a module, an attribute, a comparison)


class _Tensor:
    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class _Len:
    """A constant string, bytes, tuple or range of `n` items: kept as its length (the scan makes none)."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n


class _TooMuch(Exception):
    pass


_cache: dict[str, tuple[str | None, int]] = {}


def check(source: str) -> tuple[str | None, int]:
    """(why the source computes too much on constants, or None; the bytes its eager torch calls allocate).
    Cached per string, like fxsource's check: a graph rebuilt many times is followed once."""
    if source not in _cache:
        got = _check(source)
        if len(_cache) >= 4096:
            return got
        _cache[source] = got
    return _cache[source]


def _check(source: str) -> tuple[str | None, int]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None, 0  # fxsource refused it already
    ev = _Eval()
    try:
        ev.block(tree.body, set())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                traced = {a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs,
                                          *(x for x in (node.args.vararg, node.args.kwarg) if x)]}
                ev.block(node.body, traced)
    except _TooMuch as e:
        return f"FX source that computes on its own constants while it is traced: {e}", ev.alloc
    except RecursionError:
        return "FX source nested too deep to follow", ev.alloc
    return None, ev.alloc


class _Eval:
    def __init__(self) -> None:
        self.env: dict[str, object] = {}
        self.alloc = 0

    def block(self, body: list[ast.stmt], traced: set[str]) -> None:
        self.env = {name: _TRACED for name in traced}
        for st in body:
            if isinstance(st, (ast.Assign, ast.AnnAssign)):
                value = self.expr(st.value) if st.value is not None else _UNKNOWN
                for t in st.targets if isinstance(st, ast.Assign) else [st.target]:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            self.env[n.id] = value if isinstance(t, ast.Name) else (
                                _TRACED if value is _TRACED else _UNKNOWN)
            elif isinstance(st, (ast.Expr, ast.Return)) and st.value is not None:
                self.expr(st.value)

    def expr(self, e: ast.AST) -> object:
        if isinstance(e, ast.Constant):
            return e.value
        if isinstance(e, ast.Name):
            return self.env.get(e.id, _UNKNOWN)
        if isinstance(e, (ast.Tuple, ast.List)):
            items = [self.expr(x) for x in e.elts]
            return _TRACED if any(x is _TRACED for x in items) else tuple(items)
        if isinstance(e, ast.UnaryOp):
            v = self.expr(e.operand)
            return -v if isinstance(e.op, ast.USub) and isinstance(v, (int, float)) else (
                _TRACED if v is _TRACED else _UNKNOWN)
        if isinstance(e, ast.BinOp):
            return self.binop(e.op, self.expr(e.left), self.expr(e.right))
        if isinstance(e, ast.Call):
            return self.call(e)
        parts = [self.expr(x) for x in ast.iter_child_nodes(e) if isinstance(x, ast.expr)]
        if any(p is _TRACED for p in parts):
            return _TRACED
        return _UNKNOWN  # attributes, subscripts, comparisons of constants: small

    def binop(self, op: ast.operator, a: object, b: object) -> object:
        if a is _TRACED or b is _TRACED:
            return _TRACED
        tensors = [x.nbytes for x in (a, b) if isinstance(x, _Tensor)]
        if tensors:  # an op on a real tensor: another of its size
            self.alloc += max(tensors)
            return _Tensor(max(tensors))
        seqs = (str, bytes, tuple, _Len)
        if isinstance(a, bool) or isinstance(b, bool) or not all(isinstance(x, (int, float, *seqs)) for x in (a, b)):
            return _UNKNOWN
        if isinstance(a, int) and isinstance(b, int):
            bits = {ast.Pow: max(a.bit_length(), 1) * max(b, 0), ast.Mult: a.bit_length() + b.bit_length(),
                    ast.LShift: a.bit_length() + max(b, 0)}.get(type(op), max(a.bit_length(), b.bit_length()) + 1)
            if bits > MAX_BITS:
                raise _TooMuch(f"an int of ~{bits} bits")
        elif isinstance(a, seqs) or isinstance(b, seqs):  # a sequence made: its length, and it is allocated
            n = _size(a) * b if isinstance(op, ast.Mult) and isinstance(b, int) else _size(b) * a if isinstance(
                op, ast.Mult) and isinstance(a, int) else _size(a) + _size(b) if isinstance(op, ast.Add) else None
            if n is None:
                return _UNKNOWN
            if n > MAX_LEN:
                raise _TooMuch(f"a sequence of {n} items")
            self.alloc += max(n, 0)
            if n > 64 or isinstance(a, _Len) or isinstance(b, _Len):
                return _Len(max(n, 0))
        try:
            return _binop(op, a, b)
        except (TypeError, ValueError, ZeroDivisionError, OverflowError):
            return _UNKNOWN

    def call(self, e: ast.Call) -> object:
        func = self.expr(e.func) if not isinstance(e.func, (ast.Name, ast.Attribute)) else None
        if func is _TRACED:
            return _TRACED
        root = e.func
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and self.env.get(root.id) is _TRACED:
            return _TRACED  # a method of a proxy, `self.submodule(...)`
        args = [self.expr(a.value if isinstance(a, ast.Starred) else a) for a in e.args]
        args += [self.expr(k.value) for k in e.keywords]
        if any(a is _TRACED for a in args):
            return _TRACED
        name = root.id if isinstance(root, ast.Name) else ""
        if isinstance(e.func, ast.Name) and name in ("range", "list", "tuple", "sum", "max", "min", "dict", "str",
                                                     "sorted", "set", "print", "len", "bool", "int", "float", "abs"):
            if name == "range":
                ints = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
                ok = len(ints) == len(args) and 1 <= len(ints) <= 3 and (len(ints) < 3 or ints[2] != 0)
                return _Len(len(range(*ints))) if ok else _UNKNOWN
            n = max([_size(a) for a in args] or [0])
            if n > MAX_LEN:
                raise _TooMuch(f"{name}() over {n} items")
            self.alloc += 8 * n
            return _Len(n) if name in ("list", "tuple", "sorted", "str") else _UNKNOWN
        if name == "torch" or any(isinstance(a, _Tensor) for a in args):
            nbytes = 8 * max([_elements(a) for a in args] or [0])  # a factory's shape, an op's input
            nbytes = max([nbytes, *(a.nbytes for a in args if isinstance(a, _Tensor))])
            self.alloc += nbytes
            return _Tensor(nbytes)
        return _UNKNOWN


def _size(v: object) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return 0
    if isinstance(v, (str, bytes, tuple)):
        return len(v)
    return v.n if isinstance(v, _Len) else 0


def _elements(v: object) -> int:
    """How many elements a torch factory makes of this argument: a shape's product, or a size."""
    if isinstance(v, bool):
        return 0
    if isinstance(v, int):
        return max(v, 0)
    if isinstance(v, tuple) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return math.prod(max(x, 0) for x in v)
    return 0


def _binop(op: ast.operator, a: object, b: object) -> object:
    import operator

    fn = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
          ast.Mod: operator.mod, ast.Pow: operator.pow, ast.LShift: operator.lshift, ast.RShift: operator.rshift,
          ast.Div: operator.truediv, ast.BitAnd: operator.and_, ast.BitOr: operator.or_,
          ast.BitXor: operator.xor}.get(type(op))
    if fn is None or (isinstance(a, str) and isinstance(op, ast.Mod)):
        return _UNKNOWN  # `"%s" % x` formats: not evaluated here
    return fn(a, b)
