"""A real cache through every `compilewatch cache` step, on GPU (or CPU): does a moved cache still hit?

    python benchmarks/gpu_cache_roundtrip.py --out results/            # GPU if present, else CPU
    python benchmarks/gpu_cache_roundtrip.py --device cpu --out /tmp/r  # the CPU check

1. compile a workload in a fresh process into cache dir A (GPU: flex_attention fwd+bwd and a small
   MLP; CPU: a tiny function fwd+bwd), TRITON_CACHE_DIR unset so triton's kernels live inside A;
2. `cache fingerprint` and `cache verify` on A (entry stamps vs this machine's system key);
3. `cache save` A, `cache load` it into B at another path (load points triton's absolute kernel
   paths at B: `paths_rewritten`), `cache verify` B (expect no findings);
4. the same workload in a fresh process on B: FX-graph / AOTAutograd hits and misses, wall time;
5. Mega-Cache: a fresh process with an empty dir C preloads the archive's Mega-Cache
   (`compilewatch.cache.archive.load.load_mega_cache`), then runs the workload: hits and misses.

Writes `cache_roundtrip.json` and `cache_roundtrip.md` (plus each command's JSON) to --out ($OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKLOAD = r'''
import json, sys, time
import torch
from torch._dynamo.utils import counters
device = sys.argv[1]
mega = sys.argv[2] if len(sys.argv) > 2 else ""
loaded = None
if mega:
    from compilewatch.cache.archive.load import load_mega_cache
    loaded = load_mega_cache(mega)
t0 = time.perf_counter()
if device.startswith("cuda"):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    B, H, S, D = 1, 4, 512, 64
    q, k, v = (torch.randn(B, H, S, D, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    causal = lambda b, h, qi, ki: qi >= ki
    mask = create_block_mask(causal, None, None, S, S, device=device)
    out = torch.compile(flex_attention)(q, k, v, block_mask=mask)
    out.float().sum().backward()
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).to(device)
    torch.compile(mlp)(torch.randn(32, 256, device=device)).sum().backward()
    torch.cuda.synchronize()
else:
    def f(x, y):
        return (x.sin() + y.cos()).relu().sum(dim=-1)
    x = torch.randn(8, 16, requires_grad=True)
    torch.compile(f)(x, torch.randn(8, 16)).sum().backward()
wall = time.perf_counter() - t0
print(json.dumps({"wall_s": round(wall, 3), "mega_loaded": loaded,
                  **{k: dict(counters[k]) for k in ("inductor", "aot_autograd")}}))
'''


def run(cmd: list[str], env: dict, out_dir: Path, name: str, ok=(0,)) -> dict:
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t
    (out_dir / f"{name}.stdout").write_text(p.stdout)
    (out_dir / f"{name}.stderr").write_text(p.stderr)
    if p.returncode not in ok:
        raise SystemExit(f"{name} failed with exit {p.returncode}:\n{p.stderr[-3000:]}")
    try:
        data = json.loads(p.stdout.strip().splitlines()[-1] if name.startswith("workload") else p.stdout)
    except (ValueError, IndexError):
        data = {}
    return {"exit": p.returncode, "wall_s": round(wall, 2), "data": data}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="cuda:0 or cpu (default: cuda:0 when available)")
    ap.add_argument("--out", type=Path, default=os.environ.get("OUT"))
    ap.add_argument("--work", type=Path, default=None, help="scratch dir (default: a temp dir, removed)")
    args = ap.parse_args(argv)
    if args.out is None:
        raise SystemExit("give --out DIR (or set $OUT)")
    args.out.mkdir(parents=True, exist_ok=True)
    device = args.device
    if device is None:
        import torch

        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    work = args.work or Path(tempfile.mkdtemp(prefix="cw-roundtrip-"))
    a, b, c = work / "A" / "inductor", work / "B" / "moved-cache", work / "C" / "inductor"
    script = work / "workload.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(WORKLOAD)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    base["PYTHONPATH"] = str(ROOT)
    cw = [sys.executable, "-m", "cli.main", "cache"]
    r: dict = {"device": device, "work": str(work)}
    try:
        r["cold"] = run([sys.executable, str(script), device], dict(base, TORCHINDUCTOR_CACHE_DIR=str(a)), args.out, "workload_cold")
        r["fingerprint_A"] = run(cw + ["fingerprint", "--dir", str(a), "--json"], base, args.out, "fingerprint_A")
        r["verify_A"] = run(cw + ["verify", "--dir", str(a), "--json"], base, args.out, "verify_A", ok=(0, 1))
        archive = work / "cache.tar.gz"
        r["save"] = run(cw + ["save", str(archive), "--dir", str(a), "--json"], base, args.out, "save")
        r["load"] = run(cw + ["load", str(archive), "--dir", str(b), "--json"], base, args.out, "load")
        r["verify_B"] = run(cw + ["verify", "--dir", str(b), "--json"], base, args.out, "verify_B", ok=(0, 1))
        r["warm_moved"] = run([sys.executable, str(script), device], dict(base, TORCHINDUCTOR_CACHE_DIR=str(b)), args.out, "workload_warm_moved")
        c.mkdir(parents=True)
        r["warm_mega"] = run([sys.executable, str(script), device, str(archive)],
                             dict(base, TORCHINDUCTOR_CACHE_DIR=str(c)), args.out, "workload_warm_mega")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    (args.out / "cache_roundtrip.json").write_text(json.dumps(r, indent=2) + "\n")
    md = _markdown(r)
    (args.out / "cache_roundtrip.md").write_text(md + "\n")
    print(md)
    return r


def _counts(d: dict) -> str:
    ind, aot = d.get("inductor", {}), d.get("aot_autograd", {})
    return (f"FX graph {ind.get('fxgraph_cache_hit', 0)} hit / {ind.get('fxgraph_cache_miss', 0)} miss, "
            f"AOTAutograd {aot.get('autograd_cache_hit', 0)} hit / {aot.get('autograd_cache_miss', 0)} miss")


def _markdown(r: dict) -> str:
    fa, va, vb = r["fingerprint_A"]["data"], r["verify_A"]["data"], r["verify_B"]["data"]
    subs = ", ".join(f"{s['name']} {s['files']}" for s in fa.get("subcaches", []))
    rows = [
        ("cold compile into A", f"{r['cold']['data'].get('wall_s')} s; {_counts(r['cold']['data'])}"),
        ("cache A", f"{fa.get('files')} files, {fa.get('bytes')} B ({subs}); entries' system keys "
                    f"{fa.get('entry_system_keys')}; this machine {str(fa.get('system_key'))[:16]}…"),
        ("verify A", f"exit {r['verify_A']['exit']}, counts {va.get('counts')}"),
        ("save", f"{r['save']['data'].get('archive_bytes')} B, Mega-Cache {r['save']['data'].get('mega_cache')}, {r['save']['wall_s']} s"),
        ("load into another path B", f"{r['load']['wall_s']} s, triton .json files rewritten: "
                                     f"{r['load']['data'].get('paths_rewritten')}"),
        ("verify B", f"exit {r['verify_B']['exit']}, counts {vb.get('counts')}"),
        ("same workload on B, new process", f"{r['warm_moved']['data'].get('wall_s')} s; {_counts(r['warm_moved']['data'])}"),
        ("empty dir C + load_mega_cache, new process",
         f"{r['warm_mega']['data'].get('wall_s')} s; preloaded {r['warm_mega']['data'].get('mega_loaded')}; "
         f"{_counts(r['warm_mega']['data'])}"),
    ]
    return "\n".join([f"device {r['device']}", "", "| step | result |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


if __name__ == "__main__":
    main()
