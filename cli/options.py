"""Option aliases shared by commands, so every command spells them the same way."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout (nothing else).")]
DeviceListOpt = Annotated[str, typer.Option("--device", "-d", help="Where to run: cpu, 0, cuda:1, or a list 0,1,2.")]
BackendOpt = Annotated[str, typer.Option("--backend", help="torch.compile backend: inductor, aot_eager or eager.")]

# dflash: one device, or the engine's device lists (compilewatch.devices.spec.normalize_device reads every name)
DeviceOpt = Annotated[Optional[str], typer.Option(
    "--device", "-d", help="One device: cpu, cuda, cuda:N or N (default auto: the first GPU, else cpu).")]
