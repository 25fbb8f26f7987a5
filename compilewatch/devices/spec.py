"""Parse and validate device lists (`5,6,7`, `cuda:0`, `cpu`) for probe, warm and dflash."""

from __future__ import annotations

from compilewatch.errors import BadInput


def visible_devices() -> list[str]:
    """Devices this process can use: `cpu` plus `cuda:i` for every visible GPU."""
    import torch

    out = ["cpu"]
    if torch.cuda.is_available():
        out += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return out


def normalize_device(spec: str) -> str:
    """One device spec's name, syntax only (nothing is asked of torch): `5` -> `cuda:5`, `cuda` ->
    `cuda:0`, `cpu`, `cuda:N`. A config names devices of the machine it will run on."""
    s = spec.strip().lower()
    if not s:
        raise BadInput("empty device name", hint="use an index like 0, a name like cuda:1, or cpu")
    if s.isdigit():
        return f"cuda:{int(s)}"
    if s == "cuda":
        return "cuda:0"
    if s == "cpu":
        return s
    if s.startswith("cuda:") and s[5:].isdigit():
        return f"cuda:{int(s[5:])}"
    from compilewatch.inputs import one_line

    raise BadInput(f"unknown device {one_line(repr(spec), 80)}", hint="expected an index like 0, cuda:N or cpu")


def parse_device(spec: str) -> str:
    """Normalize one device spec (normalize_device) and check that this process can use it."""
    return parse_devices([spec])[0]


def parse_devices(specs: str | list[str]) -> list[str]:
    """Parse a comma-separated list (or a list) of device specs; duplicates are an error, and so is
    any device this process cannot use (one message naming every device asked for and why)."""
    items = specs.split(",") if isinstance(specs, str) else list(specs)
    devices = [normalize_device(x) for x in items]
    if not devices:
        raise BadInput("no devices given", hint="list devices like 0,1 or cuda:0, or cpu")
    visible = visible_devices()
    missing = [d for d in devices if d not in visible]
    if missing:
        raise not_visible(devices, missing, visible)
    dupes = sorted({d for d in devices if devices.count(d) > 1})
    if dupes and dupes != ["cpu"]:
        raise BadInput(f"device listed twice: {', '.join(dupes)}", hint="list each GPU once")
    return devices


def not_visible(asked: list[str], missing: list[str], visible: list[str]) -> BadInput:
    """The BadInput for devices this process cannot use: what was asked, which are missing, and why
    (a CPU-only torch, no CUDA driver or GPU, CUDA_VISIBLE_DEVICES hiding them, or too few GPUs)."""
    import os

    import torch

    gpus = [d for d in visible if d != "cpu"]
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    from compilewatch.inputs import one_line

    asked_s = one_line(", ".join(asked), 200)  # a list of 10,000 devices is named in part
    if missing == asked:
        which = "none of them is" if len(asked) > 1 else "it is not"
    else:
        which = ", ".join(missing) + (" is not" if len(missing) == 1 else " are not")
    if torch.version.cuda is None:
        why, hint = (f"this torch ({torch.__version__}) is a CPU-only build",
                     "install a CUDA build of torch for GPUs, or run on the CPU (device cpu)")
    elif not gpus and cvd is not None and cvd.strip() in ("", "-1"):
        why, hint = (f"CUDA_VISIBLE_DEVICES={cvd!r} hides every GPU",
                     "unset CUDA_VISIBLE_DEVICES or list the GPUs in it, or run on the CPU (device cpu)")
    elif not gpus:
        why, hint = ("no CUDA driver or GPU is present (torch.cuda.is_available() is False)",
                     "run on a machine with an NVIDIA GPU and its driver (`compilewatch gpus` says what the "
                     "driver reports), or run on the CPU (device cpu)")
    else:
        why = f"this process sees {len(gpus)} GPU(s): {', '.join(gpus)}"
        hint = ("indices count the visible GPUs from 0"
                + (f" (CUDA_VISIBLE_DEVICES={cvd!r} renumbers them)" if cvd else ""))
    return BadInput(f"asked for {asked_s}: {which} visible to this process: {why}", hint=hint)
