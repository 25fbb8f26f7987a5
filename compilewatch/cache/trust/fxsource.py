"""Is a string the Python source of an FX graph, and nothing else? (`picklescan`'s check of the one
source-executing call torch's cache pickles make.)

An AOTAutograd entry rebuilds each GraphModule it holds with `torch.fx.graph_module.reduce_graph_module
(body, import_block)`, which executes `import_block + body["_code"]` (`_forward_from_src`) while the
entry is unpickled. FX writes that source itself (`torch.fx.graph.PythonCode`): a fixed import block
(`import torch`, `from math import inf`, `NoneType = type(None)`, pytree aliases) and `def forward(self,
...)` of straight-line assignments of calls: `torch.ops.aten.sin.default(x_1)`, `self.sdpa_score0`,
`operator.getitem(t, 0)`, arithmetic on sizes. `check` parses it with `ast` (nothing runs) and admits
exactly that shape: imports of those modules only, function definitions, assignments, calls of names
bound there or of attributes of them, constants and arithmetic. Refused: any other import or
statement kind (loops, `with`, classes, lambdas, comprehensions), a dunder anywhere, builtins that
evaluate, import, open or reach attributes by computed name, and attributes that load code or
libraries (`load_library`, `load_inline`, `load`, `system`, ...), and torch's own loaders reachable as
attributes of `torch` (`torch.storage._load_from_bytes` is `torch.load`; `torch._inductor`,
`torch._dynamo`, `torch.utils`, `torch.serialization` are refused whole, and any attribute whose name
says it loads, executes, imports, writes or runs a command).

This stops a pickle from executing arbitrary source while it is unpickled. It does not make an entry
safe to use: an FX-graph entry also carries the generated module torch imports on a cache hit
(docs/security.md: an archive is code).
"""

from __future__ import annotations

import ast

MAX_SOURCE = 16 << 20
_IMPORTS = {"torch", "math", "operator", "torch.fx._pytree", "torch.utils._pytree", "builtins"}
_FROM_IMPORTS = {"math": {"inf", "nan", "pi"}, "torch": {"device", "dtype", "Size"}, "builtins": {"getattr"}}
_BUILTINS = {"getattr", "len", "int", "float", "bool", "tuple", "list", "dict", "slice", "range", "isinstance",
             "type", "max", "min", "abs", "sum", "None", "True", "False", "print", "str"}
_DENY_ATTRS = {"load_library", "load_inline", "load", "loads", "import_module", "system", "popen", "spawn",
               "exec", "eval", "compile", "cpp_extension", "jit", "hub", "package", "CDLL", "cdll", "LoadLibrary",
               "_load_library", "open", "remove", "rmtree", "unlink", "write_text", "write_bytes", "setattr",
               "save", "subprocess", "os", "sys", "ctypes", "builtins", "importlib",
               # torch's own loaders, compilers and unpicklers, reachable as attributes of `torch`:
               # `torch.storage._load_from_bytes` is torch.load, `torch._inductor.cpp_builder` runs commands
               "storage", "serialization", "_utils", "utils", "_inductor", "_dynamo", "_export", "export",
               "classes", "_classes", "multiprocessing", "from_file", "fromfile", "tofile", "environ"}
# ... and any attribute whose name says it loads, executes, imports, writes or runs a command
_DENY_PARTS = ("load", "exec", "eval", "compile", "import", "system", "spawn", "popen", "library", "pickle",
               "marshal", "cmd", "subprocess", "write", "remove", "unlink", "rmtree", "rename", "chmod", "symlink")
_EXPR_NODES = (ast.Name, ast.Constant, ast.Attribute, ast.Subscript, ast.Slice, ast.Tuple, ast.List, ast.Dict,
               ast.Set, ast.Call, ast.keyword, ast.Starred, ast.UnaryOp, ast.BinOp, ast.Compare, ast.BoolOp,
               ast.IfExp, ast.Load, ast.Store, ast.Del, ast.unaryop, ast.operator, ast.cmpop, ast.boolop,
               ast.arguments, ast.arg, ast.alias)
_STMT_NODES = (ast.Module, ast.Import, ast.ImportFrom, ast.FunctionDef, ast.Assign, ast.AnnAssign, ast.Expr,
               ast.Return, ast.Delete, ast.Pass)
_cache: dict[str, str | None] = {}


def check(source: str) -> str | None:
    """None when `source` is FX-shaped Python (module docstring), else why not. Results are cached
    per string, so a pickle that rebuilds one graph many times costs one parse."""
    if source in _cache:
        return _cache[source]
    why = _check(source)
    if len(_cache) < 4096:
        _cache[source] = why
    return why


def _check(source: str) -> str | None:
    if len(source) > MAX_SOURCE:
        return f"FX source of {len(source)} characters"
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return f"FX source that does not parse ({type(e).__name__})"
    bound = set(_BUILTINS)
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name not in _IMPORTS:
                    return f"FX source imports {a.name}"
                bound.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            allowed = _FROM_IMPORTS.get(node.module or "", set())
            for a in node.names:
                if a.name not in allowed:
                    return f"FX source imports {a.name} from {node.module}"
                bound.add(a.asname or a.name)
        elif isinstance(node, ast.FunctionDef):
            bound.add(node.name)
            if node.decorator_list:
                return "FX source with a decorator"
            for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs,
                      *(x for x in (node.args.vararg, node.args.kwarg) if x)]:
                bound.add(a.arg)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in ast.walk(node):
                if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store):
                    bound.add(t.id)
        elif not isinstance(node, (ast.Expr, ast.Pass)):
            return f"FX source with a top-level {type(node).__name__}"
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for t in ast.walk(node):
                if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store):
                    bound.add(t.id)
                elif isinstance(t, ast.arg):
                    bound.add(t.arg)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and node not in tree.body:
            return "FX source that imports inside a function"
        if not isinstance(node, _STMT_NODES + _EXPR_NODES):
            return f"FX source with {type(node).__name__}"
        if isinstance(node, ast.Name):
            if node.id.startswith("__") or node.id not in bound:
                return f"FX source that uses the name {node.id!r}"
        elif isinstance(node, ast.Attribute):
            if _denied(node.attr):
                return f"FX source that reaches .{node.attr}"
        elif isinstance(node, ast.Call):
            f = node.func
            while isinstance(f, ast.Attribute):
                f = f.value
            if not isinstance(f, ast.Name):
                return "FX source that calls a computed object"
            if isinstance(node.func, ast.Name) and node.func.id == "getattr":
                name = node.args[1] if len(node.args) >= 2 else None
                if not (isinstance(name, ast.Constant) and isinstance(name.value, str)
                        and not _denied(name.value)):
                    return "FX source with getattr of a computed or special name"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("__"):
            return "FX source with a dunder string"
    return None


def _denied(attr: str) -> bool:
    low = attr.lower()
    return attr.startswith("__") or attr in _DENY_ATTRS or any(p in low for p in _DENY_PARTS)
