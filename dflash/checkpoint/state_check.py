"""A training state checked against the model and optimizer it is about to be loaded into.

`torch.load(weights_only=True)` guarantees a training_state.pt holds only tensors and plain values;
it says nothing about whether they fit. `nn.Module.load_state_dict` and `Optimizer.load_state_dict`
check little (the optimizer replaces its hyperparameters with whatever the file holds and never
compares a moment's shape with its parameter), so a tensor of the wrong shape, a missing key, a
string where a tensor belongs or a moment of another parameter's shape fails later, mid-step, as
a traceback. `check_training_state` compares the whole state first and raises one BadInput listing
what does not fit; it mutates nothing, so a refused state leaves the trainer as it was.

What is checked:
- `step`: an int (not a bool), 0 <= step <= the run's total steps;
- `model`: exactly the module's state_dict keys; each a dense tensor of the same shape and dtype;
- `optimizer`: {"state", "param_groups"}; as many groups as the optimizer, each listing as many
  parameter ids as the live group, every id once; each hyperparameter the live group has is there
  (lr, betas, eps and weight_decay are required: torch does not default them) with a value of its
  type and range, and what the step computes (maximize, amsgrad, decoupled_weight_decay) as the
  live optimizer's (how it runs, foreach/fused/capturable/differentiable, is kept from the live
  optimizer on load: `load_optimizer_state`); per-parameter state only for listed ids, each a dict
  whose tensors (exp_avg, exp_avg_sq, ...) are floating point and shaped like their parameter, and
  whose `step` is one finite number >= 0; an Adam/AdamW entry has both moments (and
  max_exp_avg_sq under amsgrad).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from compilewatch import BadInput

REQUIRED_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")  # torch's Adam.__setstate__ defaults the rest
# group options that say how this process runs the step, not what it computes: a checkpoint written on
# CUDA (fused) resumes on CPU, so the live optimizer's values are kept (load_optimizer_state)
IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")
SHOWN = 4  # problems listed in the message (the count says how many more)


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {v.dtype} tensor of shape {tuple(v.shape)}"
    return f"a {type(v).__name__}"


def _number(v: Any) -> float | None:
    """v as a finite float when it is a real number (an int, a float, a one-element real tensor)."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.is_complex() or v.dtype == torch.bool or v.layout != torch.strided or v.is_meta:
            return None
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:  # an int past float's range (a pickle holds ints of any size)
        return None
    return f if math.isfinite(f) else None


