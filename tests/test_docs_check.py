"""The docs check: the docs' links resolve and the quick start's commands run.

- Every relative link and image in README.md and docs/**/*.md (inline `[text](path#anchor)`,
  `![alt](path)` and reference definitions `[name]: path`, outside code) names a file inside the
  repository, and an anchor names a heading of the target file (GitHub's slugs: lower case,
  punctuation dropped but `-` and `_`, each space a `-`, repeats numbered `-1`, `-2`, ...) or an
  `<a name|id="...">` in it.
- Every command of every fenced `bash` block of docs/quickstart.md runs, one after another, in one
  temporary working directory holding a copy of docs/examples/ (the commands are written for the
  checkout's root), with this interpreter's bin directory (the repository's venv) first on PATH and
  TMPDIR inside the test's tmp_path, each under a timeout. It must exit 0, unless its comment says
  otherwise: `(exit N)`, or `(exit N; M on torch ≥ X.Y)` where newer torch behaves differently.
  A block right after `<!-- docs-check: skip (why) -->` is not run (installing, the test suite).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
QUICKSTART = ROOT / "docs" / "quickstart.md"
TIMEOUT_S = 300  # per command; dflash train, the longest, takes ~20 s of CPU (~50 s wall on a loaded 2-core VM)

_FENCE = re.compile(r"^(?P<fence>```+|~~~+)[ \t]*(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.S | re.M)
_INLINE = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'][^\"']*[\"'])?\s*\)")
_REFDEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+[\"'(].*)?$", re.M)
_SKIP = re.compile(r"<!--\s*docs-check:\s*skip\b[^>]*-->\s*\n\s*$")
_EXIT = re.compile(r"\(exit (\d+)(?:; (\d+) on torch ≥ (\d+)\.(\d+))?[);:]")


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def without_code(text: str) -> str:
    """Markdown with fenced blocks and inline code spans removed (links there are not links)."""
    text = _FENCE.sub("", text)
    return re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", "", text, flags=re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    h = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link: its text
    h = re.sub(r"<[^>]+>", "", h).lower()  # inline HTML
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", text).splitlines():
        m = re.match(r" {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            out.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return out | set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))


def broken_links(doc: Path) -> list[str]:
    text = without_code(doc.read_text(encoding="utf-8"))
    broken = []
    for target in _INLINE.findall(text) + _REFDEF.findall(text):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):  # https:, mailto:, ...
            continue
        path_part, _, anchor = target.partition("#")
        dest = (doc.parent / path_part).resolve() if path_part else doc
        if not dest.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {_rel(dest)}")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_every_relative_link_resolves_inside_the_repository(doc):
    assert broken_links(doc) == [], _rel(doc)


def quickstart_commands(text: str) -> list[tuple[str, int]]:
    """(command, expected exit code) for every command of every bash block not marked skip."""
    import torch

    version = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    out = []
    for m in _FENCE.finditer(text):
        if m.group("lang").lower() != "bash" or _SKIP.search(text[:m.start()]):
            continue
        lines = m.group("body").splitlines()
        while lines:
            line = lines.pop(0)
            while line.rstrip().endswith("\\") and lines:
                line = line.rstrip()[:-1].rstrip() + " " + lines.pop(0).strip()
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            e = _EXIT.search(line.partition(" # ")[2])
            code = 0
            if e:
                code = int(e.group(1))
                if e.group(2) and version >= (int(e.group(3)), int(e.group(4))):
                    code = int(e.group(2))
            out.append((line.strip(), code))
    return out


def test_the_parsers_see_what_they_should():
    assert slug("Library: `compilewatch.prewarm`") == "library-compilewatchprewarm"
    assert slug("Which torch is affected how") == "which-torch-is-affected-how"
    assert slug("[`race.md`](race.md) — τ ≥ 2") == "racemd--τ--2"
    assert without_code("a `[x](nope.md)` b") == "a  b"
    text = ('<!-- docs-check: skip (installs) -->\n```bash\npip install x\n```\n\n'
            '```bash\n# a comment\nfoo --a \\\n  --b   # does a (exit 1)\nbar  # (exit 1; 0 on torch ≥ 2.0) the race\n'
            'baz  # 2 > 1 (exit 3: a finding)\n```\n```python\nnot_run()\n```\n')
    assert quickstart_commands(text) == [("foo --a --b   # does a (exit 1)", 1),
                                         ("bar  # (exit 1; 0 on torch ≥ 2.0) the race", 0),
                                         ("baz  # 2 > 1 (exit 3: a finding)", 3)]
    doc = ROOT / "docs" / "index.md"
    assert "the-case-this-project-comes-from" in anchors(doc)


def test_quickstart_commands_run(tmp_path):
    commands = quickstart_commands(QUICKSTART.read_text(encoding="utf-8"))
    assert len(commands) >= 5, commands  # the check must not pass by running nothing
    work = tmp_path / "work"
    shutil.copytree(ROOT / "docs" / "examples", work / "docs" / "examples")
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
               TMPDIR=str(tmp_path / "tmp"), COMPILEWATCH_PROGRESS_INTERVAL="60")
    env.pop("VIRTUAL_ENV", None)
    failures, times = [], []
    for cmd, expected in commands:
        t0 = time.monotonic()
        try:
            r = subprocess.run(["bash", "-c", cmd], cwd=work, env=env, capture_output=True, text=True,
                               timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            failures.append(f"{cmd}\n  timed out after {TIMEOUT_S} s")
            continue
        times.append(f"{time.monotonic() - t0:6.1f} s  {cmd}")
        if r.returncode != expected:
            failures.append(f"{cmd}\n  exit {r.returncode}, expected {expected}\n"
                            f"  stdout: {r.stdout[-2000:]}\n  stderr: {r.stderr[-2000:]}")
    print("\n".join(times))
    assert failures == [], "docs/quickstart.md:\n" + "\n".join(failures)
