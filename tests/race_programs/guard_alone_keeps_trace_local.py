"""Protected: the same trace-open-beside-a-warm-call race as symbolic_trace_open_beside_warm_call.py,
with only `CompileGuard()` created first (no warm, no freeze: the thread-local FX state is the part
that applies, and it acts from the moment the guard exists). Expected: no failure; the watcher sees
the flag set in the other thread and that the guard kept it local (`leak_prevented`)."""

import threading

import torch
import torch.fx

import compilewatch

WAIT = 60.0  # bound for one Event wait; a correct run never comes close


def record(errors: dict, thread: str, e: BaseException) -> None:
    errors.setdefault(thread, []).append(f"{type(e).__name__}: {e}")


def main() -> dict:
    errors: dict = {}
    guard = compilewatch.CompileGuard(thread_local=True)  # protects from here on
    try:
        score = torch.compile(lambda t: t.exp().sum(), backend="eager")
        x = torch.randn(3)
        score(x)
        inside, called = threading.Event(), threading.Event()

        def traced(a):
            inside.set()
            called.wait(WAIT)
            return a - 1

        def extractor():
            try:
                torch.fx.symbolic_trace(traced)
            except Exception as e:  # noqa: BLE001
                record(errors, "extractor", e)
            finally:
                inside.set()

        def worker():
            inside.wait(WAIT)
            try:
                score(x)
            except Exception as e:  # noqa: BLE001
                record(errors, "worker", e)
            finally:
                called.set()

        threads = [threading.Thread(target=extractor, name="extractor"),
                   threading.Thread(target=worker, name="worker")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
    finally:
        guard.close()
    return {"errors": errors}


if __name__ == "__main__":
    print(main())
