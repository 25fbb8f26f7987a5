"""What has to change when a cache moves to another path: triton's absolute kernel paths.

Everything inductor keys and stores is path independent (a cache loaded elsewhere hits: see
docs/cache.md), except triton's kernel folders `triton/<device>/<hash>/`: the group file
`__grp__<kernel>.json` lists its files by *absolute* path (`{"child_paths": {name: path}}`), and triton
looks them up by those paths. torch knows this: its TritonBundler cuts the kernel folder's path out of
every `.json` when it bundles a kernel into an FX-graph entry and writes the new folder's path back
when it emits one (`torch/_inductor/triton_bundler.py`, `_REPLACE_BYTES`). But it emits only into an
empty folder, so after a move the stale paths stay and triton recompiles those kernels.

`rebase_triton_paths` does what the bundler does, for a whole cache: in each kernel folder, the old
folder path found in the group file is replaced by the folder's new path in every `.json` of that
folder (written atomically). It runs on extracted archives and restored backups before they are used.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from compilewatch.fsutil import atomic_write_bytes


def _old_folder(group_file: Path) -> str | None:
    try:
        children = json.loads(group_file.read_bytes()).get("child_paths")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(children, dict):
        return None
    for p in children.values():
        if isinstance(p, str) and os.path.isabs(p):
            return os.path.dirname(p)
    return None


def rebase_triton_paths(disk_root: Path, final_root: Path) -> int:
    """Point the triton kernel folders under `disk_root` at their paths under `final_root`.

    `disk_root` is where the cache is now (e.g. an extraction dir), `final_root` where it will be
    used (they may be equal). Returns the number of `.json` files rewritten.
    """
    triton = disk_root / "triton"
    if not triton.is_dir():
        return 0
    rewritten = 0
    for group_file in sorted(triton.glob("*/*/__grp__*.json")):
        folder = group_file.parent
        old = _old_folder(group_file)
        new = str(final_root / folder.relative_to(disk_root))
        if old is None or old == new:
            continue
        for f in sorted(folder.glob("*.json")):
            data = f.read_bytes()
            if old.encode() in data:
                st = f.stat()
                atomic_write_bytes(f, data.replace(old.encode(), new.encode()))
                os.chmod(f, st.st_mode & 0o7777)  # keep triton's mode and times, not the temp file's
                os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
                rewritten += 1
    return rewritten