def _dense(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta


def check_step(step: Any, total_steps: int | None) -> list[str]:
    if isinstance(step, bool) or not isinstance(step, int):
        return [f"'step' is {_describe(step)}, not an int"]
    if step < 0:
        return [f"'step' is {step}, not a step count (>= 0)"]
    if total_steps is not None and step > total_steps:
        return [f"'step' is {step}, past this run's {total_steps} steps (raise train.max_steps to continue it)"]
    return []


def check_model(model_state: Any, expected: dict[str, torch.Tensor]) -> list[str]:
    if not isinstance(model_state, dict):
        return [f"'model' is {_describe(model_state)}, not a dict of tensors"]
    problems = []
    missing = [k for k in expected if k not in model_state]
    unexpected = [k for k in model_state if k not in expected]
    if missing:
        problems.append(f"'model' lacks {len(missing)} tensors ({', '.join(map(repr, missing[:3]))})")
    if unexpected:
        problems.append(f"'model' has {len(unexpected)} tensors the drafter does not "
                        f"({', '.join(repr(str(k))[:80] for k in unexpected[:3])})")
    for k, want in expected.items():
        got = model_state.get(k)
        if k not in model_state:
            continue
        if not _dense(got):
            problems.append(f"model[{k!r}] is {_describe(got)}, not a tensor")
        elif tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            problems.append(f"model[{k!r}] is {_describe(got)}, the drafter's is {_describe(want)}")
    return problems


def _group_value_problem(key: str, got: Any, live: Any) -> str | None:
    """Why `got` cannot stand for the live group's `live` value of `key` (None: it can)."""
    if key in IMPLEMENTATION_FLAGS:  # how this process runs the step: the live value is kept on load
        return None if got is None or isinstance(got, bool) else "true/false"
    if isinstance(live, bool):  # what the step computes (maximize, amsgrad, decoupled weight decay)
        return None if got is live else f"{live}, as this run's optimizer"
    if key == "betas" or isinstance(live, tuple):
        n = len(live) if isinstance(live, tuple) else 2
        if not isinstance(got, (tuple, list)) or len(got) != n or any(_number(b) is None for b in got):
            return f"{n} numbers"
        if key == "betas" and not all(0.0 <= _number(b) < 1.0 for b in got):
            return "numbers in [0, 1)"
        return None
    if isinstance(live, (int, float, torch.Tensor)):
        x = _number(got)
        if x is None:
            return "a finite number"
        if key == "eps" and x <= 0 or key in ("lr", "weight_decay") and x < 0:
            return "a number > 0" if key == "eps" else "a number >= 0"
        return None
    if isinstance(live, str):
        return None if isinstance(got, str) else "a string"
    if live is None:
        return None if got is None or isinstance(got, (bool, int, float, str)) else "a plain value"
    return None


def check_optimizer(opt_state: Any, optimizer: torch.optim.Optimizer) -> list[str]:
    if not isinstance(opt_state, dict) or not isinstance(opt_state.get("state"), dict) \
            or not isinstance(opt_state.get("param_groups"), list):
        return ["'optimizer' is not an optimizer state ({'state': {...}, 'param_groups': [...]})"]
    groups, live_groups = opt_state["param_groups"], optimizer.param_groups
    if len(groups) != len(live_groups):
        return [f"'optimizer' has {len(groups)} parameter groups, the optimizer {len(live_groups)}"]
    problems: list[str] = []
    params_of: dict[int, tuple[torch.Tensor, dict]] = {}  # saved id -> (live parameter, its saved group)
    for gi, (g, live) in enumerate(zip(groups, live_groups)):
        name = f"optimizer group {gi}"
        if not isinstance(g, dict):
            problems.append(f"{name} is {_describe(g)}, not a dict")
            continue
        ids = g.get("params")
        if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            problems.append(f"{name}: 'params' is not a list of parameter ids")
            continue
        if len(ids) != len(live["params"]):
            problems.append(f"{name} lists {len(ids)} parameters, the optimizer's {len(live['params'])}")
            continue
        for i, p in zip(ids, live["params"]):
            if i in params_of:
                problems.append(f"{name}: parameter id {i} is listed twice")
            params_of[i] = (p, g)
        for key, want in live.items():
            if key in ("params", "param_names"):
                continue
            if key not in g:
                if key in REQUIRED_GROUP_KEYS:
                    problems.append(f"{name} lacks {key!r}")
                continue
            why = _group_value_problem(key, g[key], want)
            if why:
                problems.append(f"{name}: {key!r} is {_describe(g[key])}, expected {why}")
        for key in g.keys() - live.keys():  # a newer torch's option: kept only if it is a plain value
            if not (g[key] is None or isinstance(g[key], (bool, int, float, str))):
                problems.append(f"{name}: {str(key)[:40]!r} is {_describe(g[key])}, not an optimizer option")
    if problems:  # the groups do not fit: per-parameter state cannot be matched to parameters
        return problems
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    for pid, entry in opt_state["state"].items():
        if isinstance(pid, bool) or not isinstance(pid, int) or pid not in params_of:
            problems.append(f"optimizer state for parameter {str(pid)[:40]!r}, which no group lists")
            continue
        param, g = params_of[pid]
        where = f"optimizer state[{pid}]"
        if not isinstance(entry, dict):
            problems.append(f"{where} is {_describe(entry)}, not a dict")
            continue
        if adam:
            need = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if g.get("amsgrad") else [])
            lacks = [k for k in need + ["step"] if k not in entry]
            if lacks:
                problems.append(f"{where} lacks {', '.join(map(repr, lacks))}")
        for key, v in entry.items():
            if key == "step":
                x = _number(v)
                if x is None or x < 0:
                    problems.append(f"{where}['step'] is {_describe(v)}{'' if x is None else f' = {x:g}'}, "
                                    "expected one finite number >= 0")
            elif not _dense(v) or not v.is_floating_point():
                problems.append(f"{where}[{str(key)[:40]!r}] is {_describe(v)}, expected a floating-point tensor")
            elif tuple(v.shape) != tuple(param.shape):
                problems.append(f"{where}[{str(key)[:40]!r}] has shape {tuple(v.shape)}, "
                                f"its parameter {tuple(param.shape)}")
    return problems


def check_training_state(state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         total_steps: int | None, where: str) -> None:
    """BadInput listing what in `state` does not fit `model` and `optimizer` (module docstring);
    nothing is modified."""
    problems = check_step(state.get("step"), total_steps)
    saved_total = state.get("total_steps")
    if saved_total is not None and (isinstance(saved_total, bool) or not isinstance(saved_total, int) or saved_total < 0):
        problems.append(f"'total_steps' is {_describe(saved_total)}, not a step count")
    problems += check_model(state.get("model"), model.state_dict())
    problems += check_optimizer(state.get("optimizer"), optimizer)
    if problems:
        more = f" (and {len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
        raise BadInput(f"{where!r} does not fit this run's drafter and optimizer: " + "; ".join(problems[:SHOWN]) + more,
                       hint="it is damaged or from another run: resume from another checkpoint "
                            "(write its name into checkpoints/latest)")


def load_optimizer_state(optimizer: torch.optim.Optimizer, opt_state: dict[str, Any]) -> None:
    """`optimizer.load_state_dict(opt_state)` (checked by check_optimizer first), keeping this
    optimizer's IMPLEMENTATION_FLAGS: torch would take them from the file, and a CUDA run's
    `fused`/`capturable` fail on CPU parameters."""
    live = [{k: g[k] for k in IMPLEMENTATION_FLAGS if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(opt_state)
    for g, flags in zip(optimizer.param_groups, live):
        for k in IMPLEMENTATION_FLAGS:
            if k in flags:
                g[k] = flags[k]
            else:
                g.pop(k, None)


def restore_training_state(state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                           total_steps: int | None, where: str) -> int:
    """Load `state` (a Trainer's state_dict) into `model` and `optimizer` after checking that all of it
    fits (check_training_state: BadInput with nothing changed when it does not). Returns its step."""
    check_training_state(state, model, optimizer, total_steps, where)
    model.load_state_dict(state["model"])
    load_optimizer_state(optimizer, state["optimizer"])
    return int(state["step"])
