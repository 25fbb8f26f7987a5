"""Where a long dflash run's wall time goes outside the steps (issue 28): process start -> first
optimizer step (cold and warm inductor cache, and --resume), the training time and disk a checkpoint
costs, and the engine's prewarm of 1 vs 3 drafter replicas on one device.

Runs the real `dflash train` CLI in subprocesses on a Qwen3-8B-shaped target with random bf16 weights
saved as a local Hugging Face directory (the tiny word-level tokenizer; no download) and 64 long
synthetic chats, the `qwen3_8b` recipe:

  1. cold:    an empty TORCHINDUCTOR_CACHE_DIR, `--max-steps 1` (one step, then the end checkpoint)
  2. warm:    a new run directory, the cache from 1 (cProfile of the whole process with --profile)
  3. resume:  `--resume --max-steps 2` on the run of 2
  4. stall:   `--max-steps S --set checkpoint.every=E --set checkpoint.keep_last=1`: the trainer's own
              report of the time each save blocked the loop (metrics.jsonl "checkpoint" events:
              blocked_s, write_s, bytes), step times after each save vs the median, disk at the end
  5. engine1: `--target-devices D --drafter-devices D` (1 replica), `--max-steps 2`
  6. engine3: `--drafter-devices D,D,D` (3 identical replicas on one device): prewarm wall, and per
              replica whether it compiled or reused replica 0's code, its seconds and dynamo frames
              (metrics.jsonl "engine" event); both engine runs count TORCH_LOGS=recompiles per function

Every stderr line of each process is stamped with the seconds since that process started; the CLI
prints each start phase with its time ("· first step: 2.1 s (at 14.3 s since process start)"). Run
directories are deleted once measured (an 8B checkpoint is 14.7 GB; the disk is 64 GiB).
Results: <out>/dflash_startup.json (+ <out>/startup_<run>.log, and warm.prof.txt and the raw warm.prof with
--profile).

Issue 39 (starts bounded by the machine): cold / warm / --resume only, each run's start phases
(imports, cuda, weights, target, data, drafter, resume state, trainer, first step: the ones that ran
in a thread say what they ran beside) and the time from process start to the first step done by
this script's clock (`first_step_outside_s`), printed as a table at the end:

  python benchmarks/dflash_startup.py --out $OUT --skip stall,engine1,engine3
  (--evict-target: the target's weights dropped from the page cache before each run: read from disk)

GPU (H200), all in one call:  python benchmarks/dflash_startup.py --out $OUT
                  or in two:  ... --skip engine1,engine3   then   ... --skip cold,warm,resume,stall
(the second call on the still-warm machine: --work keeps the target and the inductor cache; on a fresh
one engine1 compiles cold and engine3 does not, which the JSON shows as inductor_cache_files_before)
CPU smoke (tiny):             python benchmarks/dflash_startup.py --small --out /tmp/startup
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
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
    return {"name": name, "rc": rc, "wall_s": round(wall, 2), "lines": lines[-60:], "all_lines": lines}


IMPORT_PROBE = r"""
import collections, json, sys, time, traceback
t0 = time.perf_counter()
import torch, torch.library as tl
calls = collections.Counter()
def counted(real):
    def f(*a, **k):
        st = traceback.extract_stack(limit=16)[:-1]
        who = next((x.filename.split("site-packages/")[-1] for x in reversed(st)
                    if "torch/library.py" not in x.filename and "torch/_library" not in x.filename), "?")
        calls[who] += 1
        return real(*a, **k)
    return f
tl.Library.define = counted(tl.Library.define)
tl.custom_op = counted(tl.custom_op)
t1 = time.perf_counter()
import cli.dflash_main, dflash.run, dflash.training.trainer, transformers.models.qwen3.modeling_qwen3
import torch._dynamo, torch._inductor.compile_fx
print(json.dumps({"torch_s": round(t1 - t0, 2), "rest_s": round(time.perf_counter() - t1, 2),
                  "registrations": sum(calls.values()), "by_file": calls.most_common(25)}))
