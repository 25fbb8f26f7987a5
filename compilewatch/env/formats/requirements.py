"""`pip freeze` output and requirements.txt files, read with packaging.requirements.

Handles what real files hold: `name==version` (local labels like `+cu128` kept), `name @ URL`
(`file://` wheels, VCS URLs), `-e PATH` / `-e VCS_URL#egg=name` (the name taken from the egg
fragment or from the comment pip freeze writes above it), per-requirement `--hash` options, global
options (`-i`, `--extra-index-url`, `-f`, `--pre`, ...), `-r`/`-c` (noted, not followed), markers,
comments and `\\` line continuations.

Every line pip accepts is read, also those that name no package: `.`, `./pkg`, `dist/x.whl`,
`-e .`, `git+https://host/repo.git` (no `#egg=`), `bzr+lp:project`, `https://host/x.tar.gz`. A wheel
or sdist file name gives the name and version; a VCS URL gives a name guessed from the repository
(pip would build it to know); anything else becomes an entry named `<kind>:<source>` (kinds
`local`, `url`, `vcs`), compared by its source. A line pip would reject is skipped with a note naming
file:line, and the rest of the file is still read; a file in which no line, or fewer than half of
the lines, are requirements is BadInput: it is not a requirements file (20 KB of random printable
characters hold a few hundred lines that happen to parse: a one-letter name, a "path"). A path must
look like one (no spaces, quotes or shell punctuation), `name @ URL` needs a URL or a path, a logical
line is at most MAX_LINE characters and a name at most MAX_NAME_LEN.

Linear in the file: `name==version` lines (nearly all of a `pip freeze`) are read by one regular
expression; the rest go through packaging's parser.
"""

from __future__ import annotations

import re
import shlex
from pathlib import PurePosixPath
from urllib.parse import unquote, urlsplit

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version
from packaging.utils import InvalidSdistFilename, InvalidWheelFilename, canonicalize_name
from packaging.utils import parse_sdist_filename, parse_wheel_filename

from compilewatch.env.formats.model import EnvSpec, Package, bad_line, normalize_source
from compilewatch.errors import BadInput
from compilewatch.inputs import one_line

# Options that take a value and apply to the whole file (pip's requirements file format).
_GLOBAL_WITH_VALUE = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links", "--no-binary",
                      "--only-binary", "--trusted-host", "--use-feature", "-r", "--requirement",
                      "-c", "--constraint", "--config-settings", "--global-option"}
_GLOBAL_FLAGS = {"--pre", "--prefer-binary", "--require-hashes", "--no-index"}
# Options that may follow a requirement on its line.
_PER_REQUIREMENT = ("--hash", "--config-settings", "--global-option", "--install-option")
_COMMENT = re.compile(r"(^|\s)#.*$")
_FREEZE_EDITABLE = re.compile(r"\(([A-Za-z0-9][A-Za-z0-9._-]*)==([^)\s]+)\)")
_URL_START = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # a bare URL line: no `name @` before it
_VCS_START = re.compile(r"^(git|hg|svn|bzr)\+", re.IGNORECASE)  # `bzr+lp:project` has no `://`
_PATH_TEXT = re.compile(r"^[\w.~/\\:+@%=,-]+$")  # what a real path or file name is made of
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_PINNED = re.compile(rf"^({_NAME})\s*==\s*([0-9][A-Za-z0-9.!+_-]*)$")  # the pip freeze line, fast path
MAX_LINE = 64 << 10  # characters of one logical line (a line with 50 --hash options is ~5 KB)
MAX_NAME_LEN = 200  # characters of a package name (PyPI's longest are under 100)
_ARCHIVE_EXTS = (".whl", ".tar.gz", ".tgz", ".tar.bz2", ".tbz", ".tar.xz", ".txz", ".tar", ".zip")


