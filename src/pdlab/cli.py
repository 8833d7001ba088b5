"""The `pdlab` command line: each room's commands, gathered. A command is a thin wrapper over a library function
in its room (`pdlab.<room>.cli`); this module only assembles them."""

from __future__ import annotations

import typer

from pdlab.benchmarks.cli import app as bench_app
from pdlab.calibration.cli import app as calibration_app
from pdlab.cluster.cli import app as cluster_app
from pdlab.deploy import cli as deploy_cli
from pdlab.experiment import cli as experiment_cli
from pdlab.model.cli import app as model_app
from pdlab.netlab.cli import app as netlab_app
from pdlab.router.cli import app as router_app
from pdlab.sim.cli import app as sim_model_app
from pdlab.workshop import cli as workshop_cli

app = typer.Typer(help="pdlab: disaggregated prefill/decode serving, for real, on your laptop.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
#: `pdlab sim ...`: the simulator's own commands (run, search) and the calibration wing's (lab, calibrate,
#: validate, ...), one group to the user.
sim_app = typer.Typer(help="Simulate P/D serving at cluster scale.", no_args_is_help=True)
sim_app.registered_commands += sim_model_app.registered_commands + calibration_app.registered_commands
app.add_typer(model_app, name="model")
app.add_typer(bench_app, name="bench")
app.add_typer(router_app, name="router")
app.add_typer(cluster_app, name="cluster")
app.add_typer(sim_app, name="sim")
app.add_typer(netlab_app, name="netlab")
app.add_typer(workshop_cli.app, name="workshop")
app.command("run")(experiment_cli.run)
app.command("demo")(experiment_cli.demo)
app.command("up")(deploy_cli.up)
app.command("status")(deploy_cli.status)
app.command("down")(deploy_cli.down)
app.command("restart")(deploy_cli.restart)
app.command("preflight")(workshop_cli.preflight)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
