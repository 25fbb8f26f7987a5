"""Float comparisons for equivalence tests (split batch vs whole, engine vs one device, ranks vs one
device): compare quantities that are equal in exact arithmetic, with tolerances from float32 rounding.

Why not weights after an optimizer step: Adam's update is ~lr·sign(g) where |g| is tiny, so rounding
noise in a near-zero gradient becomes an lr-sized weight difference. Gradients and losses before the
step are what the splits must agree on.

The bound. A float32 sum of n addends computed in two different orders (another micro-batch split,
vector width, thread layout, reduction tree) differs by at most 2·n·eps32·Σ|addends| per element
(the textbook γ_n bound, doubled for two orders). Through a whole forward+backward the rounding of
each layer feeds the next, so we use it per tensor with a scale of the tensor's own largest
magnitude: |got - want| ≤ n·eps32·(|want| + max|want|) elementwise, i.e. rtol = atol/max = n·eps32,
where n is the reduction size the caller names (the number of summed token terms). An element that
cancels to ~0 is still allowed the error of its large addends, which is what breaks plain rtol tests.
"""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps  # 1.19e-7


def reduction_tol(terms: int) -> float:
    """Relative float32 rounding allowed for a sum of `terms` addends in another order: terms·eps32."""
    return max(1, terms) * EPS32


def assert_same_sum(got: torch.Tensor, want: torch.Tensor, *, terms: int, msg: str = "") -> None:
    """`got` and `want` are the same float32 reduction over `terms` addends, computed in different
    orders: elementwise within terms·eps32·(|want| + max|want|) (see the module docstring)."""
    tol = reduction_tol(terms)
    scale = float(want.detach().abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale, msg=msg or None)


def assert_same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, terms: int) -> None:
    """Every parameter's gradient, as `assert_same_sum` (one parameter per message)."""
    assert got.keys() == want.keys()
    for name in want:
        assert_same_sum(got[name], want[name], terms=terms, msg=name)


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter's gradient (zeros where a parameter has none)."""
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}
