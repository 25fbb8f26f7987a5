"""Compile a small function (forward and backward) with inductor and print torch's cache counters as
JSON: a fresh process per call, so what hits came from the caches its environment points at."""

import json
import time

import torch

from compilewatch.tracing import torchcompat


def f(x, y):
    return (torch.sin(x) * y + x.cos()).sum()


t0 = time.perf_counter()
x = torch.randn(16, requires_grad=True)
y = torch.randn(16)
torch.compile(f, backend="inductor")(x, y).backward()
from torch._dynamo.utils import counters  # noqa: E402

print(json.dumps({"inductor": dict(counters["inductor"]), "aot_autograd": dict(counters["aot_autograd"]),
                  "remote": torchcompat.remote_cache_stats(), "seconds": time.perf_counter() - t0}))