"""


def import_probe(env: dict, timeout: float) -> dict:
    """Import what `dflash train` imports, counting torch.library op registrations by the file that
    makes them (issue 28: 141 registrations took 5.6 s on the GPU image)."""
    p = subprocess.run([sys.executable, "-c", IMPORT_PROBE], env=env, cwd=str(ROOT), capture_output=True, text=True,
                       timeout=timeout)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"rc": p.returncode, "stderr": p.stderr[-2000:]}


def evict(paths: list[Path]) -> int:
    """Drop `paths` from the page cache (posix_fadvise DONTNEED; no root needed): the next read
    comes from the disk. Bytes evicted."""
    n = 0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return n


def rows_of(run_dir: Path) -> list[dict]:
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


PHASE = re.compile(r"· ([a-z][a-z ]*): ([0-9.]+) s \(at ([0-9.]+) s since process start\)(?:, read beside (.+))?")


def phases_of(r: dict) -> dict:
    """The start phases the CLI printed: name -> {seconds, at (since process start), stamp, and for a
    phase that ran in a thread beside others (the --resume checkpoint read) beside: their names}."""
    out = {}
    for stamp, line in r["all_lines"]:
        m = PHASE.search(line)
        if m:
            out[m.group(1)] = {"seconds": float(m.group(2)), "at": float(m.group(3)), "stamp": stamp}
            if m.group(4):
                out[m.group(1)]["beside"] = [x.strip() for x in m.group(4).split(",")]
    return out


def prewarm_of(pre: dict) -> dict:
    """The engine event's prewarm (PrewarmResult as JSON): wall time, per replica compiled/reused with
    its seconds and dynamo frames, and the frames compiled over every pass."""
    per = pre.get("per_replica") or []
    frames = sum(int(w.get("frames_compiled") or 0) for rep in pre.get("reports") or [] for w in rep.get("warm") or [])
    return {**{k: pre.get(k) for k in ("ok", "wall_s", "replicas", "replica_s", "verdicts")},
            "per_replica": [{k: w.get(k) for k in ("index", "device", "mode", "seconds", "frames_compiled", "reason")}
                            for w in per],
            "compiled_replicas": sum(w.get("mode") != "reused" for w in per), "frames_compiled_total": frames}


RECOMPILING = re.compile(r"Recompiling function (\S+) in (\S+)")


def recompiles_by_function(lines: list[str]) -> dict[str, int]:
    """TORCH_LOGS=recompiles: "Recompiling function forward in .../drafter.py:190" -> {"forward (drafter.py:190)": n}."""
    out: dict[str, int] = {}
    for line in lines:
        m = RECOMPILING.search(line)
        if m:
            key = f"{m.group(1)} ({m.group(2).rsplit('/', 1)[-1]})"
            out[key] = out.get(key, 0) + 1
    return out


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else 0


def stall_summary(rows: list[dict], every: int) -> dict:
    steps = [r for r in rows if "event" not in r and "seconds" in r]
    saves = [r for r in rows if r.get("event") == "checkpoint"]
    skipped = [r for r in rows if r.get("event") == "checkpoint-skipped"]
    times = sorted(r["seconds"] for r in steps[1:])  # the first step compiles
    median = statistics.median(times) if times else None
    after = []
    for c in saves:
        nxt = [r["seconds"] for r in steps if c["step"] < r["step"] <= c["step"] + min(5, every - 1)]
        after.append(round(statistics.mean(nxt), 4) if nxt else None)
    return {"median_step_s": median, "saves": [{k: c.get(k) for k in ("step", "blocked_s", "write_s", "bytes", "removed",
                                                                      "final")} for c in saves],
            "mean_step_s_after_each_save": after, "skipped": skipped}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--work", default="/tmp/dflash-startup", help="target dir, data, caches and runs")
    p.add_argument("--small", action="store_true", help="tiny target on CPU (smoke test)")
    p.add_argument("--profile", action="store_true", help="cProfile the warm run (top 60 by cumulative time)")
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per process")
    p.add_argument("--skip", default="", help="comma list of runs to skip: cold,warm,resume,stall,engine1,engine3")
    p.add_argument("--stall-steps", type=int, default=60, help="steps of the stall run")
    p.add_argument("--stall-every", type=int, default=20, help="checkpoint.every of the stall run (at 8B a save "
                                                               "writes ~15 s: space saves wider than that)")
    p.add_argument("--no-bytecode", action="store_true", help="keep PYTHONDONTWRITEBYTECODE as the environment has it "
                                                             "(default: bytecode cached under --work/pycache)")
    p.add_argument("--device", default=None, help="the engine runs' device (default cuda:0, cpu with --small)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run (dflash train --set), e.g. target.fp8=true")
    p.add_argument("--evict-target", action="store_true", help="drop the target's weights from the page cache "
                                                               "before each run (read from disk, as on a fresh machine)")
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
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           # plain baselines runs share (eval.baseline_cache): emptied with the cold run's inductor cache, so
           # the cold run's first eval measures it as on a fresh machine and the warm run's takes it
           "DFLASH_EVAL_CACHE": str(work / "eval-cache")}
    base = ["--recipe", "qwen3_8b", "--target", str(target), "--data", str(data)]
    dev = a.device or ("cpu" if a.small else "cuda:0")
    if a.small:
        base = ["--target", str(target), "--data", str(data), "--set", "data.max_length=512",
                "--set", "data.buckets=[256,512]", "--set", "eval.at_end=false"]
    for kv in a.set:
        base += ["--set", kv]
    skip = set(a.skip.split(","))
    import shutil

    if not a.no_bytecode:  # the GPU image sets PYTHONDONTWRITEBYTECODE=1: every process recompiled every module
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    t = time.perf_counter()
    result["imports"] = import_probe(env, a.timeout)  # also fills the bytecode cache before the timed runs
    result["imports"]["first_import_process_s"] = round(time.perf_counter() - t, 2)

    def measure(name: str, run_dir: Path, args: list[str], prof: Path | None = None, keep: bool = False,
                extra_env: dict | None = None) -> dict:
        evicted = evict(sorted(target.glob("*.safetensors"))) if a.evict_target else 0
        r = run(name, args, {**env, **(extra_env or {})}, out, a.timeout, prof)
        r["evicted_bytes"] = evicted
        r["phases"] = phases_of(r)
        # TORCH_LOGS=recompiles (engine runs): why a replica compiled again, in torch's words
        r["recompiles"] = [line for _, line in r["all_lines"] if "Recompiling function" in line
                           or "triggered by the following guard failure" in line or line.lstrip().startswith("- ")][:80]
        rows = rows_of(run_dir)
        r["metrics"] = [m for m in rows if "step" in m and "event" not in m][-3:]
        ck = run_dir / "checkpoints"
        r["checkpoint_bytes"] = {d.name: dir_bytes(d) for d in ck.glob("step_*")} if ck.is_dir() else {}
        r["checkpoint_events"] = [m for m in rows if m.get("event") in ("checkpoint", "checkpoint-skipped")]
        r["eval_events"] = [m for m in rows if m.get("event") == "periodic_eval"]  # with --set eval.every=N
        eng = [m for m in rows if m.get("event") == "engine"]
        if eng:
            pre = (eng[-1].get("report") or {}).get("prewarm") or {}
            r["prewarm"] = prewarm_of(pre)
        r["recompiles_by_function"] = recompiles_by_function(r["recompiles"])
        r["rows"] = rows
        del r["all_lines"]
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
        return r

    for old in work.glob("run-*"):  # an earlier invocation's run dirs: 14.7 GB each at 8B, and a new run refuses them
        if old.name != "run-warm" or "warm" not in skip:
            shutil.rmtree(old, ignore_errors=True)
    result["disk_free_bytes_at_start"] = shutil.disk_usage(work).free
    runs = []
    if "cold" not in skip:
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(work / "eval-cache", ignore_errors=True)
        runs.append(measure("cold", work / "run-cold", [*base, "--out", str(work / "run-cold"), "--max-steps", "1"]))
    if "warm" not in skip:
        shutil.rmtree(work / "run-warm", ignore_errors=True)
        prof = work / "warm.prof" if a.profile else None
        runs.append(measure("warm", work / "run-warm", [*base, "--out", str(work / "run-warm"), "--max-steps", "1"],
                            prof, keep="resume" not in skip))
        if prof is not None and prof.is_file():
            import io
            import pstats

            s = io.StringIO()
            st = pstats.Stats(str(prof), stream=s)
            st.sort_stats("cumulative").print_stats(60)
            st.sort_stats("tottime").print_stats(30)
            (out / "warm.prof.txt").write_text(s.getvalue())
            shutil.copy(prof, out / "warm.prof")  # the whole profile: pstats' print_callees on any function
    if "resume" not in skip and (work / "run-warm").is_dir():
        runs.append(measure("resume", work / "run-warm", ["--out", str(work / "run-warm"), "--resume", "--max-steps", "2"]))
    if "stall" not in skip:
        rd = work / "run-stall"
        shutil.rmtree(rd, ignore_errors=True)
        r = run_stall = measure("stall", rd, [*base, "--out", str(rd), "--max-steps", str(a.stall_steps),
                                              "--set", f"checkpoint.every={a.stall_every}", "--set", "checkpoint.keep_last=1"],
                                keep=True)
        r["stall"] = stall_summary(r["rows"], a.stall_every)
        r["disk_after_s_checkpoints"] = dir_bytes(rd / "checkpoints")
        shutil.rmtree(rd, ignore_errors=True)
        runs.append(run_stall)
    for name, replicas in (("engine1", 1), ("engine3", 3)):
        if name in skip:
            continue
        rd = work / f"run-{name}"
        shutil.rmtree(rd, ignore_errors=True)
        cached = sum(1 for f in cache.rglob("*") if f.is_file()) if cache.is_dir() else 0  # 0: this run compiles cold
        runs.append(measure(name, rd, [*base, "--out", str(rd), "--max-steps", "2", "--target-devices", dev,
                                       "--drafter-devices", ",".join([dev] * replicas)],
                            extra_env={"TORCH_LOGS": "recompiles"}))
        runs[-1]["inductor_cache_files_before"] = cached
    for r in runs:
        r.pop("rows", None)
    result["runs"] = runs
    result["summary"] = {**summarize(runs), "library_registrations": result["imports"].get("registrations")}
    (out / "dflash_startup.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result["summary"], indent=1, default=str))
    for r in runs:
        print(r["name"], r["rc"], r["wall_s"], "s")
    print(phase_table(runs))
    return 0


def phase_table(runs: list[dict]) -> str:
    """Per run: process start -> first step done by this script's clock, then each start phase the
    CLI printed (seconds, when it ended since process start, what it ran beside), in the order they ended."""
    lines = []
    for r in runs:
        fs = (r["phases"].get("first step") or {}).get("stamp")
        lines.append(f"{r['name']}: rc {r['rc']}, process start -> first step done {fs} s (outside clock), "
                     f"process wall {r['wall_s']} s")
        for name, ph in sorted(r["phases"].items(), key=lambda kv: kv[1]["at"]):
            beside = f"  beside {', '.join(ph['beside'])}" if ph.get("beside") else ""
            lines.append(f"  {name:<13} {ph['seconds']:7.2f} s   ended at {ph['at']:6.2f} s{beside}")
    return "\n".join(lines)


def summarize(runs: list[dict]) -> dict:
    """The numbers issue 28 asks for, one place: first step (since process start) per run, each
    run's start phases, checkpoint stall and size, disk after the stall run, prewarm 1 vs 3 replicas."""
    by = {r["name"]: r for r in runs}
    out: dict = {"first_step_done_at_s": {n: (r["phases"].get("first step") or {}).get("at") for n, r in by.items()},
                 # issue 39's measure: process start -> first step done by this script's clock (the line's stamp)
                 "first_step_outside_s": {n: (r["phases"].get("first step") or {}).get("stamp") for n, r in by.items()},
                 "phases_s": {n: {k: v["seconds"] for k, v in r["phases"].items()} for n, r in by.items()},
                 "rc": {n: r["rc"] for n, r in by.items()}}
    if "stall" in by:
        st = by["stall"]["stall"]
        out["checkpoint"] = {"blocked_s": [c["blocked_s"] for c in st["saves"]], "write_s": [c["write_s"] for c in st["saves"]],
                             "bytes": [c["bytes"] for c in st["saves"]], "median_step_s": st["median_step_s"],
                             "mean_step_s_after_each_save": st["mean_step_s_after_each_save"],
                             "disk_after_run_bytes": by["stall"]["disk_after_s_checkpoints"], "skipped": len(st["skipped"])}
    pre = {n: by[n].get("prewarm") for n in ("engine1", "engine3") if n in by}
    if pre:
        out["prewarm"] = pre
        for n in pre:
            pre[n] = {**(pre[n] or {}), "recompile_log_lines": len(by[n]["recompiles"]),
                      "recompiles_by_function": by[n].get("recompiles_by_function")}
        # engine1 runs first and meets a cold inductor cache, engine3 a warm one: their walls are not
        # comparable. Within engine3, replica 0 does exactly what a 1-replica prewarm does on the same
        # cache, so R replicas vs one is engine3's wall over its first replica's seconds.
        e3 = pre.get("engine3") or {}
        first = (e3.get("per_replica") or [{}])[0].get("seconds")
        if e3.get("wall_s") and first:
            out["prewarm"]["ratio_3_vs_1"] = round(e3["wall_s"] / first, 3)
            out["prewarm"]["ratio_basis"] = "engine3 prewarm wall / its replica 0's seconds (same cache state)"
    return out


if __name__ == "__main__":
    sys.exit(main())