def parse_requirements(text: str, path: str) -> EnvSpec:
    packages: list[Package] = []
    notes: list[str] = []
    skipped: list[BadInput] = []
    options = 0
    last_comment = ""
    for lineno, line in _logical_lines(text):
        stripped = line.strip()
        if stripped.startswith("#"):
            last_comment = stripped[:MAX_LINE]
            continue
        stripped = _COMMENT.sub("", stripped).strip() if "#" in stripped else stripped
        if not stripped:
            continue
        try:
            if len(stripped) > MAX_LINE:
                raise bad_line(path, lineno, f"a line of {len(stripped)} characters, longer than any requirement "
                                             f"({MAX_LINE} at most)")
            if stripped.startswith("-"):
                options += 1
                pkg = _option_line(stripped, path, lineno, last_comment, notes)
            else:
                pkg = _pinned(stripped) or _requirement(stripped, path, lineno)
        except BadInput as e:
            skipped.append(e)
            notes.append(f"skipped {e.message}")
            pkg = None
        if pkg is not None:
            if len(pkg.name) > MAX_NAME_LEN + 8:  # room for the `local:` style prefix
                e = bad_line(path, lineno, f"a package name of {len(pkg.name)} characters ({MAX_NAME_LEN} at most)")
                skipped.append(e)
                notes.append(f"skipped {e.message}")
                pkg = None
        if pkg is not None:
            packages.append(pkg)
            if pkg.name.startswith(("local:", "url:", "vcs:")):
                notes.append(f"{path}:{lineno}: {pkg.name.split(':')[0]} requirement {one_line(pkg.source, 120)} "
                             "names no package: compared by its source")
        last_comment = ""
    if skipped and not packages:
        raise skipped[0]  # not one line was a requirement: this is not a requirements file
    if len(skipped) * 2 > len(skipped) + len(packages) + options:
        first = skipped[0]
        raise BadInput(f"{path}: not a requirements file: {len(skipped)} of "
                       f"{len(skipped) + len(packages) + options} lines are not requirements "
                       f"(first: {one_line(first.message, 200)})",
                       hint="expected `pip freeze` output or a requirements.txt; name the format with --format "
                            "if it is another one")
    return EnvSpec(path=path, format="requirements", packages=tuple(packages), notes=tuple(notes))


def _pinned(line: str) -> Package | None:
    """`name==version` read by one regular expression (None: not that simple; the full parser reads it)."""
    m = _PINNED.match(line)
    if m is None:
        return None
    try:
        Version(m.group(2))
    except InvalidVersion:
        return None  # the full parser says what is wrong with it
    return Package(name=canonicalize_name(m.group(1)), version=m.group(2))


def _logical_lines(text: str):
    """(first line number, joined line) with `\\` continuations joined (linear: parts are joined once)."""
    parts: list[str] = []
    start = 0
    for i, raw in enumerate(text.splitlines(), 1):
        if not parts:
            start = i
        if raw.endswith("\\") and not raw.lstrip().startswith("#"):
            parts.append(raw[:-1])
            parts.append(" ")
            continue
        if parts:
            parts.append(raw)
            yield start, "".join(parts)
            parts = []
        else:
            yield start, raw
    if parts:
        yield start, "".join(parts)


def _option_line(line: str, path: str, lineno: int, last_comment: str, notes: list[str]) -> Package | None:
    try:
        parts = shlex.split(line)
    except ValueError as e:
        raise bad_line(path, lineno, f"cannot split option line {one_line(repr(line), 160)}: {e}") from None
    opt, _, inline = parts[0].partition("=")
    value = inline or (parts[1] if len(parts) > 1 else "")
    if opt in ("-e", "--editable"):
        if not value:
            raise bad_line(path, lineno, "-e needs a path or VCS URL")
        return _editable(value, path, lineno, last_comment)
    if opt in _GLOBAL_FLAGS:
        return None
    if opt in _GLOBAL_WITH_VALUE:
        if not value:
            raise bad_line(path, lineno, f"option {opt} needs a value")
        if opt in ("-r", "--requirement", "-c", "--constraint"):
            notes.append(f"{path}:{lineno}: {opt} {value} is not followed: diff that file on its own")
        return None
    raise bad_line(path, lineno, f"unknown option {one_line(repr(opt), 80)}",
                   hint="requirements files accept -e, -r, -c, -i, --extra-index-url, -f, --pre, ... "
                        "(pip's requirements file format)")


def _editable(target: str, path: str, lineno: int, last_comment: str) -> Package:
    name = version = None
    frag = urlsplit(target).fragment
    egg = re.search(r"(?:^|&)egg=([^&]+)", frag)
    if egg:
        name = egg.group(1)
    m = _FREEZE_EDITABLE.search(last_comment)  # "# Editable Git install with no remote (pkg==0.1.0)"
    if m:
        name = name or m.group(1)
        version = m.group(2)
    if not name:  # a directory's or repository's last path part: what pip's build would most likely say
        name = _repo_name(target) if _VCS_START.match(target) else _dir_name(target)
    if not name:
        return _unnamed(target, editable=True)
    return Package(name=canonicalize_name(name), version=version, source=normalize_source(target), editable=True)


def _repo_name(url: str) -> str | None:
    """`git+https://github.com/psf/requests.git@v2` -> 'requests'; `bzr+lp:bzr-svn` -> 'bzr-svn'."""
    base = url.split("#")[0].rstrip("/")
    tail = re.split(r"[/:]", base)[-1].split("@")[0]
    if tail.endswith(".git"):
        tail = tail[:-4]
    return tail if re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", tail or "") else None


def _dir_name(target: str) -> str | None:
    """`./tinykernels` -> 'tinykernels'; `.` and `..` name nothing."""
    tail = PurePosixPath(target.split("#")[0].replace("\\", "/").rstrip("/")).name
    return tail if re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", tail or "") else None


