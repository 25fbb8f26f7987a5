"""Clean: three workers each call their own compiled step (and one shared eager module) after all
of them were compiled one after another in the main thread. Nothing traces while the threads run.
Expected: no finding at all (no failure, no risk)."""

import threading

import torch

WAIT = 60.0  # bound for one Event wait; a correct run never comes close


def record(errors: dict, thread: str, e: BaseException) -> None:
    errors.setdefault(thread, []).append(f"{type(e).__name__}: {e}")


def main() -> dict:
    errors: dict = {}
    norm = torch.nn.LayerNorm(4)
    steps = [torch.compile(lambda t, k=k: (t * k).tanh().mean(), backend="aot_eager") for k in range(3)]
    x = torch.randn(3, 4, requires_grad=True)
    for s in steps:  # warm, sequentially, forward and backward
        s(x).backward()
    start = threading.Barrier(3)

    def worker(i: int):
        try:
            start.wait(WAIT)
            for _ in range(50):
                steps[i](norm(x)).backward()
        except Exception as e:  # noqa: BLE001
            record(errors, f"worker-{i}", e)

    threads = [threading.Thread(target=worker, args=(i,), name=f"worker-{i}") for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    return {"errors": errors}


if __name__ == "__main__":
    print(main())
