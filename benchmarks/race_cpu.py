"""The race table of docs/race.md, measured on CPU for the installed torch (one column per run).

    python benchmarks/race_cpu.py --trials 20            # prints a JSON object, one key per row
    for v in 2.11.0 2.13.0 2.14.1 2.15.0; do PYTHONPATH=$PWD /work/venvs/t$v/bin/python benchmarks/race_cpu.py; done

Rows (each trial: fresh threads, Events decide the order, so no timing luck is involved except in
`dynamo_compile_vs_calls`, which is the seeds' free-running race):
- `symbolic_trace_vs_compiled_call` / `make_fx_vs_compiled_call`: thread B holds a trace open (the
  traced function waits on an Event) while thread A calls a warm compiled function; counts A's errors.
- `symbolic_trace_vs_eager_module`: the same, A calls a plain nn.Linear; counts A's errors.
- `overlapping_traces`: two symbolic traces overlap in two threads (A enters, B enters, A leaves
  first); counts trials that raised, and trials that left the FX flag (checked in the main thread and
  in the thread that traced) or nn.Module.__call__ / CURRENT_PATCHER set afterwards.
- `dynamo_compile_vs_calls`: thread B compiles (aot_eager, fwd + bwd, a new function each trial)
  while thread A calls a warm compiled function in a loop; counts trials where any of A's calls failed.
- `dynamo_config_per_thread`, `fx_flag`, `headline`: compilewatch.tracing.torchcompat's probes.
Stuck state is repaired (compilewatch.tracing.fxpatch.repair_state) after every trial.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.race_cases import WAIT, leak_trial, overlap_trial  # noqa: E402 - the tests' own trials, after sys.path


def overlap() -> tuple[bool, dict[str, bool]]:
    """Two overlapping symbolic traces (tests/race_cases.overlap_trial): did either raise, what stayed stuck."""
    from compilewatch.tracing import fxpatch

    t = overlap_trial()
    st = fxpatch.stuck_state()
    stuck = {"flag": bool(st.flag or any(t.flags_after)), "module_call": st.module_call_patched,
             "patcher": st.patcher_left}
    fxpatch.repair_state()
    return (t.setter_error is not None or t.victim_error is not None), stuck


def compile_vs_calls(k: int) -> bool:
    import torch

    step = torch.compile(lambda x: x.sin() + 1, backend="eager")
    x = torch.randn(4)
    step(x)
    stop = threading.Event()
    failed: list[BaseException] = []

    def caller():
        while not stop.is_set():
            try:
                step(x)
            except Exception as e:  # noqa: BLE001
                failed.append(e)
                return

    def compiler():
        try:
            f = torch.compile(eval(f"lambda w: (w * {k + 2}).cos().sum()"), backend="aot_eager", dynamic=False)
            w = torch.randn(8, requires_grad=True)
            f(w).backward()
        finally:
            stop.set()

    t = threading.Thread(target=caller)
    t.start()
    compiler()
    t.join(WAIT)
    return bool(failed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--compile-trials", type=int, default=10)
    a = ap.parse_args()
    import torch

    from compilewatch.tracing import fxpatch, torchcompat

    step = torch.compile(lambda x: x.sin() + 1, backend="eager")
    x = torch.randn(4)
    step(x)
    lin = torch.nn.Linear(4, 4)
    out: dict = {"torch": torch.__version__, "trials": a.trials}
    for name, tracer, call in (("symbolic_trace_vs_compiled_call", "symbolic_trace", lambda: step(x)),
                               ("make_fx_vs_compiled_call", "make_fx", lambda: step(x)),
                               ("symbolic_trace_vs_eager_module", "symbolic_trace", lambda: lin(x))):
        errors: dict[str, int] = {}
        for _ in range(a.trials):
            victim_err = leak_trial(call, tracer).victim_error
            fxpatch.repair_state()
            if victim_err is not None:
                key = f"{type(victim_err).__name__}: {str(victim_err)[:60]}"
                errors[key] = errors.get(key, 0) + 1
        out[name] = {"errors": sum(errors.values()), "kinds": errors}
    raised = 0
    stuck = {"flag": 0, "module_call": 0, "patcher": 0}
    for _ in range(a.trials):
        r, s = overlap()
        raised += r
        for k, v in s.items():
            stuck[k] += v
    out["overlapping_traces"] = {"raised": raised, "stuck": stuck}
    fails = 0
    for k in range(a.compile_trials):
        torch._dynamo.reset()
        fails += compile_vs_calls(k)
    out["dynamo_compile_vs_calls"] = {"trials": a.compile_trials, "failed": fails}
    race = torchcompat.race_facts()
    out["fx_flag"] = race.fx_flag
    out["headline"] = race.headline
    out["dynamo_config_per_thread"] = torchcompat.dynamo_config_per_thread()
    out["compiling_flag_held_for_session"] = torchcompat.compiling_flag_held_for_session()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
