"""A hot thread serves requests through a warm compiled module while a trainer thread compiles a
loss `x ** p` for p = 2, 3, 4 with backward (aot_eager). The second and third compiles fail with
torch's "NYI SymInt equality" assert: automatic dynamic shapes turn the recompile dynamic (p becomes
a SymInt) and the backward of pow hits the assert. The same happens with one thread: not the race.
The hot thread's calls do nothing wrong. Expected: the compile failure leads, named as the known
torch bug with its fix; nothing from the hot thread is called a failure."""

import threading

import torch

WAIT = 60.0  # bound for one Event wait; a correct run never comes close


def record(errors: dict, thread: str, e: BaseException) -> None:
    errors.setdefault(thread, []).append(f"{type(e).__name__}: {e}")


def main() -> dict:
    errors: dict = {}
    served = torch.compile(torch.nn.Linear(4, 4), backend="eager")
    x = torch.randn(2, 4)
    served(x)  # warm
    hot_started, trainer_done = threading.Event(), threading.Event()
    calls = [0]

    def hot():
        try:
            while not trainer_done.is_set():
                served(x)
                calls[0] += 1
                hot_started.set()
        except Exception as e:  # noqa: BLE001
            record(errors, "hot", e)
        finally:
            hot_started.set()

    def trainer():
        loss = torch.compile(lambda t, p: (t ** p).sum(), backend="aot_eager")
        hot_started.wait(WAIT)
        try:
            for p in (2, 3, 4):
                t = torch.randn(8, requires_grad=True)
                try:
                    loss(t, p).backward()
                except Exception as e:  # noqa: BLE001 - the program keeps its errors, as real code does
                    record(errors, "trainer", e)
        finally:
            trainer_done.set()

    threads = [threading.Thread(target=hot, name="hot"), threading.Thread(target=trainer, name="trainer")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    return {"errors": errors, "hot_calls": calls[0]}


if __name__ == "__main__":
    out = main()
    print({k: len(v) for k, v in out["errors"].items()}, "hot calls:", out["hot_calls"])
