"""An exporter thread symbolic-traces a small model (held open until the other thread has run)
while an inference thread runs a different, plain eager nn.Sequential. The eager call goes through
the exporter's class-level nn.Module.__call__ patch and raises "NameError: module is not installed
as a submodule". Expected: a module-call-leak failure carrying that NameError, named as the known
pattern, with the thread-local fix."""

import threading

import torch
import torch.fx

WAIT = 60.0  # bound for one Event wait; a correct run never comes close


def record(errors: dict, thread: str, e: BaseException) -> None:
    errors.setdefault(thread, []).append(f"{type(e).__name__}: {e}")


class Exported(torch.nn.Module):
    def __init__(self, inside: threading.Event, done: threading.Event) -> None:
        super().__init__()
        self.inside, self.done = inside, done

    def forward(self, a):
        self.inside.set()
        self.done.wait(WAIT)
        return a * 2


def main() -> dict:
    errors: dict = {}
    inside, done = threading.Event(), threading.Event()
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())
    x = torch.randn(2, 3)

    def exporter():
        try:
            torch.fx.symbolic_trace(Exported(inside, done))
        except Exception as e:  # noqa: BLE001
            record(errors, "exporter", e)
        finally:
            inside.set()

    def inference():
        inside.wait(WAIT)
        try:
            model(x)
        except Exception as e:  # noqa: BLE001
            record(errors, "inference", e)
        finally:
            done.set()

    threads = [threading.Thread(target=exporter, name="exporter"), threading.Thread(target=inference, name="inference")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    return {"errors": errors}


if __name__ == "__main__":
    print(main())
