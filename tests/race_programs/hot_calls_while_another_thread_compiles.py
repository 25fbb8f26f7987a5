"""Clean: a serving thread calls a warm compiled module in a tight loop while a trainer thread
compiles a new loss with backward (aot_eager, dynamic=False). A custom op's fake kernel, which runs
while dynamo and AOTAutograd trace the loss, waits each time until the serving thread has made more
calls, so the calls really overlap the compile (no sleeps, no luck). On torch 2.13 nothing fails
(`is_compiling()` is held for the whole compile session); the module calls pass through the
trainer's class-level nn.Module.__call__ patch and return. Expected: no failure; those calls are
labelled risks (no harm observed). On torch <= 2.12 the same program may fail for real: the test then
requires that the failure is reported."""

import threading

import torch

WAIT = 60.0  # bound for one Event wait; a correct run never comes close
CALLS_PER_TRACE = 20  # serving calls that must happen inside each trace of the loss


def record(errors: dict, thread: str, e: BaseException) -> None:
    errors.setdefault(thread, []).append(f"{type(e).__name__}: {e}")


def main() -> dict:
    errors: dict = {}
    progress = threading.Condition()
    calls = [0]
    held = [0]  # traces of the loss that waited for serving calls
    trainer_done = threading.Event()
    serving_done = threading.Event()  # the serving thread stopped (its error is recorded): nothing more to wait for

    @torch.library.custom_op("race_programs::gate", mutates_args=())
    def gate(t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    @gate.register_fake
    def _(t):  # runs while the loss is being traced: hold the trace open for more serving calls
        with progress:
            target = calls[0] + CALLS_PER_TRACE
            progress.wait_for(lambda: calls[0] >= target or trainer_done.is_set() or serving_done.is_set(), WAIT)
            if calls[0] >= target:
                held[0] += 1
        return torch.empty_like(t)

    gate.register_autograd(lambda ctx, grad: grad)

    serve = torch.compile(torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()), backend="eager")
    x = torch.randn(6)
    serve(x)  # warm

    def serving():
        try:
            while not trainer_done.is_set():
                serve(x)
                with progress:
                    calls[0] += 1
                    progress.notify_all()
        except Exception as e:  # noqa: BLE001
            record(errors, "serving", e)
        finally:  # a trace waiting for more serving calls stops waiting now (torch <= 2.12: the calls may fail)
            with progress:
                serving_done.set()
                progress.notify_all()

    def trainer():
        try:
            loss = torch.compile(lambda t: gate(t * t).sum(), backend="aot_eager", dynamic=False)
            w = torch.randn(6, requires_grad=True)
            loss(w).backward()
        except Exception as e:  # noqa: BLE001
            record(errors, "trainer", e)
        finally:
            trainer_done.set()

    threads = [threading.Thread(target=serving, name="serving"), threading.Thread(target=trainer, name="trainer")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    return {"errors": errors, "serving_calls": calls[0], "overlapped_traces": held[0]}


if __name__ == "__main__":
    print(main())
