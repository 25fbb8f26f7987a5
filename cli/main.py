"""`compilewatch`: the root app. It only wires commands; each lives in its own module."""

from __future__ import annotations

import compilewatch
from cli import cache as cache_cli
from cli import env as env_cli
from cli import doctor as doctor_cli
from cli import gpus as gpus_cli
from cli import probe as probe_cli
from cli import warm as warm_cli
from cli import run as run_cli
from cli import timeline as timeline_cli
from cli.app import make_root_app, run_app

app = make_root_app(
    "compilewatch",
    "Diagnose torch.compile in threaded programs: FX-tracing races, the inductor cache, environments.",
    compilewatch.__version__,
    """compilewatch: see what torch.compile does across threads, caches and environments.

    Exit codes: 0 ok, 1 a finding or failed check, 2 bad input or usage.
    """,
)


app.command("probe")(probe_cli.probe_cmd)
app.add_typer(cache_cli.app, name="cache")
app.command("lock")(env_cli.lock_cmd)
app.command("diff-env")(env_cli.diff_env_cmd)
app.command("warm")(warm_cli.warm_cmd)
app.command("gpus")(gpus_cli.gpus_cmd)
app.command("doctor")(doctor_cli.doctor_cmd)
app.command("timeline")(timeline_cli.timeline_cmd)
app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(run_cli.run_cmd)


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
