"""What recording every cache lookup's key parts costs (issue 38): per lookup, against a cold compile,
and in store bytes per 1,000 lookups.

    .venv/bin/python benchmarks/explain_overhead.py [--lookups 1000] [--device cuda] [--json]

1. A cold compile (fresh TORCHINDUCTOR_CACHE_DIR) of a small forward+backward function with the
   recorder on; the time spent inside the recorder is summed (perf_counter around each record call)
   and compared with the compile's wall time (target: <= 2%).
2. The real debug lines of that compile's lookups are replayed `--lookups` times through the same
   recording path (a fresh graph digest and key each time, as a cold start of many graphs would be),
   into a fresh store: ms per lookup (target: <= 1 ms) and bytes per 1,000 lookups (target: <= 1 MB).
3. Compile time by phase (compilewatch.explain.timing): torch's own `dynamo_timed` step, entered 20,000
   times with the hook on and off; the difference per step, times the steps the cold compile timed,
   against the cold compile; and the one-time read of torch's source that says which phases it times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lookups", type=int, default=1000)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cpu", help="where the compiled function runs (cuda: inductor's triton path)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="explain-bench-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "cold")
    import torch

    from compilewatch.explain import record
    from compilewatch.explain import store as S

    rec = record.start(run="bench")
    spent = [0.0]
    captured: list[tuple[str, list[str]]] = []
    inner = rec.record

    def timed(kind, key, lines, hit, backward=None):
        t0 = time.perf_counter()
        inner(kind, key, lines, hit, backward)
        spent[0] += time.perf_counter() - t0
        if lines:
            captured.append((key, list(lines)))

    rec.record = timed

    def f(x, w):
        return torch.nn.functional.gelu(x @ w).sum(-1).softmax(-1)

    x = torch.randn(32, 64, device=args.device)
    w = torch.randn(64, 64, device=args.device, requires_grad=True)
    t0 = time.perf_counter()
    torch.compile(f)(x, w).sum().backward()
    cold = time.perf_counter() - t0
    lookups_cold = sum(a + b for a, b in ((v["hit"], v["miss"]) for v in rec.summary()["counts"].values()))
    steps_cold = (record.stop().get("compile_time") or {}).get("steps", 0)
    timing = _timing_cost()

    # replay: the same recording path into a fresh store, a new graph each time
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "replay")
    rec2 = record.Recorder(run="replay")
    n = args.lookups
    work = []
    for i in range(n):
        key, lines = captured[i % len(captured)]
        lines = [(f"[{i:016d}" + ln[17:]) if "] gm: " in ln[:80] else ln for ln in lines]
        work.append((f"{key[:40]}{i:012d}", lines))
    t0 = time.perf_counter()
    for key, lines in work:
        rec2.record("fxgraph", key, lines, False, False)
    per = (time.perf_counter() - t0) / n
    size = os.stat(S.store_dir(tmp / "replay") / S.FILE).st_size
    rec2.close()
    out = {"torch": torch.__version__, "cold_compile_s": round(cold, 3), "lookups_in_cold_compile": lookups_cold,
           "recording_in_cold_compile_s": round(spent[0], 5), "overhead_vs_cold_pct": round(100 * spent[0] / cold, 3),
           "debug_lines_per_lookup": len(captured[0][1]) if captured else 0,
           "per_lookup_ms": round(per * 1e3, 4), "store_bytes_per_1000": round(size * 1000 / n),
           "errors": rec.errors + rec2.errors, "timed_steps_in_cold_compile": steps_cold,
           "timing_per_step_us": timing["per_step_us"],
           "timing_in_cold_compile_pct": round(100 * steps_cold * timing["per_step_us"] / 1e6 / cold, 4),
           "timing_source_probe_ms": timing["probe_ms"]}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"torch {out['torch']}: cold compile {cold:.2f} s, {lookups_cold} lookups, recording {spent[0] * 1e3:.2f} ms "
              f"= {out['overhead_vs_cold_pct']:.3f}% of it")
        print(f"per lookup ({out['debug_lines_per_lookup']} debug lines): {out['per_lookup_ms']:.3f} ms; "
              f"store: {out['store_bytes_per_1000'] / 1e3:.0f} KB per 1,000 lookups")
        print(f"compile time by phase: {out['timing_per_step_us']:.2f} us per timed step x {steps_cold} steps = "
              f"{out['timing_in_cold_compile_pct']:.4f}% of the cold compile; reading torch's source for what it "
              f"times: {out['timing_source_probe_ms']:.1f} ms once a process")
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)


def _timing_cost(n: int = 20000) -> dict:
    """torch's own dynamo_timed step with the timing hook on and off (best of 3 each)."""
    from torch._dynamo.utils import dynamo_timed

    from compilewatch.explain import record
    from compilewatch.explain import timing as T

    def loop() -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            with dynamo_timed("explain_bench_step"):
                pass
        return (time.perf_counter() - t0) / n

    off = min(loop() for _ in range(3))
    record.start(run="bench-timing")
    on = min(loop() for _ in range(3))
    record.stop()
    T._exposed_memo.clear()
    t0 = time.perf_counter()
    T.exposed_events()
    return {"per_step_us": round(max(0.0, on - off) * 1e6, 3), "probe_ms": round((time.perf_counter() - t0) * 1e3, 2)}


if __name__ == "__main__":
    main()