def _unnamed(target: str, *, editable: bool = False) -> Package:
    """An entry whose package name the line does not say: keyed by kind and source."""
    source = normalize_source(target) or target
    kind = "vcs" if _VCS_START.match(target) else "url" if _URL_START.match(target) else "local"
    return Package(name=f"{kind}:{source}", version=None, source=source, editable=editable)


def _looks_like_path(text: str) -> bool:
    """pip's test for a local project or archive: a path separator, a leading dot, or an archive name."""
    return ((text.startswith((".", "/", "~")) or "/" in text.split("@")[0] or "\\" in text
             or text.lower().endswith(_ARCHIVE_EXTS))
            and _PATH_TEXT.match(text.split(";")[0].strip()) is not None)


def _requirement(line: str, path: str, lineno: int) -> Package:
    req_text, _, _options = _split_options(line)
    if _URL_START.match(req_text) or _VCS_START.match(req_text):
        return _bare_url(req_text, path, lineno)
    try:
        req = Requirement(req_text)
    except InvalidRequirement as e:
        if _looks_like_path(req_text):
            return _local(req_text)
        raise bad_line(path, lineno, f"not a requirement: {one_line(repr(req_text), 160)} ({one_line(e, 160)})",
                       hint="expected `name==version`, `name @ URL` or an option line") from None
    except ValueError as e:  # a version longer than Python's digit limit
        raise bad_line(path, lineno, f"not a requirement: {one_line(e, 160)}") from None
    name = canonicalize_name(req.name)
    marker = str(req.marker) if req.marker else None
    if req.url:
        if not (_URL_START.match(req.url) or req.url.startswith("file:") or _PATH_TEXT.match(req.url)):
            raise bad_line(path, lineno, f"not a URL: {one_line(repr(req.url), 160)}",
                           hint="expected `name @ https://...`, `name @ file:///...` or `name @ ./path`")
        return Package(name=name, version=_version_from_url(req.url), source=normalize_source(req.url), marker=marker)
    specs = list(req.specifier)
    if len(specs) == 1 and specs[0].operator in ("==", "===") and "*" not in specs[0].version:
        return Package(name=name, version=specs[0].version, marker=marker)
    return Package(name=name, version=None, spec=str(req.specifier) or None, marker=marker)


def _local(text: str) -> Package:
    """`.`, `./pkg`, `dist/x-1.0-py3-none-any.whl`: a wheel or sdist name gives name and version."""
    target = text.split(";")[0].strip()
    filename = PurePosixPath(target.replace("\\", "/")).name
    version = _version_from_url(target)
    name = _name_from_filename(filename) if version is not None else None
    if name is None and not target.lower().endswith(_ARCHIVE_EXTS):
        name = _dir_name(target)
    if name is None:
        return _unnamed(target)
    return Package(name=canonicalize_name(name), version=version, source=normalize_source(target))


def _split_options(line: str) -> tuple[str, str, str]:
    """'torch==2.11.0 --hash=sha256:..' -> ('torch==2.11.0', ' ', '--hash=sha256:..')."""
    for opt in _PER_REQUIREMENT:
        idx = line.find(" " + opt)
        if idx != -1:
            return line[:idx].strip(), " ", line[idx:].strip()
    return line.strip(), "", ""


def _bare_url(text: str, path: str, lineno: int) -> Package:
    """A URL line without `name @`: `git+https://...#egg=name` or a wheel/sdist URL."""
    url = text.split(";")[0].strip()
    egg = re.search(r"[#&]egg=([^&]+)", url)
    filename = unquote(PurePosixPath(urlsplit(url).path).name)
    name = egg.group(1) if egg else None
    version = _version_from_url(url)
    if name is None and version is not None:
        name = _name_from_filename(filename)
    if name is None and _VCS_START.match(url):
        name = _repo_name(url)
    if name is None:
        return _unnamed(url)
    return Package(name=canonicalize_name(name), version=version, source=normalize_source(url))


def _version_from_url(url: str) -> str | None:
    """Version from a wheel or sdist file name in a URL (`torch-2.11.0%2Bcu128-...whl`), else None."""
    filename = unquote(PurePosixPath(urlsplit(url).path).name)
    try:
        if filename.endswith(".whl"):
            return str(parse_wheel_filename(filename)[1])
        if filename.endswith((".tar.gz", ".zip")):
            return str(parse_sdist_filename(filename)[1])
    except (InvalidWheelFilename, InvalidSdistFilename, ValueError):
        return None
    return None


def _name_from_filename(filename: str) -> str | None:
    try:
        if filename.endswith(".whl"):
            return str(parse_wheel_filename(filename)[0])
        return str(parse_sdist_filename(filename)[0])
    except (InvalidWheelFilename, InvalidSdistFilename, ValueError):
        return None
