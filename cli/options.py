"""Option aliases shared by commands, so every command spells them the same way."""

from __future__ import annotations

from typing import Annotated

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout (nothing else).")]
DeviceOpt = Annotated[str, typer.Option("--device", "-d", help="Where to run: cpu, 0, cuda:1, or a list 0,1,2.")]
BackendOpt = Annotated[str, typer.Option("--backend", help="torch.compile backend: inductor (default), aot_eager, eager.")]
