"""Option aliases shared by commands, so every command spells them the same way."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout (nothing else).")]
DeviceListOpt = Annotated[str, typer.Option("--device", "-d", help="Where to run: cpu, 0, cuda:1, or a list 0,1,2.")]
BackendOpt = Annotated[str, typer.Option("--backend", help="torch.compile backend: inductor (default), aot_eager, eager.")]

# dflash: one device, or the engine's device lists (compilewatch.devices.spec.normalize_device reads every name)
DeviceOpt = Annotated[Optional[str], typer.Option(
    "--device", "-d", help="One device: cpu, cuda, cuda:N or N (default auto: the first GPU, else cpu).")]
TargetDevicesOpt = Annotated[Optional[str], typer.Option(
    "--target-devices", help="Target workers, one thread per entry: 0,1,2,3,4 (cpu and repeats allowed). "
                             "With --drafter-devices: train with the multi-device engine.")]
DrafterDevicesOpt = Annotated[Optional[str], typer.Option(
    "--drafter-devices", help="Drafter replicas, one thread per entry: 5,6,7; replica 0 (the trainer) runs on the "
                              "first. Every replica's step is compiled in the main thread first, one device after "
                              "another; then compiling is frozen.")]
