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
    raise BadInput(f"unknown device {spec!r}", hint="expected an index like 0, cuda:N or cpu")


def parse_device(spec: str) -> str:
    """Normalize one device spec (normalize_device) and check that this process can use it."""
    s = normalize_device(spec)
    visible = visible_devices()
    if s not in visible:
        raise BadInput(
            f"device {spec!r} is not visible to this process",
            hint=f"visible devices: {', '.join(visible)} (check CUDA_VISIBLE_DEVICES)",
        )
    return s


def parse_devices(specs: str | list[str]) -> list[str]:
    """Parse a comma-separated list (or a list) of device specs; duplicates are an error."""
    items = specs.split(",") if isinstance(specs, str) else list(specs)
    devices = [parse_device(x) for x in items]
    if not devices:
        raise BadInput("no devices given", hint="e.g. --devices 0,1 or --devices cpu")
    dupes = sorted({d for d in devices if devices.count(d) > 1})
    if dupes and dupes != ["cpu"]:
        raise BadInput(f"device listed twice: {', '.join(dupes)}", hint="list each GPU once")
    return devices
