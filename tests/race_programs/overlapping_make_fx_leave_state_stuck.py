"""Two threads export with make_fx at the same time; the first one to start finishes first (the
order is forced with Events). Tracer.trace restores the FX flag and the module patch in the wrong
order: the state is left stuck for the whole process. Expected: a stuck-state failure (and, where
torch asserts, the failed trace), with the repair and prevention advice. The program repairs the
state at the end so the process stays usable."""

import threading

import torch
from torch.fx.experimental.proxy_tensor import make_fx

WAIT = 60.0  # bound for one Event wait; a correct run never comes close


def record(errors: dict, thread: str, e: BaseException) -> None:
    errors.setdefault(thread, []).append(f"{type(e).__name__}: {e}")


def main() -> dict:
    errors: dict = {}
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first_fn(a):
        first_in.set()
        second_in.wait(WAIT)
        return a + 1

    def second_fn(a):
        second_in.set()
        first_out.wait(WAIT)
        return a - 1

    def exporter_a():
        try:
            make_fx(first_fn)(torch.ones(3))
        except Exception as e:  # noqa: BLE001
            record(errors, "exporter-a", e)
        finally:
            first_in.set()
            first_out.set()

    def exporter_b():
        first_in.wait(WAIT)
        try:
            make_fx(second_fn)(torch.ones(3))
        except Exception as e:  # noqa: BLE001
            record(errors, "exporter-b", e)
        finally:
            second_in.set()

    threads = [threading.Thread(target=exporter_a, name="exporter-a"),
               threading.Thread(target=exporter_b, name="exporter-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    from compilewatch.tracing import fxpatch

    stuck = fxpatch.stuck_state().stuck  # the flag (where torch keeps it global) or the class-level Module patch
    try:  # a later compiled call in one thread shows what stuck state does
        torch.compile(lambda t: t + 1, backend="eager")(torch.ones(2))
    except Exception as e:  # noqa: BLE001
        record(errors, "MainThread", e)
    fxpatch.repair_state()
    return {"errors": errors, "stuck": stuck}


if __name__ == "__main__":
    print(main())
