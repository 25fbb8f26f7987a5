"""Unpickle pickles the scanner accepted, under a tripwire, and say what each did (a child process).

Reads a JSON list of hex-encoded pickles on stdin; prints one JSON object: `{"tripped": [[index,
event], ...], "loaded": N}`. Before unpickling anything it imports every module the allow-list
names, snapshots every allowed class's and function's attributes and those modules' namespaces,
then installs an audit hook that records code execution (`exec`, `compile`), commands (`os.system`,
`subprocess.Popen`, `os.exec*`, `os.spawn*`, `os.posix_spawn`), native loads (`ctypes.dlopen`),
imports of modules not already imported, and `open` for writing. After each pickle the snapshots are
compared (a class, function or module attribute that changed is a trip; module namespaces every 16
pickles, so a module's trip names the last pickle of its batch). An exception while
unpickling is fine: only what ran counts.
"""

from __future__ import annotations

import importlib
import json
import pickle
import sys
import types

_current = [-1]
_tripped: list[list[object]] = []
_armed = [False]
_COMMAND_EVENTS = ("os.system", "subprocess.Popen", "os.exec", "os.spawn", "os.posix_spawn", "os.fork",
                   "ctypes.dlopen", "ctypes.dlsym", "shutil.rmtree", "os.remove", "os.unlink", "os.rename")


def _hook(event: str, args: tuple) -> None:
    if not _armed[0]:
        return
    trip = None
    if event in ("exec", "compile") or event.startswith(_COMMAND_EVENTS):
        trip = event
    elif event == "import" and args and args[0] not in sys.modules:
        trip = f"import {args[0]}"
    elif event == "open" and len(args) >= 2 and isinstance(args[1], str) and any(c in args[1] for c in "wax+"):
        trip = f"open {args[0]!r} {args[1]}"
    if trip:
        _tripped.append([_current[0], trip])


def _targets() -> tuple[list[object], list[types.ModuleType]]:
    from compilewatch.cache.trust import allowlist

    modules = []
    for m in sorted(allowlist.CLASS_MODULES | allowlist._KNOWN_MODULES):
        try:
            modules.append(importlib.import_module(m))
        except ImportError:
            pass
    objs: list[object] = []
    for mod in modules:
        for v in list(vars(mod).values()):
            if isinstance(v, type) and v.__module__ == mod.__name__:
                objs.append(v)
    for full in sorted(allowlist.ALLOWED_GLOBALS | allowlist.CALLABLE_GLOBALS):
        obj = allowlist._import_attr(full)
        if obj is not allowlist._MISSING:
            objs.append(obj)
    return objs, modules


def _snapshot(obj: object) -> dict[str, int]:
    out: dict[str, int] = {}
    d = getattr(obj, "__dict__", None)
    if isinstance(d, (dict, types.MappingProxyType)):
        out.update({str(k): id(v) for k, v in d.items()})
    for a in ("__defaults__", "__kwdefaults__", "__code__"):
        if hasattr(obj, a) and isinstance(obj, types.FunctionType):
            out[a] = id(getattr(obj, a))
    return out


def main() -> int:
    blobs = [bytes.fromhex(h) for h in json.load(sys.stdin)]
    objs, modules = _targets()
    keep = [*objs, *modules]  # ids stay valid
    before = [_snapshot(o) for o in keep]
    n_objs = len(objs)
    sys.addaudithook(_hook)
    loaded = 0
    for i, blob in enumerate(blobs):
        _current[0] = i
        _armed[0] = True
        try:
            pickle.loads(blob)
            loaded += 1
        except BaseException:  # noqa: BLE001 - a failed load is fine; only what ran counts
            pass
        _armed[0] = False
        last = i == len(blobs) - 1
        for j, o in enumerate(keep if last or i % 16 == 15 else keep[:n_objs]):  # modules every 16 pickles
            now = _snapshot(o)
            if now != before[j]:
                changed = sorted(k for k in set(now) | set(before[j]) if now.get(k) != before[j].get(k))
                name = getattr(o, "__qualname__", getattr(o, "__name__", type(o).__name__))
                _tripped.append([i, f"attributes of {name} changed: {changed[:5]}"])
                before[j] = now
    print(json.dumps({"tripped": _tripped, "loaded": loaded}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
