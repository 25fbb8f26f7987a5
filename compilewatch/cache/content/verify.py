"""Find unusable cache entries and entries built for another system; `fix=True` moves them aside.

What is checked, and how (no GPU needed for any of it):

| check | kind | severity |
|---|---|---|
| a zero-byte file outside `locks/` (except the markers torch writes empty on purpose: `*.lock`, `*.so.load_ok`) | `empty` | error |
| an fxgraph / aotautograd pickle without pickle framing (first byte 0x80, last byte `.`) | `truncated` | error |
| a `.so` / `.cubin` whose ELF header is missing or whose section table lies past the file's end | `truncated` | error |
| generated `.py` that does not compile; triton `.json` or `cache/<key>` JSON that does not parse | `truncated` | error |
| (deep) an fxgraph / aotautograd pickle whose opcodes do not parse (`pickletools`; nothing is unpickled) | `unloadable` | error |
| (deep) a pickle that names or calls what torch's caches never do (`os.system`, a string-evaluating sympy constructor, a native loader, non-FX source): it would run code when loaded | `untrusted` | error |
| (deep) the same for every other file torch unpickles: `dynamo/` (PGO code state, precompile), non-JSON `cache/` files, `*.pkl` (`picklescan.is_pickle_file`) | `untrusted` / `unloadable` | error |
| (deep) an aotautograd entry naming an FX-graph key that has no fxgraph entry | `dangling` | error |
| a triton kernel folder whose group file lists a missing binary, or metadata without a binary | `missing-binary` | error |
| an entry stamped with a system key other than `torchinfo.system_key()` (`stamps`) | `foreign-system` | foreign |
| an entry stamped with another torch build (`torch_version` hash in its key lines) | `foreign-torch` | foreign |
| a `cache/<system key>` file for another system key | `foreign-system` | foreign |
| (GPU here) a triton kernel whose target arch differs from this GPU's | `foreign-system` | foreign |
| a triton group file whose absolute child paths point elsewhere while the files sit beside it (the cache was moved by hand: triton recompiles these kernels; `--fix` and `load` rewrite the paths) | `relocated` | warning |
| a writer's temp file (`.*.tmp`, `tmp.pid_*`) older than an hour (a crashed writer) | `stale-temp` | warning |

`ok` is False when any error or foreign finding exists (the CLI exits 1). With `fix=True` each
error/foreign entry, and stale temp files, move to `<cache>.quarantine-<timestamp>/` beside the
cache (renames; nothing is deleted), and relocated triton paths are rewritten (`relocate`). What cannot be checked without running the code is listed in
`not_checked`: that a cubin loads on this driver/GPU, that a `.so` links, that guards pass.

Nothing here unpickles: deep checks read each pickle's opcodes with `picklescan` (a parser that
imports and calls nothing), so verifying a cache from elsewhere is safe. That a cache verifies does
not make it safe to *use*: torch runs the code its entries carry (docs/security.md).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from compilewatch.cache.content import stamps
from compilewatch.cache.local import layout
from compilewatch.cache.local.lock import cache_lock
from compilewatch.cache.local.relocate import rebase_triton_paths
from compilewatch.cache.trust import picklescan
from compilewatch.errors import BadInput
from compilewatch.inputs import open_untrusted

ERROR_KINDS = ("empty", "truncated", "unloadable", "untrusted", "dangling", "missing-binary")
FOREIGN_KINDS = ("foreign-system", "foreign-torch")
WARNING_KINDS = ("relocated", "stale-temp")
STALE_TEMP_S = 3600
_BINARY_EXTS = (".cubin", ".hsaco", ".spv", ".zebin")
_ELF_MAGIC = b"\x7fELF"
_FX_KEY = re.compile(r"^f[a-z0-9]{51}$")  # an FX-graph cache key (`f` + base32 sha256), as aotautograd stores it
# zero-byte files torch writes on purpose: lock files, and (torch 2.14/2.15 cpu_vec_isa.py) `<isa probe>.so.load_ok`,
# "this .so was dlopen'ed once", next to the probe's .so in the codegen cache
_EMPTY_BY_DESIGN = (".lock", ".so.load_ok")
_NOT_PICKLES = (".py", ".cpp", ".h", ".gch", ".so", ".json", ".cubin", ".ptx", ".llir", ".ttir", ".ttgir", ".hsaco",
                ".spv", ".zebin", ".lock", ".best_config", ".o", ".load_ok")


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str
    severity: str  # "error", "foreign" or "warning"
    subcache: str
    entry: str  # what --fix moves (relative path of a file or folder)
    path: str  # the file the finding is about
    detail: str


@dataclass(frozen=True, slots=True)
class VerifyReport:
    path: str
    ok: bool  # no error and no foreign findings
    foreign: bool  # some entries were built for another system key or torch build
    system_key: str
    torch_version: str
    torch_hash: str | None  # hash of this torch build as entries record it (None: cannot tell)
    files: int
    checked: dict[str, int]  # files checked per sub-cache
    entry_system_keys: dict[str, int]  # stamped system key -> entry files ("unknown": no stamp)
    findings: tuple[Finding, ...]
    counts: dict[str, int]  # findings per kind
    not_checked: tuple[str, ...]
    deep: bool
    quarantine: str | None = None  # where --fix moved entries
    moved: tuple[tuple[str, str], ...] = ()
    paths_rewritten: int = 0  # triton .json files --fix pointed at this dir (`relocated` findings)


def _severity(kind: str) -> str:
    return "error" if kind in ERROR_KINDS else "foreign" if kind in FOREIGN_KINDS else "warning"


class _Checker:
    def __init__(self, root: Path, system_key: str, torch_hash: str | None, deep: bool, gpu_arch: int | None):
        self.root = root
        self.system_key = system_key
        self.torch_hash = torch_hash
        self.deep = deep
        self.gpu_arch = gpu_arch
        self.findings: list[Finding] = []
        self.stamps: Counter[str] = Counter()
        self.notes: set[str] = set()
        self.triton_targets: Counter[str] = Counter()
        self.fx_keys: set[str] = set()
        self.aot_refs: list[tuple[str, str]] = []  # (aot entry file, fx key it needs)

    def add(self, kind: str, rel: str, detail: str, entry: str | None = None) -> None:
        sub, unit = layout.entry_of(rel)
        if sub in ("fxgraph", "aotautograd"):
            unit = rel  # each file is an independent candidate for its key: move only the bad one
        self.findings.append(Finding(kind, _severity(kind), sub, entry or unit, rel, detail))

    def read(self, rel: str) -> bytes | None:
        """The file's bytes: None (with a note) when it cannot be read or is no longer a regular file
        (never blocks on a FIFO), and None with an `unloadable` finding past picklescan.MAX_SCAN (a
        cache from elsewhere may hold anything; `cache load` would refuse such a pickle too)."""
        try:
            fd, st = open_untrusted(self.root / rel, "cache file")
        except BadInput as e:
            self.notes.add(f"{rel}: unreadable ({e.message})")
            return None
        with os.fdopen(fd, "rb") as fh:
            if st.st_size > picklescan.MAX_SCAN:
                self.add("unloadable", rel, f"{st.st_size} bytes, more than the {picklescan.MAX_SCAN} bytes verify "
                         "reads of one file: not checked")
                return None
            try:
                return fh.read(st.st_size)
            except OSError as e:
                self.notes.add(f"{rel}: unreadable ({e.strerror})")
                return None

    # --- per sub-cache -------------------------------------------------------------------------
    def check_pickle_entry(self, f: layout.FileStat, sub: str) -> None:
        content = self.read(f.rel)
        if content is None:
            return
        if not (content[:1] == b"\x80" and content[-1:] == b"."):
            self.add("truncated", f.rel, f"not a complete pickle ({len(content)} bytes, cut short or overwritten)")
            return
        st = stamps.stamp_of(f.rel, content)
        self.stamps[st.system_key or "unknown"] += 1
        if sub == "fxgraph":
            self.fx_keys.add(f.rel.split("/")[2])
        if st.system_key and st.system_key != self.system_key:
            self.add("foreign-system", f.rel, f"built for system key {st.system_key[:12]}…, this machine is "
                     f"{self.system_key[:12]}… (GPU, CUDA or triton differ): it can never hit here")
        elif st.torch_hash and self.torch_hash and st.torch_hash != self.torch_hash:
            self.add("foreign-torch", f.rel, "built by another torch build (torch version or source differs): "
                     "it can never hit here")
        elif self.deep:  # foreign entries are never loaded by this torch: checking them proves nothing
            self.inspect_pickle(f.rel, sub, content)

    def inspect_pickle(self, rel: str, sub: str, content: bytes) -> None:
        """Parse the pickle's opcodes (never unpickle): malformed, or naming a global torch never uses;
        an aotautograd entry's FX-graph keys are its string constants shaped like one."""
        scan = picklescan.scan(content)
        if scan.problem:
            self.add("unloadable", rel, scan.problem)
            return
        if scan.refused:
            self.add("untrusted", rel, f"the pickle calls {', '.join(scan.refused[:3])}, which torch's caches never "
                     "do: loading it would run that code (it was not unpickled)")
            return
        if sub == "aotautograd":
            for s in picklescan.strings(content):
                if _FX_KEY.match(s):
                    self.aot_refs.append((rel, s))

    def is_other_pickle(self, f: layout.FileStat) -> bool:
        if f.rel.endswith(_NOT_PICKLES) and not f.rel.startswith(("dynamo/", "cache/")):
            return False  # generated source, built code, kernels, JSON: torch never unpickles them (no read needed)
        try:
            with open(self.root / f.rel, "rb") as fh:
                head = fh.read(1)
        except OSError:
            return False
        return picklescan.is_pickle_file(f.rel, head)

    def check_other_pickle(self, f: layout.FileStat, sub: str) -> None:
        """A pickle torch loads outside fxgraph/aotautograd (`picklescan.is_pickle_file`): scanned the same way."""
        content = self.read(f.rel)
        if content is not None:
            self.inspect_pickle(f.rel, sub, content)

    def check_elf(self, f: layout.FileStat) -> None:
        try:
            with open(self.root / f.rel, "rb") as fh:
                head = fh.read(64)
        except OSError as e:
            self.notes.add(f"{f.rel}: unreadable ({e.strerror})")
            return
        if head[:4] != _ELF_MAGIC or len(head) < 52:
            self.add("truncated", f.rel, "not an ELF file (cut short or overwritten)")
            return
        is64 = head[4] == 2
        order = "little" if head[5] == 1 else "big"
        if is64:
            shoff = int.from_bytes(head[0x28:0x30], order)
            shentsize, shnum = int.from_bytes(head[0x3A:0x3C], order), int.from_bytes(head[0x3C:0x3E], order)
        else:
            shoff = int.from_bytes(head[0x20:0x24], order)
            shentsize, shnum = int.from_bytes(head[0x2E:0x30], order), int.from_bytes(head[0x30:0x32], order)
        end = shoff + shentsize * shnum
        if end > f.size:
            self.add("truncated", f.rel, f"ELF section table ends at byte {end}, file has {f.size}")

    def check_py(self, f: layout.FileStat) -> None:
        content = self.read(f.rel)
        if content is None:
            return
        try:
            compile(content, f.rel, "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as e:
            self.add("truncated", f.rel, f"generated Python does not compile ({type(e).__name__}: {e})"[:240])

    def check_triton_folder(self, folder: str, files: list[layout.FileStat]) -> None:
        names = {f.rel.rsplit("/", 1)[1] for f in files}
        grouped = False
        for f in files:
            name = f.rel.rsplit("/", 1)[1]
            if not name.endswith(".json"):
                continue
            content = self.read(f.rel)
            if content is None:
                continue
            try:
                data = json.loads(content)
            except ValueError:
                self.add("truncated", f.rel, "triton JSON does not parse", entry=folder)
                continue
            if name.startswith("__grp__"):
                grouped = True
                self._check_group(folder, f.rel, data, names)
            elif isinstance(data, dict):
                self._check_target(folder, f.rel, data)
        if not grouped and any(n.endswith(".json") and not n.startswith("__grp__") for n in names) \
                and not any(n.endswith(_BINARY_EXTS) for n in names):
            self.add("missing-binary", folder + "/", "kernel metadata without a binary (.cubin/.hsaco/.spv)",
                     entry=folder)

    def _check_group(self, folder: str, rel: str, data: object, names: set[str]) -> None:
        children = data.get("child_paths") if isinstance(data, dict) else None
        if not isinstance(children, dict):
            self.add("truncated", rel, "triton group file without child_paths", entry=folder)
            return
        for child, p in children.items():
            if not isinstance(p, str):
                continue
            base = os.path.basename(p)
            if os.path.isabs(p) and os.path.exists(p):
                if not _inside(p, self.root / folder) and base in names:
                    self.add("relocated", rel, f"{child} points to {p}, outside this folder", entry=folder)
                continue
            if base in names:
                if os.path.isabs(p):
                    self.add("relocated", rel, f"{child} is recorded at {p} (the cache was moved); triton "
                             "recompiles this kernel (`--fix` rewrites the paths)", entry=folder)
                continue
            kind = "missing-binary" if child.endswith(_BINARY_EXTS) else "truncated"
            self.add(kind, rel, f"group lists {child}, which is missing", entry=folder)

    def _check_target(self, folder: str, rel: str, data: dict) -> None:
        target = data.get("target")
        if not isinstance(target, dict):
            return
        desc = f"{target.get('backend')}:{target.get('arch')}"
        self.triton_targets[desc] += 1
        arch = target.get("arch")
        if self.gpu_arch is not None and target.get("backend") == "cuda" and isinstance(arch, int) \
                and arch != self.gpu_arch:
            self.add("foreign-system", rel, f"triton kernel built for sm_{arch}, this GPU is sm_{self.gpu_arch}",
                     entry=folder)

    def check_local_cache(self, f: layout.FileStat) -> None:
        st = stamps.stamp_of(f.rel, None)
        if not st.system_key:
            return
        self.stamps[st.system_key] += 1
        content = self.read(f.rel)
        try:
            data = json.loads(content or b"")
        except ValueError:  # torch's get_local_cache() would raise on it
            self.add("truncated", f.rel, "local cache JSON does not parse")
            return
        if st.system_key != self.system_key:
            device = ""
            try:
                device = f" ({data.get('system', {}).get('device', {}).get('name')})"
            except AttributeError:
                pass
            self.add("foreign-system", f.rel, f"local cache for system key {st.system_key[:12]}…{device}")

    def check_dangling(self) -> None:
        missing: dict[str, list[str]] = {}
        for rel, key in self.aot_refs:
            if key not in self.fx_keys:
                missing.setdefault(rel, []).append(key)
        for rel, keys in missing.items():
            names = ", ".join(k[:16] + "…" for k in keys)
            self.add("dangling", rel, f"needs FX-graph entr{'y' if len(keys) == 1 else 'ies'} {names}, not in "
                     "fxgraph/: this entry always misses")


def _inside(p: str, folder: Path) -> bool:
    try:
        return Path(p).resolve().parent == folder.resolve()
    except OSError:
        return False


def _gpu_arch() -> int | None:
    from compilewatch import torchinfo

    torch = torchinfo.torch_module()
    try:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return major * 10 + minor
    except Exception:  # noqa: BLE001
        return None
    return None


def verify(path: str | os.PathLike[str] | None = None, *, deep: bool = True, fix: bool = False) -> VerifyReport:
    """Check the cache at `path` (default: torch's inductor cache dir). See the module docstring."""
    from compilewatch import torchinfo

    loc = layout.resolve_existing(path)
    root = loc.path
    torch = torchinfo.torch_module()
    system_key = torchinfo.system_key()
    torch_hash = stamps.current_torch_hash()
    gpu_arch = _gpu_arch()
    w = layout.walk(root)
    ck = _Checker(root, system_key, torch_hash, deep, gpu_arch)
    checked: Counter[str] = Counter()
    triton_folders: dict[str, list[layout.FileStat]] = {}
    for f in w.files:
        sub, unit = layout.entry_of(f.rel)
        checked[sub] += 1
        if f.size == 0:
            if sub != "locks" and not f.rel.endswith(_EMPTY_BY_DESIGN):
                ck.add("empty", f.rel, "zero-byte file")
            continue
        if sub in ("fxgraph", "aotautograd"):
            ck.check_pickle_entry(f, sub)
        elif deep and ck.is_other_pickle(f):  # dynamo/ PGO and precompile state, pickles under cache/, *.pkl
            ck.check_other_pickle(f, sub)
        elif sub == "triton":
            triton_folders.setdefault(unit, []).append(f)
        elif sub == "cache":
            ck.check_local_cache(f)
        elif f.rel.endswith((".so", ".cubin")):
            ck.check_elf(f)
        elif sub == "codegen" and f.rel.endswith(".py"):
            ck.check_py(f)
    for folder, files in triton_folders.items():
        ck.check_triton_folder(folder, files)
    if deep:
        ck.check_dangling()
    now = time.time()
    for rel in w.in_flight:
        try:
            age = now - os.lstat(root / rel).st_mtime
        except OSError:
            continue
        if age > STALE_TEMP_S:
            ck.add("stale-temp", rel, f"writer's temp file left {age / 3600:.1f} h ago (a crashed writer)", entry=rel)

    notes = sorted(ck.notes)
    if torch_hash is None:
        notes.append("torch-build stamps not compared: this torch does not expose FxGraphCachePickler/torch_key")
    if gpu_arch is None and ck.triton_targets:
        notes.append("triton kernel targets not compared with a GPU (none here): "
                     + ", ".join(f"{t} × {n}" for t, n in sorted(ck.triton_targets.items())))
    if not deep:
        notes.append("pickles not parsed (quick mode): malformed or code-running entries and aotautograd→fxgraph links unchecked")
    notes.append("whether cubins load on this driver/GPU, whether .so files link, whether an entry's guards "
                 "pass for your shapes: only running the code tells")
    if not loc.triton_inside:
        notes.append(f"the triton cache at {loc.triton_dir} (TRITON_CACHE_DIR) is outside this dir and was not checked")

    findings = tuple(sorted(ck.findings, key=lambda x: (ERROR_KINDS + FOREIGN_KINDS + WARNING_KINDS).index(x.kind)))
    quarantine = None
    moved: tuple[tuple[str, str], ...] = ()
    rewritten = 0
    if fix:
        units = sorted({x.entry for x in findings if x.severity in ("error", "foreign") or x.kind == "stale-temp"})
        relocated = any(x.kind == "relocated" for x in findings)
        if units or relocated:
            with cache_lock(root):
                if units:
                    dest = layout.timestamped_sibling(root, "quarantine")
                    moved = tuple(layout.move_aside(root, _expand_units(root, units), dest))
                    quarantine = str(dest)
                if relocated:
                    rewritten = rebase_triton_paths(root, root)
    bad = any(x.severity in ("error", "foreign") for x in findings)
    return VerifyReport(
        path=str(root), ok=not bad, foreign=any(x.severity == "foreign" for x in findings),
        system_key=system_key, torch_version=str(torch.__version__), torch_hash=torch_hash,
        files=len(w.files), checked=dict(checked), entry_system_keys=dict(ck.stamps), findings=findings,
        counts=dict(Counter(x.kind for x in findings)), not_checked=tuple(notes), deep=deep,
        quarantine=quarantine, moved=moved, paths_rewritten=rewritten,
    )


def _expand_units(root: Path, units: list[str]) -> list[str]:
    """Entries to paths: a codegen entry `ab/cab12` is every file `ab/cab12.*`; others are paths."""
    out: list[str] = []
    for u in units:
        p = root / u
        if p.exists():
            out.append(u)
            continue
        parent = p.parent
        if parent.is_dir():
            out.extend(f"{u.rsplit('/', 1)[0]}/{n}" for n in sorted(os.listdir(parent))
                       if n.split(".", 1)[0] == p.name)
    return out
