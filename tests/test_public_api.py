"""compilewatch's public API is declared in one place (compilewatch/__init__.py) and frozen here.
(The arrows between the floors are checked in tests/test_layering.py.)

Changing a name or a parameter below is a deliberate act: update SURFACE in the same commit and say
why (dflash and users' scripts rely on these). Everything under the sub-packages is internal.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import types
from pathlib import Path

import compilewatch

ROOT = Path(__file__).resolve().parents[1]

# name -> kind and parameters: `name=` has a default, `*` starts keyword-only ones
SURFACE = {
    "__version__": "str",
    "BadInput": "class(message, *, hint=)",
    "CheckFailed": "class(message, *, hint=)",
    "CompilewatchError": "class(message, *, hint=)",
    # trace & threads
    "watch": "function(report=, *, stall_after=, repair=, on_event=, timeline=)",
    "Watcher": "class(report=, *, stall_after=, repair=, on_event=, timeline=, record_traces=)",
    "guard": "module",
    "CompileGuard": "class(*, thread_local=, serialize=)",
    "GuardError": "class(message, *, hint=)",
    "Frame": "class(file, line, function, code=)",
    "current_stack": "function(skip=)",
    "all_thread_stacks": "function()",
    # devices
    "normalize_device": "function(spec)",
    "parse_device": "function(spec)",
    "parse_devices": "function(specs)",
    "prewarm": "function(devices, fn, *, verify=, strict=, steps=, progress=, name=, verify_only=)",
    "WarmReport": "class(workload, devices, torch_version, cache_dir, warm, verify, strict, wall_s, ok, verdicts)",
    "sample_gpus": "function()",
    "low_outliers": "function(values, ratio=)",
    # warm workloads: the plugin API
    "Workload": "protocol(build, name, run)",
    "WorkloadOptions": "class(backend=, shape=)",
    "FlexShape": "class(context=, blocks=, block_size=, heads=, head_dim=, batch=, dtype=)",
    "FlexAttentionWorkload": "class(backend=, shape=, *, backward=, compile_once=, name=)",
    # environment
    "inductor_cache_dir": "function()",
    "system_key": "function()",
    "cpu_info": "function(cpuinfo=)",
    # cache
    "fingerprint": "function(path=, *, files=, use_index=, workers=, progress=)",
    "enable_remote_cache": "function(url)",
    "remote_cache_usage": "function(env=, *, counts=, probe=)",
    # files, untrusted input, JSON
    "FILE_MODE": "int",
    "atomic_write_bytes": "function(target, data)",
    "atomic_write_text": "function(target, text)",
    "atomic_write_json": "function(target, data, *, indent=)",
    "check_writable": "function(target)",
    "same_file": "function(a, b)",
    "nearest_existing": "function(path)",
    "read_text": "function(path, *, limit=, what=)",
    # dflash's checkpoint files: opened non-blocking, type checked on the fd (was a copy in dflash)
    "open_untrusted": "function(path, what=, *, streams=)",
    "loads_json": "function(text, where)",
    "loads_toml": "function(text, path)",
    "one_line": "function(text, width=)",
    "dataclass_from_json": "function(cls, data, where, path=)",
    "to_jsonable": "function(obj)",
}


def _params(obj) -> str:
    out, kw_only = [], False
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.VAR_POSITIONAL or p.kind is p.VAR_KEYWORD:
            out.append(("*" if p.kind is p.VAR_POSITIONAL else "**") + p.name)
            continue
        if p.kind is p.KEYWORD_ONLY and not kw_only:
            out.append("*")
            kw_only = True
        out.append(p.name + ("=" if p.default is not p.empty else ""))
    return "(" + ", ".join(out) + ")"


def _describe(value) -> str:
    if isinstance(value, types.ModuleType):
        return "module"
    if inspect.isclass(value) and getattr(value, "_is_protocol", False):  # a typing.Protocol: its members
        members = set(vars(value).get("__annotations__", {})) | set(vars(value))
        return "protocol(" + ", ".join(sorted(m for m in members if not m.startswith("_"))) + ")"
    if inspect.isclass(value):
        return "class" + _params(value)
    if callable(value):
        return "function" + _params(value)
    return type(value).__name__


def test_surface_is_frozen():
    assert list(compilewatch.__all__) == list(SURFACE), "compilewatch.__all__ changed: update SURFACE deliberately"
    got = {name: _describe(getattr(compilewatch, name)) for name in compilewatch.__all__}
    assert got == SURFACE


def test_unknown_name_is_an_attribute_error():
    try:
        compilewatch.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("compilewatch.no_such_name resolved")


def test_import_is_light():
    # the public names load on first use: importing compilewatch (and reading an error class) needs no torch
    code = "import sys, compilewatch; compilewatch.BadInput; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def _compilewatch_imports(path: Path):
    """(line, what) for every use of compilewatch in a file that is not a public top-level name."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "compilewatch":
            if node.module != "compilewatch":
                yield node.lineno, f"from {node.module} import ..."
            else:
                for alias in node.names:
                    if alias.name not in SURFACE:
                        yield node.lineno, f"from compilewatch import {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("compilewatch."):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "compilewatch":
            if node.attr not in SURFACE:
                yield node.lineno, f"compilewatch.{node.attr}"


def test_dflash_uses_only_the_public_api():
    found = [f"{p.relative_to(ROOT)}:{line}: {what}"
             for p in sorted((ROOT / "dflash").rglob("*.py")) for line, what in _compilewatch_imports(p)]
    assert found == [], "dflash reaches into compilewatch's internals:\n" + "\n".join(found)


def test_the_checker_sees_internal_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import compilewatch\nfrom compilewatch.tracing import stacks\nfrom compilewatch import atomic_write_text\n"
                 "import compilewatch.env.lock\ncompilewatch.watch\ncompilewatch.tracing\n")
    assert [w for _, w in _compilewatch_imports(f)] == [
        "from compilewatch.tracing import ...", "import compilewatch.env.lock", "compilewatch.tracing"]

