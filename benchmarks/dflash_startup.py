"""Where a long dflash run's wall time goes outside the steps: process start -> first optimizer step
(cold and warm inductor cache, and --resume), and the training time a checkpoint costs.

Runs the real `dflash train` CLI in subprocesses on a Qwen3-8B-shaped target with random bf16 weights
saved as a local Hugging Face directory (the tiny word-level tokenizer; no download) and 64 long
synthetic chats, the `qwen3_8b` recipe:

  1. cold:   an empty TORCHINDUCTOR_CACHE_DIR, `--max-steps 1` (one step, then the end checkpoint)
  2. warm:   a new run directory, the cache from 1 (cProfile of the whole process with --profile)
  3. resume: `--resume --max-steps 2` on the run of 2

Every stderr line of each process is stamped with the seconds since that process started, so the
phases the CLI prints show where startup goes; the metrics.jsonl of each run gives the step times.
Results: <out>/dflash_startup.json (+ <out>/startup_<run>.log, and warm.prof.txt with --profile).

GPU (H200):       python benchmarks/dflash_startup.py --out $OUT --profile
CPU smoke (tiny): python benchmarks/dflash_startup.py --small --out /tmp/startup
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1_000_000.0)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)


def make_target(path: Path, small: bool) -> float:
    """A random Qwen3 (8B shape, or small) with the tiny tokenizer, saved as safetensors; seconds taken."""
    import torch
    from transformers import Qwen3ForCausalLM

    try:
        from dflash.model.target import build_tiny_tokenizer, tiny_target_config
    except ImportError:  # before dflash's rooms
        from dflash.target import build_tiny_tokenizer, tiny_target_config

    t0 = time.perf_counter()
    if (path / "config.json").is_file():
        return 0.0
    tok = build_tiny_tokenizer()
    fields = dict(SMALL if small else QWEN3_8B)
    cfg = tiny_target_config(fields.pop("vocab_size", len(tok)), **fields)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    return time.perf_counter() - t0


def make_data(path: Path, n: int, words_per_chat: int) -> None:
    try:
        from dflash.model.target import tiny_words
    except ImportError:
        from dflash.target import tiny_words

    words = tiny_words()
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as fh:
        for _ in range(n):
            q = " ".join(rng.choice(words) for _ in range(words_per_chat // 10))
            a = " ".join(rng.choice(words) for _ in range(words_per_chat))
            fh.write(json.dumps({"messages": [{"role": "user", "content": q},
                                              {"role": "assistant", "content": a}]}) + "\n")


def run(name: str, args: list[str], env: dict, out: Path, timeout: float, profile: Path | None = None) -> dict:
    """One `dflash train` process; every stderr/stdout line stamped with seconds since its start."""
    code = "import sys; from cli.dflash_main import main; sys.exit(main())"
    if profile is not None:  # cProfile's own CLI takes no -c; its run() keeps the profile on SystemExit
        code = f"import cProfile; from cli.dflash_main import main; cProfile.run('main()', {str(profile)!r})"
    cmd = [sys.executable, "-c", code, "train", *args]
    t0 = time.perf_counter()
    lines: list[tuple[float, str]] = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                            errors="replace", cwd=str(ROOT))

    def pump() -> None:
        for line in proc.stdout:
            lines.append((round(time.perf_counter() - t0, 2), line.rstrip()[:400]))

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    th.join(5)
    wall = time.perf_counter() - t0
    (out / f"startup_{name}.log").write_text("\n".join(f"{t:8.2f}  {s}" for t, s in lines) + "\n")
    return {"name": name, "rc": rc, "wall_s": round(wall, 2), "lines": lines[-60:]}


def steps_of(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    if not p.is_file():
        return []
    rows = []
    for line in p.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--work", default="/tmp/dflash-startup", help="target dir, data, caches and runs")
    p.add_argument("--small", action="store_true", help="tiny target on CPU (smoke test)")
    p.add_argument("--profile", action="store_true", help="cProfile the warm run (top 60 by cumulative time)")
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per process")
    p.add_argument("--skip", default="", help="comma list of runs to skip: cold,warm,resume")
    a = p.parse_args(argv)
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    target, data = work / "target", work / "chats.jsonl"
    result: dict = {"machine": os.uname().nodename, "argv": sys.argv}
    result["target_build_s"] = round(make_target(target, a.small), 2)
    make_data(data, 64, 300 if a.small else 3000)
    cache = work / "inductor"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1", "COLUMNS": "200",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    base = ["--recipe", "qwen3_8b", "--target", str(target), "--data", str(data)]
    if a.small:
        base = ["--target", str(target), "--data", str(data), "--set", "data.max_length=512",
                "--set", "data.buckets=[256,512]"]
    skip = set(a.skip.split(","))
    runs = []
    if "cold" not in skip:
        runs.append(run("cold", [*base, "--out", str(work / "run-cold"), "--max-steps", "1"], env, out, a.timeout))
    if "warm" not in skip:
        prof = work / "warm.prof" if a.profile else None
        runs.append(run("warm", [*base, "--out", str(work / "run-warm"), "--max-steps", "1"], env, out, a.timeout, prof))
        if prof is not None and prof.is_file():
            import io
            import pstats

            s = io.StringIO()
            st = pstats.Stats(str(prof), stream=s)
            st.sort_stats("cumulative").print_stats(60)
            st.sort_stats("tottime").print_stats(30)
            (out / "warm.prof.txt").write_text(s.getvalue())
    if "resume" not in skip:
        runs.append(run("resume", ["--out", str(work / "run-warm"), "--resume", "--max-steps", "2"], env, out, a.timeout))
    for r in runs:
        rd = work / f"run-{r['name'] if r['name'] != 'resume' else 'warm'}"
        r["metrics"] = [m for m in steps_of(rd) if "step" in m][-3:]
        ck = rd / "checkpoints"
        r["checkpoint_bytes"] = {d.name: sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
                                 for d in ck.glob("step_*")} if ck.is_dir() else {}
    result["runs"] = runs
    (out / "dflash_startup.json").write_text(json.dumps(result, indent=1, default=str))
    for r in runs:
        print(r["name"], r["rc"], r["wall_s"], "s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
