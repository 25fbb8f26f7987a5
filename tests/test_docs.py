"""The docs hold what runs: public imports only, links that resolve, generated blocks up to date.

- Python in docs/*.md and README.md (fenced blocks tagged `python`/`py` or untagged; `text` blocks
  are listings, not code to paste) imports only public names: `import compilewatch` / `dflash`,
  `from compilewatch import X` with X in `compilewatch.__all__` (and `dflash.__all__` for dflash,
  empty until dflash declares its face), and `compilewatch.X` only for public X.
- (Links and anchors, and the quick start's commands: tests/test_docs_check.py.)
- Every `<!-- generated: NAME -->` block is what docs/tools/generated.py makes from the code.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import compilewatch
import dflash

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
_FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)[^\n]*\n(.*?)^\1\s*$", re.S | re.M)
_LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
PUBLIC = {"compilewatch": set(compilewatch.__all__), "dflash": set(getattr(dflash, "__all__", ()))}


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def code_blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group(2).lower(), m.group(3)) for m in _FENCE.finditer(text)]


def without_code(text: str) -> str:
    text = _FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def private_uses(code: str, attributes: bool = True) -> list[str]:
    """Imports of, and (`attributes`) attribute reads from, compilewatch / dflash that are not public."""
    bad = []
    body = []
    for line in code.splitlines():
        s = line.strip()
        m = re.match(r"from\s+([\w.]+)\s+import\s+(.+)", s)
        if m and m.group(1).split(".")[0] in PUBLIC:
            mod = m.group(1)
            names = [n.strip().split(" as ")[0].strip("() ") for n in m.group(2).split("#")[0].split(",")]
            if mod not in PUBLIC:
                bad.append(f"from {mod} import ...: a sub-package (internal)")
            else:
                bad += [f"from {mod} import {n}: not in {mod}.__all__" for n in names if n and n not in PUBLIC[mod]]
        m2 = re.match(r"import\s+([\w.]+)", s)
        if m2 and m2.group(1).split(".")[0] in PUBLIC and m2.group(1) not in PUBLIC:
            bad.append(f"import {m2.group(1)}: a sub-package (internal)")
        if not (m or m2):
            body.append(line.split("#")[0])
    for mod, names in PUBLIC.items() if attributes else ():
        for attr in re.findall(rf"(?<![\w./]){mod}\.([A-Za-z_]\w*)", "\n".join(body)):
            if attr not in names:
                bad.append(f"{mod}.{attr}: not in {mod}.__all__")
    return bad


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not - or _), spaces to -."""
    h = re.sub(r"[`*]", "", heading.strip().lower())
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            out.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    out |= set(re.findall(r'<a (?:name|id)="([^"]+)"', path.read_text()))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_python_in_the_docs_imports_public_names_only(doc):
    bad = []
    for lang, code in code_blocks(doc.read_text()):
        if lang in ("python", "py", ""):  # untagged blocks are often output: imports only there
            bad += private_uses(code, attributes=lang != "")
    assert bad == [], f"{_rel(doc)}: {bad}"


def test_generated_blocks_are_up_to_date():
    sys.path.insert(0, str(ROOT / "docs" / "tools"))
    try:
        import generated
    finally:
        sys.path.pop(0)
    stale = []
    for doc in generated.doc_files():
        stale += generated.render(doc.read_text(), _rel(doc))[1]
    assert stale == [], f"run `python docs/tools/generated.py`: {stale}"


def test_the_checks_see_what_they_should():
    assert private_uses("from compilewatch.devices.warm import prewarm") == [
        "from compilewatch.devices.warm import ...: a sub-package (internal)"]
    assert private_uses("import compilewatch\ncompilewatch.CompileGuard()\ncompilewatch.nope()") == [
        "compilewatch.nope: not in compilewatch.__all__"]
    assert private_uses("from compilewatch import prewarm, FlexShape  # ok") == []
    assert slug("Library: `compilewatch.prewarm`") == "library-compilewatchprewarm"
    assert "library-compilewatchprewarm" in anchors(ROOT / "docs" / "warm.md")
    assert "library-compilewatchwarmprewarm" not in anchors(ROOT / "docs" / "warm.md")  # guard.md's old link


def test_run_exit_rule_is_stated_the_same_in_help_readme_and_run_md():
    """`compilewatch run`'s one exit rule (cli/run.py EXIT_RULE) in its --help, README and docs/run.md."""
    from cli.run import EXIT_RULE

    def flat(text: str) -> str:
        return " ".join(text.replace("**", "").replace("`", "").split())

    rule = "otherwise 1 when the watcher saw a failure or could not watch fully"
    for text in (EXIT_RULE, (ROOT / "README.md").read_text(), (ROOT / "docs" / "run.md").read_text()):
        text = flat(text)
        assert rule in text and "the program's own code when it is not 0" in text and "--strict-risks" in text, text[:200]
