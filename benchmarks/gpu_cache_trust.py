"""Does compilewatch accept a real GPU inductor cache? Layout recognition, pickle scan, save -> load.

Builds a cache the way users do: `dflash train` (tiny recipe, compiled drafter layers and flex
attention, `--device` on CUDA, a few steps) in a child process with a fresh TORCHINDUCTOR_CACHE_DIR,
then asks compilewatch what a user's `cache` commands would:
- layout: `cache_evidence`, `unknown_entries`, `looks_like_cache`, and what the unexpected entries hold;
- pickles: every file that starts like a pickle, scanned by `compilewatch.cache.trust.picklescan` (nothing
  is loaded); the globals it refuses, with counts and one file each;
- `cache verify` findings by kind;
- `cache save` to an archive, `cache verify ARCHIVE` of it twice (members in memory, then every member
  streamed and scanned as its opcodes ask, what a member over 256 MiB gets: they must agree), then
  `cache load` of it into a fresh dir (the seeds' lost-cache case).

    GPU:  python benchmarks/gpu_cache_trust.py --out $OUT        (~1-2 min on an H200)
    CPU:  python benchmarks/gpu_cache_trust.py --device cpu --out /tmp/ct
Writes <out>/cache_trust.json; exit 1 when compilewatch refuses or misreads the cache it just watched torch write.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRAIN = """
import sys
from dflash.config import RECIPES, apply_overrides
from dflash.run import train
cfg = apply_overrides(RECIPES["tiny"](), {{"topology.device": {device!r}, "train.max_steps": {steps},
                                        "checkpoint.out_dir": {out!r}, "eval.at_end": False}})
