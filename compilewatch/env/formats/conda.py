"""conda: `environment.yml` (conda env export / hand-written, YAML) and `conda list --explicit`.

conda names are mapped to PyPI names where they differ for what matters here (`pytorch` -> `torch`);
`python` becomes the environment's Python version, not a package. The conda build string is kept:
PyTorch's conda builds carry the CUDA flavour there (`py3.12_cuda12.4_cudnn9.1.0_0`,
`cuda128_mkl_py312_h...`), and the diff reads it from there when the version has no local label.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from urllib.parse import unquote, urlsplit

from packaging.utils import canonicalize_name

from compilewatch.env.formats.model import EnvSpec, Package, bad_line, line_of
from compilewatch.env.formats.requirements import parse_requirements
from compilewatch.inputs import one_line

CONDA_TO_PYPI = {"pytorch": "torch", "pytorch-gpu": "torch", "pytorch-cpu": "torch"}
_SPEC = re.compile(r"^(?:(?P<channel>[^\s:]+)::)?(?P<name>[A-Za-z0-9_.\-]+)\s*(?P<rest>.*)$")
_ARCHIVE = re.compile(r"^(?P<name>.+)-(?P<version>[^-]+)-(?P<build>[^-]+)\.(?:conda|tar\.bz2)$")


MAX_YAML_NODES = 1_000_000  # values after alias expansion; a real environment.yml has a few hundred
MAX_YAML_BYTES = 64 << 20  # characters of those values: one aliased 100 KB string used 10^4 times is refused


def load_yaml(text: str, path: str):
    """yaml.safe_load, refusing documents whose aliases expand past MAX_YAML_NODES values or
    MAX_YAML_BYTES characters of scalars (a "billion laughs" file is a few hundred bytes that expand
    to 10^9 strings; a 1 MB file aliasing one long string expands to GBs once anything joins it)."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        raise bad_line(path, mark.line + 1 if mark else None, f"invalid YAML: {one_line(problem, 200)}") from None
    nodes, chars = _expanded_size(data, {})
    if nodes > MAX_YAML_NODES or chars > MAX_YAML_BYTES:
        what = f"{MAX_YAML_NODES:,} values" if nodes > MAX_YAML_NODES else f"{MAX_YAML_BYTES >> 20} MiB of text"
        raise bad_line(path, None, f"YAML aliases expand to more than {what}: refused",
                       hint="an environment file does not need anchors and aliases (`&x` / `*x`)")
    return data


def _expanded_size(obj, memo: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """(values, characters of scalars) `obj` holds once every shared (aliased) node is counted each
    time it is used. Linear in the number of distinct nodes; stops counting past either limit."""
    if not isinstance(obj, (list, dict)):
        return 1, len(obj) if isinstance(obj, (str, bytes)) else 8
    key = id(obj)
    if key in memo:
        return memo[key]
    memo[key] = (MAX_YAML_NODES + 1, 0)  # a node that contains itself (a recursive alias) is refused
    items = obj.items() if isinstance(obj, dict) else ((None, v) for v in obj)
    nodes, chars = 1, 8
    for k, v in items:
        kn, kc = _expanded_size(k, memo)
        vn, vc = _expanded_size(v, memo)
        nodes += kn + vn
        chars += kc + vc
        if nodes > MAX_YAML_NODES or chars > MAX_YAML_BYTES:
            break
    memo[key] = (nodes, chars)
    return nodes, chars


def parse_environment_yml(text: str, path: str) -> EnvSpec:
    data = load_yaml(text, path)
    if not isinstance(data, dict) or not isinstance(data.get("dependencies"), list):
        raise bad_line(path, 1, "not a conda environment file: expected a `dependencies:` list",
                       hint="`conda env export > environment.yml` writes one")
    packages: list[Package] = []
    notes: list[str] = []
    python = None
    for item in data["dependencies"]:
        if isinstance(item, dict) and "pip" in item:
            pip_lines = item["pip"] or []
            if not isinstance(pip_lines, list):
                raise bad_line(path, line_of(text, "pip:"), "`pip:` must be a list of requirements")
            pip_env = parse_requirements("\n".join(map(str, pip_lines)), f"{path} (pip section)")
            packages.extend(pip_env.packages)
            notes.extend(pip_env.notes)
            continue
        if not isinstance(item, str):
            raise bad_line(path, line_of(text, one_line(item, 80).split(":")[0].strip("{'\" ")),
                           f"dependency {one_line(repr(item), 120)} is neither a conda spec nor a `pip:` list")
        pkg = _conda_spec(item, path, line_of(text, item))
        if pkg.name == "python":
            python = pkg.version or pkg.spec
        else:
            packages.append(pkg)
    return EnvSpec(path=path, format="conda-yaml", packages=tuple(packages), python=python, notes=tuple(notes))


def _conda_spec(spec: str, path: str, line: int | None) -> Package:
    """'pytorch=2.5.1=py3.12_cuda12.4_cudnn9.1.0_0', 'numpy>=1.26', 'conda-forge::triton 3.1.0 h1_0'."""
    m = _SPEC.match(spec.strip())
    if not m:
        raise bad_line(path, line, f"not a conda package spec: {spec!r}")
    name = _name(m.group("name"))
    rest = m.group("rest").strip()
    version = build = specifier = None
    if not rest:
        pass
    elif rest.startswith("=="):
        version = rest[2:].strip()
    elif rest.startswith("=") or " " in rest:
        parts = [p for p in re.split(r"[=\s]+", rest) if p]
        version = parts[0] if parts else None
        build = parts[1] if len(parts) > 1 else None
        if version and "*" in version:  # "=1.26.*": a pattern, not a pin
            version, specifier = None, f"={parts[0]}"
    elif rest[0] in "<>!~":
        specifier = rest
    else:
        raise bad_line(path, line, f"cannot read the version of conda spec {spec!r}")
    return Package(name=name, version=version, spec=specifier, build=build)


def parse_conda_explicit(text: str, path: str) -> EnvSpec:
    packages: list[Package] = []
    python = None
    seen_explicit = False
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line == "@EXPLICIT":
            seen_explicit = True
            continue
        if not seen_explicit:
            raise bad_line(path, lineno, "expected @EXPLICIT before the package URLs",
                           hint="`conda list --explicit` writes it")
        url = line.split("#")[0]
        filename = unquote(PurePosixPath(urlsplit(url).path).name)
        m = _ARCHIVE.match(filename)
        if "://" not in url or not m:
            raise bad_line(path, lineno, f"not a conda package URL: {line!r}",
                           hint="expected CHANNEL/SUBDIR/NAME-VERSION-BUILD.conda (or .tar.bz2)")
        name = _name(m.group("name"))
        if name == "python":
            python = m.group("version")
            continue
        packages.append(Package(name=name, version=m.group("version"), build=m.group("build")))
    if not seen_explicit:
        raise bad_line(path, 1, "no @EXPLICIT line: not a `conda list --explicit` file")
    return EnvSpec(path=path, format="conda-explicit", packages=tuple(packages), python=python)


def _name(conda_name: str) -> str:
    name = canonicalize_name(conda_name)
    return CONDA_TO_PYPI.get(name, name)
