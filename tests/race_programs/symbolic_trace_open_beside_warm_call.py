"""A feature-extraction thread runs `torch.fx.symbolic_trace` on a preprocessing function (held open
until the worker has called once), while a worker thread calls an already-warm compiled scoring
function. The worker's call raises the nested-FX error: the race. No dynamo compile is involved, so
warm + freeze cannot prevent it; only the thread-local FX state can (docs/guard.md). Expected: a
flag-leak failure naming both threads, advice that leads with the thread-local fix."""

import threading

import torch
import torch.fx

WAIT = 60.0  # bound for one Event wait; a correct run never comes close


def record(errors: dict, thread: str, e: BaseException) -> None:
    errors.setdefault(thread, []).append(f"{type(e).__name__}: {e}")


def main() -> dict:
    errors: dict = {}
    score = torch.compile(lambda t: (t * 3).relu().sum(), backend="eager")
    x = torch.randn(5)
    score(x)  # warm: no compile happens in the threads
    inside, called = threading.Event(), threading.Event()

    def preprocess(a):
        inside.set()
        called.wait(WAIT)
        return a.abs() + 1

    def extractor():
        try:
            torch.fx.symbolic_trace(preprocess)
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

    threads = [threading.Thread(target=extractor, name="extractor"), threading.Thread(target=worker, name="worker")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    return {"errors": errors}


if __name__ == "__main__":
    print(main())
