"""A small engine `Program` for tests and benchmarks: a frozen "target" and a tiny drafter.

Not DFlash: a stand-in with the same moving parts, cheap enough for a 2-core CPU.
- Target: a frozen random linear map on each target device; `produce(i)` draws inputs from a
  generator seeded by the item index (so a batch depends on its index only) and returns
  `{"x": inputs, "y": tanh(inputs @ W)}`.
- Drafter, `variant="mlp"`: Linear-Tanh-Linear regressing y from x (MSE).
  `variant="attention"`: one causal self-attention layer over (batch, seq, dim) sequences, the
  the 8-GPU trainer's shape of the problem: on CUDA it calls `flex_attention` with a causal block mask, forward
  and backward (compiled with `attention_backend="inductor"`, that is what hung three drafter
  threads); on CPU, where flex has no backward, dense causal attention (compiled likewise).
- `compile_backend`: compile each replica's forward with torch.compile (each replica its own
  compiled wrapper, as that trainer did); None = eager.
- `weighted`: return `(mean loss, rows)` after backpropagating the batch's sum, so the engine
  weights uneven micro-batches exactly (the way DFlash's Σ w·CE / Σ w loss needs).
- `trace_first_step`: replica 0 runs a plain `torch.fx.symbolic_trace` on its first step, as code
  that builds a graph lazily does; `on_trace(replica)` runs *inside* that trace, while the module-
  global FX flag is set (tests use it to choreograph the race deterministically).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from dflash.engine.engine import Program, Replica


@dataclass(frozen=True, kw_only=True)
class ToySpec:
    variant: Literal["mlp", "attention"] = "mlp"
    dim: int = 16  # feature width (attention: model width)
    hidden: int = 32  # mlp hidden width
    heads: int = 2  # attention heads (dim must divide)
    seq: int = 1  # tokens per sequence (attention); mlp ignores it
    batch: int = 8  # rows (mlp) or sequences (attention) per micro-batch
    seed: int = 0
    lr: float = 1e-2
    clip: float = 1.0
    compile_backend: str | None = None
    attention_backend: str | None = None  # compile the attention call alone (CUDA: flex_attention; CPU: dense)
    autocast: bool = False  # bf16 autocast on CUDA
    trace_first_step: bool = False
    on_trace: Callable[[Replica], None] | None = None
    shape_at: dict[int, int] | None = None  # item index -> a different batch size (a late recompile)
    weighted: bool = False  # return (loss, rows) and backprop the batch's sum: exact with uneven batches


class ToyMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class ToyAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.attend: Callable[..., torch.Tensor] = _dense_causal  # replaced per replica (compiled flex on CUDA)
        self.block_mask: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)  # 3 x (B, H, S, d)
        if self.block_mask is not None:
            o = self.attend(q, k, v, block_mask=self.block_mask)
        else:
            o = self.attend(q, k, v)
        return self.out(o.transpose(1, 2).reshape(B, S, D))  # (B, S, D)


class _LazyGraph(nn.Module):
    """What replica 0 traces on its first step; `hook` runs while Tracer.trace holds the FX flag."""

    def __init__(self, hook: Callable[[], None] | None) -> None:
        super().__init__()
        self.hook = hook

    def forward(self, x):
        if self.hook is not None:
            self.hook()
        return x * 2


def toy_program(spec: ToySpec = ToySpec()) -> Program:
    def make_producer(device: str) -> Callable[[int], Any]:
        g = torch.Generator().manual_seed(spec.seed + 1)
        w = (torch.randn(spec.dim, spec.dim, generator=g) / spec.dim ** 0.5).to(device)

        def produce(index: int) -> dict[str, torch.Tensor]:
            gi = torch.Generator().manual_seed(spec.seed * 1_000_003 + index)
            rows = (spec.shape_at or {}).get(index, spec.batch)
            shape = (rows, spec.dim) if spec.variant == "mlp" else (rows, spec.seq, spec.dim)
            x = torch.randn(*shape, generator=gi).to(device)
            with torch.no_grad():
                return {"x": x, "y": torch.tanh(x @ w)}
        return produce

    def make_replica(index: int, device: str) -> Replica:
        torch.manual_seed(spec.seed)
        model = (ToyMLP(spec.dim, spec.hidden) if spec.variant == "mlp" else ToyAttention(spec.dim, spec.heads))
        model = model.to(device)
        if isinstance(model, ToyAttention) and device.startswith("cuda"):
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            model.block_mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, spec.seq, spec.seq,
                                                 device=device)
            model.attend = (torch.compile(flex_attention, backend=spec.attention_backend) if spec.attention_backend
                            else flex_attention)
        elif isinstance(model, ToyAttention) and spec.attention_backend:
            model.attend = torch.compile(_dense_causal, backend=spec.attention_backend)
        opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
        fwd = torch.compile(model, backend=spec.compile_backend) if spec.compile_backend else model
        return Replica(index, device, model, opt, {"forward": fwd, "traced": False})

    def forward_backward(rep: Replica, batch: dict[str, torch.Tensor]) -> float:
        if spec.trace_first_step and rep.index == 0 and not rep.state["traced"]:
            rep.state["traced"] = True
            hook = (lambda: spec.on_trace(rep)) if spec.on_trace is not None else None
            torch.fx.symbolic_trace(_LazyGraph(hook))
        if spec.autocast and rep.device.startswith("cuda"):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = rep.state["forward"](batch["x"]).float()
        else:
            pred = rep.state["forward"](batch["x"])
        if spec.weighted:
            per_row = (pred - batch["y"]).pow(2).flatten(1).mean(-1)  # (rows,)
            per_row.sum().backward()
            return float(per_row.detach().mean()), float(per_row.numel())
        loss = F.mse_loss(pred, batch["y"])
        loss.backward()
        return float(loss.detach())

    def optimizer_step(rep: Replica, step: int) -> None:
        if spec.clip:
            torch.nn.utils.clip_grad_norm_(rep.model.parameters(), spec.clip)
        rep.optimizer.step()
        rep.optimizer.zero_grad(set_to_none=True)

    def tokens(batch: dict[str, torch.Tensor]) -> int:
        x = batch["x"]
        return int(x.shape[0] * (x.shape[1] if x.dim() == 3 else 1))

    return Program(make_producer=make_producer, make_replica=make_replica, forward_backward=forward_backward,
                   optimizer_step=optimizer_step, tokens=tokens)


def reference_run(spec: ToySpec, *, steps: int, replicas: int, grad_accum: int = 1, device: str = "cpu",
                  before_step: Callable[[int, nn.Module, float], None] | None = None) -> nn.Module:
    """The single-device equivalent of an engine run: one model, the same global batch per step
    (every replica's micro-batches concatenated), the same optimizer. For tests.
    `before_step(step, model, loss)` sees each step's gradients before the optimizer uses them."""
    prog = toy_program(spec)
    produce = prog.make_producer(device)
    rep = prog.make_replica(0, device)
    n = replicas * grad_accum
    for step in range(steps):
        items = [produce(step * n + j) for j in range(n)]
        x = torch.cat([b["x"] for b in items])
        y = torch.cat([b["y"] for b in items])
        loss = F.mse_loss(rep.model(x), y)
        loss.backward()
        if before_step is not None:
            before_step(step, rep.model, float(loss.detach()))
        prog.optimizer_step(rep, step)
    return rep.model