out = train(cfg)
print("trained", out.mode, out.result.steps if hasattr(out.result, "steps") else "")
"""


def build_cache(cache: Path, device: str, steps: int, work: Path) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), PYTHONPATH=f"{ROOT}{os.pathsep}" + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", TRAIN.format(device=device, steps=steps, out=str(work / "run"))],
                       env=env, capture_output=True, text=True, cwd=ROOT)
    return {"rc": p.returncode, "wall_s": round(time.perf_counter() - t0, 1),
            "tail": (p.stdout + p.stderr)[-3000:]}


def layout_facts(cache: Path) -> dict:
    from compilewatch.cache.local import layout

    unknown = layout.unknown_entries(cache)
    # what is inside the top-level names the layout does not expect (the names a fix has to learn)
    inside = [f"{name}{f.name}" for name in unknown if name.endswith("/")
              for f in sorted((cache / name).iterdir())][:40]
    return {"evidence": list(layout.cache_evidence(cache)), "unknown_entries": list(unknown),
            "looks_like_cache": layout.looks_like_cache(cache), "inside_unknown_entries": inside,
            "top_level": sorted(p.name + ("/" if p.is_dir() else "") for p in cache.iterdir())[:60]}


def pickle_facts(cache: Path) -> dict:
    from compilewatch.cache.trust import picklescan

    refused: collections.Counter = collections.Counter()
    example: dict[str, str] = {}
    problems: list[str] = []
    n = 0
    for f in sorted(p for p in cache.rglob("*") if p.is_file()):
        with open(f, "rb") as fh:
            head = fh.read(2)
        if not picklescan.is_pickle_file(str(f.relative_to(cache)), head):  # every file torch would unpickle
            continue
        n += 1
        r = picklescan.scan(f.read_bytes())
        for g in r.refused:
            refused[g] += 1
            example.setdefault(g, str(f.relative_to(cache)))
        if r.problem:
            problems.append(f"{f.relative_to(cache)}: {r.problem}")
    return {"pickles": n, "refused": [{"global": g, "count": c, "example": example[g]} for g, c in refused.most_common()],
            "problems": problems[:20]}


def verify_facts(cache: Path) -> dict:
    from compilewatch.cache.content.verify import verify

    rep = verify(cache)
    kinds = collections.Counter(f.kind for f in rep.findings)
    return {"ok": rep.ok, "kinds": dict(kinds), "first": [f"{f.kind}: {f.path}: {f.detail}" for f in rep.findings[:10]]}


def roundtrip(cache: Path, work: Path) -> dict:
    from compilewatch.cache.archive import load as archive_load
    from compilewatch.cache.archive import save as archive_save
    from compilewatch.errors import CompilewatchError

    arc = work / "cache.tar.gz"
    out: dict = {}
    try:
        s = archive_save.save(arc, cache)
        out["save"] = {"ok": True, "files": s.files, "bytes": arc.stat().st_size}
    except CompilewatchError as e:
        return {"save": {"ok": False, "error": e.message}}
    except Exception as e:  # noqa: BLE001 - a benchmark reports what broke
        return {"save": {"ok": False, "error": f"{type(e).__name__}: {e}"}}
    out["verify_archive"] = verify_archive_both_ways(arc)
    try:
        r = archive_load.load(arc, work / "loaded")
        out["load"] = {"ok": True, "files": getattr(r, "files", None)}
    except CompilewatchError as e:
        out["load"] = {"ok": False, "error": e.message, "hint": getattr(e, "hint", None)}
    except Exception as e:  # noqa: BLE001
        out["load"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return out


def verify_archive_both_ways(arc: Path) -> dict:
    """`cache verify ARCHIVE` as it runs (members up to 256 MiB in memory), then with every member
    streamed from the archive and every pickle scanned as its opcodes ask (what a member over 256 MiB
    gets): the two must agree. Seconds of each."""
    import time as _time

    from compilewatch.cache.archive import check as archive_check
    from compilewatch.cache.archive import reader as provenance
    from compilewatch.cache.trust import picklescan

    res = {}
    for how, in_memory, whole in (("in_memory", provenance.IN_MEMORY, picklescan.READ_WHOLE), ("streamed", 0, 0)):
        old = provenance.IN_MEMORY, picklescan.READ_WHOLE
        provenance.IN_MEMORY, picklescan.READ_WHOLE = in_memory, whole
        try:
            t0 = _time.perf_counter()
            rep = archive_check.verify_archive(arc)
            res[how] = {"ok": rep.ok, "verdict": rep.provenance.verdict, "members": rep.members,
                        "pickles_scanned": rep.pickles_scanned, "findings": [f"{f.kind}: {f.member}" for f in rep.findings],
                        "seconds": round(_time.perf_counter() - t0, 3)}
        finally:
            provenance.IN_MEMORY, picklescan.READ_WHOLE = old
    a, b = res["in_memory"], res["streamed"]
    res["agree"] = all(a[k] == b[k] for k in ("ok", "verdict", "members", "pickles_scanned", "findings"))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--cache", help="inspect this existing cache instead of building one")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cache = Path(a.cache) if a.cache else work / "inductor"
        result: dict = {"device": a.device} if not a.cache else {"cache": str(cache)}
        if not a.cache:
            result["build"] = build_cache(cache, a.device, a.steps, work)
        for name, fn in (("layout", layout_facts), ("pickles", pickle_facts), ("verify", verify_facts),
                         ("roundtrip", lambda c: roundtrip(c, work))):
            try:
                result[name] = fn(cache)
            except Exception as e:  # noqa: BLE001 - a check reports what broke and goes on
                result[name] = {"error": f"{type(e).__name__}: {e}"}
            (out / "cache_trust.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, indent=1, default=str)[:6000])
    bad = (not result["layout"].get("looks_like_cache") or result["layout"].get("unknown_entries")
           or result["pickles"].get("refused") or "error" in result["pickles"] or "error" in result["verify"]
           or not result["roundtrip"].get("load", {}).get("ok")
           or not result["roundtrip"].get("verify_archive", {}).get("agree")
           or not result["roundtrip"].get("verify_archive", {}).get("in_memory", {}).get("ok"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
