"""The `bidirl` command line: parses arguments and calls into the `bidirl` library, nothing more.

Every command that takes a pipeline accepts ``key=value`` overrides after the YAML path, e.g.
``bidirl run pipelines/cpu-tiny.yaml train.steps=20 logging.wandb_mode=disabled``.
User errors print one line and exit non-zero; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Callable, List, Optional

import typer

from bidirl.errors import BidirlError

class OneLineUsageErrors(typer.Typer):
    """The command line, whose usage errors (an unknown option, an option's bad value, a missing argument)
    are one line naming the command, and exit 2, as every other bad input is: click draws them as a
    usage line and a box. Bare ``bidirl`` still shows the help."""

    def __call__(self, *args: object, **kwargs: object) -> None:
        from typer.exceptions import TyperException

        try:
            code = super().__call__(*args, standalone_mode=False, **kwargs)  # (returns a typer.Exit's code)
        except TyperException as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # (`bidirl` alone: the help, as before)
                exc.show()
            else:
                where = f"{exc.ctx.command_path}: " if getattr(exc, "ctx", None) is not None else ""
                typer.echo(f"error: {where}{exc.format_message()} (see --help)", err=True)
            sys.exit(getattr(exc, "exit_code", 2))
        except typer.Abort:
            typer.echo("interrupted", err=True)
            sys.exit(130)
        sys.exit(code or 0)


app = OneLineUsageErrors(
    help="bidirl: asynchronous, disaggregated RL post-training with bidirectional device borrowing.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

@app.callback()
def options(quiet: bool = typer.Option(False, "--quiet", help="No progress bars or notes (for CI); errors and "
                                       "results still print.")) -> None:
    """bidirl: asynchronous, disaggregated RL post-training with bidirectional device borrowing."""
    if quiet:
        import os

        from bidirl.ui import QUIET_VARIABLE

        os.environ[QUIET_VARIABLE] = "1"


PIPELINE = typer.Argument(..., help="Pipeline YAML file (see pipelines/).")
OVERRIDES = typer.Argument(None, help="key=value overrides, e.g. train.steps=20", show_default=False)
DEBUG = typer.Option(False, "--debug", help="Show the full traceback on errors.")


def _guard(action: Callable[[], None], debug: bool) -> None:
    """Runs a command; a user error becomes one line on stderr and its exit code."""
    try:
        action()
    except BidirlError as exc:
        if debug:
            raise
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(exc.exit_code)
    except KeyboardInterrupt as exc:  # (its message, where a command gives one: how to resume)
        typer.echo(f"interrupted{': ' + str(exc) if str(exc) else ''}", err=True)
        raise typer.Exit(130)


def _is_override(text: str) -> bool:
    """``key=value`` rather than a pipeline file: a dotted key before the first '=' (its value may be a
    path, ``output_dir=/tmp/x``, or end in .yaml), and no such file."""
    key = text.split("=", 1)[0]
    return "=" in text and re.fullmatch(r"[A-Za-z_][\w.]*", key) is not None and not Path(text).is_file()


def _config(pipeline: Path, overrides: Optional[List[str]]):
    from bidirl.config import load_config

    return load_config(pipeline, overrides or [])


@app.command()
def run(pipeline: Path = PIPELINE, overrides: Optional[List[str]] = OVERRIDES,
        dry_run: bool = typer.Option(False, "--dry-run", help="Validate, print the plan and the torchrun command "
                                     "of every node; start, write and download nothing."),
        from_stage: Optional[str] = typer.Option(None, "--from", help="Run this stage and the ones after it "
                                                 "again, into an existing run directory (--run-dir)."),
        only_stage: Optional[str] = typer.Option(None, "--only", help="Run only this stage again, into an "
                                                 "existing run directory (--run-dir)."),
        run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="The run directory --from/--only "
                                               "continue (default: this pipeline's newest under output_dir)."),
        resume: Optional[Path] = typer.Option(None, "--resume", help="Continue this run directory: its launch "
                                              "stage from the latest good checkpoint, then the stages after it."),
        debug: bool = DEBUG) -> None:
    """Run a pipeline's stages in order (prepare_model -> profile -> plan -> launch ...) into one run directory."""
    from bidirl.pipeline import dry_run as check, latest_run, run_pipeline

    def action() -> None:
        cfg = _config(pipeline, overrides)
        if sum(x is not None for x in (from_stage, only_stage, resume)) > 1:
            raise BidirlError("--from, --only and --resume: give one of them")
        if dry_run and (from_stage or only_stage or resume or run_dir):  # (it would have checked none of them)
            raise BidirlError("--dry-run checks a pipeline as a new run: leave out --from, --only, --resume and "
                              "--run-dir")
        if run_dir is not None and not (from_stage or only_stage):  # (a new run, or --resume's own directory)
            raise BidirlError(f"--run-dir {run_dir}: names the run directory --from or --only run stages again "
                              "in; give one of them (--resume takes the run directory itself)")
        if dry_run:
            return check(cfg, str(pipeline), list(overrides or []))
        if resume is not None:
            run_pipeline(cfg, resume, resume=True)
            return
        first = from_stage or only_stage
        if first is None:
            run_pipeline(cfg)
        else:
            earlier = run_dir or latest_run(cfg)
            if earlier is None:
                flag = "--only" if only_stage else "--from"
                raise BidirlError(f"{flag} {first}: no earlier run of pipeline '{cfg.name}' under {cfg.output_dir} to "
                                  "run it again in (pass --run-dir)")
            run_pipeline(cfg, earlier, first, only=bool(only_stage))

    _guard(action, debug)


@app.command("prepare-model")
def prepare_model(pipeline: Path = PIPELINE, overrides: Optional[List[str]] = OVERRIDES, debug: bool = DEBUG) -> None:
    """Build (or reuse from cache) the pipeline's base model and print where it is."""

    def action() -> None:
        from bidirl.models.sources import prepare_model as prepare
        from bidirl.runtime_env import prepare_process
        from bidirl.ui import say

        cfg = _config(pipeline, overrides)
        prepare_process(cfg.cluster.device_type)
        prepared = prepare(cfg, report=say)
        typer.echo(prepared.path)

    _guard(action, debug)


@app.command()
def evaluate(pipeline: Path = PIPELINE, overrides: Optional[List[str]] = OVERRIDES, debug: bool = DEBUG) -> None:
    """Held-out greedy accuracy of the pipeline's model (prepares it first if needed)."""
    from bidirl.pipeline import run_pipeline

    def action() -> None:
        cfg = _config(pipeline, overrides)
        cfg.stages = ["prepare_model", "evaluate"]
        run_pipeline(cfg)

    _guard(action, debug)


@app.command()
def launch(
    pipeline: Path = PIPELINE,
    overrides: Optional[List[str]] = OVERRIDES,
    nnodes: Optional[int] = typer.Option(None, "--nnodes", help="Number of nodes (default: cluster.nnodes)."),
    node_rank: int = typer.Option(0, "--node-rank", help="This node's rank (multi-node only)."),
    nproc_per_node: Optional[int] = typer.Option(None, "--nproc-per-node",
                                                 help="Processes on this node (default: its share of cluster.devices, "
                                                      "+ 1 for the controller on node 0)."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint",
                                                help="host:port of node 0 (default: launch.rdzv_endpoint)."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue this run directory from its latest "
                                          "good checkpoint (same pipeline and overrides; train.steps may grow)."),
    debug: bool = DEBUG,
) -> None:
    """Start the hot-switch runtime through torchrun: a controller plus cluster.devices device workers."""
    from bidirl.runtime.launch import launch as start, topology_of

    def action() -> None:
        from bidirl.planner import live_partition, live_prior
        from bidirl.runtime.launch import check_devices, check_plan, check_resumable
        from bidirl.ui import say

        chosen = list(overrides or [])
        asked = _config(pipeline, chosen)
        skipped = check_resumable(str(resume), asked) if resume is not None else []
        check_plan(asked)  # impossible settings and missing devices: one line, before any note or download
        check_devices(asked, topology_of(asked, nnodes, node_rank, nproc_per_node, rdzv_endpoint))
        for warning in skipped:  # (newer checkpoints that do not verify, said once nothing refused the resume)
            say(warning)
        chosen += live_partition(asked)  # cluster.rollout_devices=0: the planner's split
        cfg = _config(pipeline, chosen)
        topology = topology_of(cfg, nnodes, node_rank, nproc_per_node, rdzv_endpoint)
        code = start(str(pipeline), chosen, cfg, topology, prior=live_prior(cfg),
                     run_path=str(resume) if resume is not None else None, resume=resume is not None)
        if code:
            raise typer.Exit(code)

    _guard(action, debug)


@app.command()
def simulate(
    pipeline: Path = PIPELINE,
    overrides: Optional[List[str]] = OVERRIDES,
    policies: Optional[str] = typer.Option(None, "--policies", help="Comma-separated policies (default: sim.policies)."),
    debug: bool = DEBUG,
) -> None:
    """Simulate the configured cluster under each scheduling policy: table, Gantt charts, throughput chart."""

    def action() -> None:
        from bidirl.helpers import helper_processes
        from bidirl.planner import planned_configs, replanners
        from bidirl.rundir import RunDir, check_output_dir
        from bidirl.sim.report import check_policies, print_table, run_policies, write_outputs

        cfg = _config(pipeline, overrides)
        names = [p.strip() for p in policies.split(",")] if policies else list(cfg.sim.policies)
        check_policies(names)
        check_output_dir(cfg)  # before minutes of simulation, not after
        with helper_processes():  # the planner's candidates and the plots on the other core
            planned = planned_configs(cfg, names)  # cluster.rollout_devices=0: each policy at the planner's split
            # before any output exists: bad input leaves nothing behind
            results = run_policies(cfg, names, planned, replanners(cfg, names, planned))
            print_table(cfg, results)
            run = RunDir(cfg)
            write_outputs(results, run.path)
        run.finish({"status": "ok", "results": [r.row() for r in results]})

    _guard(action, debug)


@app.command()
def profile(
    pipeline: Path = PIPELINE,
    overrides: Optional[List[str]] = OVERRIDES,
    debug: bool = DEBUG,
) -> None:
    """Measure this machine's devices through the pipeline's engines; write profile.json and profile.png."""

    def action() -> None:
        from bidirl.pipeline import run_stages

        cfg = _config(pipeline, overrides)
        run = run_stages(cfg, ["profile"])
        typer.echo(str(run.path / "profile.json"))

    _guard(action, debug)


@app.command()
def plan(
    pipeline: Path = PIPELINE,
    overrides: Optional[List[str]] = OVERRIDES,
    policy: Optional[str] = typer.Option(None, "--policy", help="The policy that will run (default: launch.mode)."),
    profile_json: Optional[Path] = typer.Option(None, "--profile", help="A profile.json from `bidirl profile` "
                                                "(default: sim.profile, else the analytic model of sim.hardware)."),
    debug: bool = DEBUG,
) -> None:
    """Choose the rollout/train partition by simulating the policy on the performance model; write plan.json."""

    def action() -> None:
        from bidirl.pipeline import run_stages
        from bidirl.sim.report import check_policies

        extra = list(overrides or [])
        if policy:
            check_policies([policy], "--policy")  # (named as the user gave it, not as the launch.mode it becomes)
            extra.append(f"launch.mode={policy}")
        if profile_json:
            extra.append(f"sim.profile={profile_json}")
        run = run_stages(_config(pipeline, extra), ["plan"])
        typer.echo(str(run.path / "plan.json"))

    _guard(action, debug)


DEFAULT_PIPELINE = Path(__file__).resolve().parents[1] / "pipelines" / "cpu-demo.yaml"


@app.command()
def compare(
    pipeline: Optional[Path] = typer.Argument(None, help="Pipeline YAML (default: pipelines/cpu-demo.yaml, the CPU "
                                              "default, live on 2 CPU devices).", show_default=False),
    overrides: Optional[List[str]] = OVERRIDES,
    baselines: Optional[str] = typer.Option(
        None, "--baselines", show_default=False,
        help="Comma-separated baselines: verl, areal, roll, streamrl, verl-dynamic, verl-async; trl: the real TRL "
             "GRPOTrainer, live only, needs bidirl\\[trl]. Default: the pipeline's compare.baselines (verl,areal,roll "
             "unless it names others)."),
    debug: bool = DEBUG,
) -> None:
    """bidirl against the baselines, each at its own best split: live where the pipeline's cluster is this
    machine, simulated where it is not. Every baseline is a scheduling policy reproduced on bidirl's runtime,
    except trl: the real TRL GRPOTrainer, live only."""

    def action() -> None:
        from bidirl.compare import compare as run_compare, is_here, parse_baselines, preflight
        from bidirl.pipeline import check_inputs, fetch_hub_inputs, wandb_group
        from bidirl.rundir import RunDir
        from bidirl.runtime_env import prepare_process

        named = parse_baselines(baselines) if baselines is not None else None  # (a bad name before anything loads)
        path, extra = pipeline, list(overrides or [])
        if path is not None and _is_override(str(path)):  # overrides only: the default pipeline
            path, extra = None, [str(pipeline), *extra]
        path = path or DEFAULT_PIPELINE
        cfg = _config(path, extra)
        names = named or parse_baselines(",".join(cfg.compare.baselines))
        prepare_process(cfg.cluster.device_type)
        if is_here(cfg):  # (live: every policy trains this model on this data)
            check_inputs(cfg, stages=["compare"])
        preflight(cfg, names)  # bad input fails here, before the run directory exists
        if is_here(cfg):
            fetch_hub_inputs(cfg, stages=["compare"])
        run = RunDir(cfg)
        try:
            with wandb_group(run.path.name):
                rows = run_compare(cfg, str(path), extra, names, run.path, log_table=run.table)
        except BaseException as failure:
            run.finish_after(failure)
            if isinstance(failure, KeyboardInterrupt):  # (a compared run is not resumed: `bidirl compare` runs again)
                raise KeyboardInterrupt() from None
            raise
        run.finish({"status": "ok", "stages": ["compare"], "compare": [r.name for r in rows]})
        from bidirl.report import write_report

        typer.echo(str(write_report(run.path)))

    _guard(action, debug)


def main() -> None:  # pragma: no cover - console-script entry used by `python -m cli.main`
    app()


if __name__ == "__main__":
    sys.exit(main())
