"""`dflash check` at 8B (issue 40): how long checking a run's export takes, timed from outside the process.

A Qwen3-8B-shaped target with random bf16 weights saved as a local Hugging Face directory (the tiny
word-level tokenizer, as benchmarks/dflash_startup.py makes it), 64 long synthetic chats, one training
step of the `qwen3_8b` recipe (its export is the checkpoint), then

    dflash check RUN --target TARGET --data CHATS -n 16 --json

in a fresh process, its wall time by this script's clock (process start to exit: imports, target load,
the static checks, 16 prompts decoded speculatively). Random weights accept little, so τ here says
nothing about a real drafter; the time is what a user waits.

    GPU (H200):  python benchmarks/dflash_check_8b.py --out $OUT
    CPU smoke:   python benchmarks/dflash_check_8b.py --small --out /tmp/check8b
Writes <out>/dflash_check_8b.json; exit 1 when a step fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dflash_startup import make_data, make_target  # noqa: E402

MAIN = "import sys; from cli.dflash_main import main; sys.exit(main())"


def dflash(args: list[str], env: dict, timeout: float) -> dict:
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-c", MAIN, *args], capture_output=True, text=True, env=env,
                           timeout=timeout, cwd=str(ROOT))
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", e.stdout or "", e.stderr or ""
    return {"args": args, "rc": rc, "wall_s": round(time.perf_counter() - t0, 2), "stdout": out[-20000:],
            "stderr_tail": (err if isinstance(err, str) else err.decode(errors="replace"))[-3000:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--work", default="/tmp/dflash-check-8b")
    ap.add_argument("--small", action="store_true", help="tiny target on CPU (smoke test)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_args(argv)
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    target, data, run = work / "target", work / "chats.jsonl", work / "run"
    shutil.rmtree(run, ignore_errors=True)
    result: dict = {"machine": os.uname().nodename, "argv": sys.argv}
    result["target_build_s"] = round(make_target(target, a.small), 2)
    make_data(data, 64, 300 if a.small else 3000)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # the GPU image sets it: every process recompiles every module
    env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    train = ["train", "--target", str(target), "--data", str(data), "--out", str(run), "--max-steps", "1",
             "--set", "eval.at_end=false", "--set", "data.regenerate=false"]
    if a.small:
        train += ["--set", "data.max_length=512", "--set", "data.buckets=[256,512]"]
    else:
        train = ["train", "--recipe", "qwen3_8b", *train[1:]]
    result["train"] = t = dflash(train, env, a.timeout)
    if t["rc"] != 0:
        (out / "dflash_check_8b.json").write_text(json.dumps(result, indent=1))
        print(json.dumps({"train": {k: t[k] for k in ("rc", "wall_s", "stderr_tail")}}, indent=1))
        return 1
    check = ["check", str(run), "--target", str(target), "--data", str(data), "-n", str(a.prompts), "--json"]
    result["check"] = c = dflash(check, env, a.timeout)
    try:
        report = json.loads(c["stdout"])
    except ValueError:
        report = None
    result["check_report"] = report
    (out / "dflash_check_8b.json").write_text(json.dumps(result, indent=1))
    summary = {"target_build_s": result["target_build_s"], "train_wall_s": t["wall_s"],
               "check_rc": c["rc"], "check_wall_s": c["wall_s"], "prompts": a.prompts}
    if isinstance(report, dict):
        summary.update({k: report.get(k) for k in ("verdict", "ok", "exit_code") if k in report})
        m = report.get("measured") or report.get("acceptance") or {}
        if isinstance(m, dict):
            summary.update({k: m.get(k) for k in ("tau", "prompts", "seconds") if k in m})
    print(json.dumps(summary, indent=1))
    if c["rc"] not in (0, 1):
        print(c["stderr_tail"])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
