"""Convergence study: does borrowing change what GRPO learns? Held-out accuracy against samples trained.

    .venv/bin/python experiments/convergence/study.py                      # the issue's arms + control, 3 seeds (resumable)
    .venv/bin/python experiments/convergence/study.py --arms sync,bidirl-eta1 --seeds 0,1 --steps 50
    .venv/bin/python experiments/convergence/study.py --report             # tables and plots only
    .venv/bin/python experiments/convergence/study.py --steps 100 --task terms4   # a task with 2,500 held-out problems

Arms, every one a live ``bidirl launch`` of the CPU default (``pipelines/cpu-tiny.yaml``: the project-
built tiny model, reasoning-gym arithmetic, 128 prompts x 4 samples per step) for the same number of
steps, hence the same number of samples:

  sync                 on-policy synchronous GRPO, one device (the reference)
  bidirl-eta{E}        2 devices, both lending directions, streamed steps, migration; staleness <= E
  async-eta{E}         2 devices, fixed 1/1 split, staleness <= E: the same eta without borrowing
  async-eta4-none      async at eta 4 with no staleness correction at all (stale samples trained as
                       fresh): the negative control -- does the study detect a convergence effect?
  {mode}-eta{E}-decoupled  with AReaL's decoupled-PPO correction instead of the default (naive: PPO
                       clipped around the behaviour policy; see bidirl/grpo.py); -none: no correction

E in {0, 1, 2, 4}. Seeds are RL seeds (sampling, prompt order); every arm starts from the base model
``model.tiny.seed`` ``--base-seed`` (default 0) builds (the same one on one machine; another machine's CPU
kernels may build another, so runs are grouped by the base model they started from). Held-out accuracy is greedy, on
``data.eval_size=2000`` requested problems, of which the task's held-out split holds 605 distinct ones (a
standard error of about 1.9 points at 65%), every ``--eval-every`` steps and at the end. ``--task terms4``
trains and evaluates on chains of up to 4 terms instead, whose held-out split holds 2,500 distinct problems
and more (an error of at most 1 point); its results, report and figures are named ``steps<N>-terms4``. Its
base model is its own (the model cache is keyed by the task): its arms compare with each other, not with
the default task's.

Each finished run leaves ``results/steps<N>/<arm>-seed<S>.json`` (``-base<N>`` added for another base seed:
its curve, staleness histogram, importance-weight statistics, throughput); a rerun skips those, so the
study can be run a few arms at a time -- keyed by arm, seed and base seed: a seed run on another machine's
build of the same base seed is skipped here, so run new seeds there. ``--report`` (also run after every
study) writes ``results-steps<N>.md`` and one figure per base model,
``figures/curves-steps<N>-start<accuracy>.png``, from whatever results exist, and the README quotes them.
Nothing is tuned toward a result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"  # (so that a script runs from any folder)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BIDIRL = str(Path(sys.executable).with_name("bidirl"))
PIPELINE = str(PIPELINES / "cpu-tiny.yaml")
COMMON = ["data.eval_size=2000", "logging.wandb_mode=disabled", "logging.progress=false",
          "launch.chunk_groups=32"]  # four chunks per batch: something to stream, migrate and lend
ETAS = (0, 1, 2, 4)
# the default correction (naive: PPO clipped around the behaviour policy), AReaL's decoupled PPO, none at all
CORRECTIONS = {"": [], "-decoupled": ["algorithm.correction=decoupled"], "-none": ["algorithm.correction=none"]}
ARMS = {"sync": ["cluster.devices=1", "launch.mode=sync"]}
for _suffix, _correction in CORRECTIONS.items():
    for _eta in ETAS:
        ARMS[f"bidirl-eta{_eta}{_suffix}"] = ["cluster.devices=2", "launch.mode=bidirl",
                                             f"algorithm.staleness={_eta}", "algorithm.plan_staleness=false",
                                             *_correction]  # (each arm at its eta exactly)
        ARMS[f"async-eta{_eta}{_suffix}"] = ["cluster.devices=2", "cluster.rollout_devices=1", "launch.mode=async",
                                            f"algorithm.staleness={_eta}", *_correction]
# The task every arm trains on. The CPU default's is small: its held-out split holds 605 distinct problems,
# so one evaluation's standard error is about 1.9 points. With operands in chains of up to 4 terms the task
# holds about 123,000 distinct questions, and 2,500 held-out ones give an error of at most 1.0 point at any
# accuracy, as the issue asks (same operands and operators; most problems are one addition longer).
TASKS = {"default": [], "terms4": ["data.task_config.max_terms=4", "data.eval_size=2500"]}
# what a plain `study.py` runs: the arms (the default correction) and its negative control
DEFAULT_ARMS = ["sync", *(f"{mode}-eta{eta}" for mode in ("bidirl", "async") for eta in ETAS), "async-eta4-none"]

def read_jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_arm(arm: str, seed: int, steps: int, eval_every: int, scratch: Path, base_seed: int = 0,
            task: str = "default") -> dict:
    """One live run on ``task`` from the base model ``model.tiny.seed=base_seed`` builds; what the study
    keeps of it."""
    out_dir = scratch / f"{arm}-seed{seed}-base{base_seed}"
    command = [BIDIRL, "launch", PIPELINE, *COMMON, *TASKS[task], *ARMS[arm], f"seed={seed}", f"model.tiny.seed={base_seed}",
               f"train.steps={steps}", f"logging.eval_every={eval_every}", f"output_dir={out_dir}"]
    start = time.time()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"{arm} seed {seed} failed: {tail}")
    (summary_path,) = out_dir.glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    steps_rows = [r for r in read_jsonl(summary_path.parent / "metrics.jsonl") if "reward_mean" in r]
    weights = [r["importance_weight_mean"] for r in steps_rows if "importance_weight_mean" in r]
    clipped = [r["importance_weight_clipped"] for r in steps_rows if "importance_weight_clipped" in r]
    return {"arm": arm, "seed": seed, "base_seed": base_seed, "steps": steps, "overrides": ARMS[arm],
            "eval_every": eval_every, **({"task": TASKS[task]} if TASKS[task] else {}),
            "eval_problems": summary.get("eval_problems"),
            "curve": [(p["samples"], p["accuracy"]) for p in summary["curve"]],
            "accuracy_start": summary["accuracy_start"], "accuracy_end": summary["accuracy_end"],
            "staleness_histogram": summary["staleness_histogram"],
            "importance_weight_mean": statistics.fmean(weights) if weights else None,
            "importance_weight_clipped": statistics.fmean(clipped) if clipped else None,
            "samples_per_s": summary["samples_per_s"], "leases": summary.get("leases", {}),
            "migrations": len(summary.get("migrations", [])), "wall_s": round(time.time() - start, 1)}


# ---- report --------------------------------------------------------------------------------------
def study_name(steps: int, task: str = "default") -> str:
    """``steps<N>`` on the CPU default's task, ``steps<N>-<task>`` on another: the results' folder, the
    report's and the figures' names."""
    return f"steps{steps}" + (f"-{task}" if task != "default" else "")


def results_dir(steps: int, task: str = "default") -> Path:
    return HERE / "results" / study_name(steps, task)


def load_results(steps: int, task: str = "default") -> dict:
    results: dict = {}
    for path in sorted(results_dir(steps, task).glob("*.json")):
        row = json.loads(path.read_text())
        results.setdefault(row["arm"], []).append(row)
    return results


def spread(values: list) -> str:
    values = [100 * v for v in values]
    mean = statistics.fmean(values)
    return f"{mean:.1f} [{min(values):.1f}, {max(values):.1f}]" if len(values) > 1 else f"{mean:.1f}"


def late_mean(row: dict) -> float:
    """Mean held-out accuracy over the evaluations of the run's second half: one evaluation swings by
    several points from one snapshot to the next (the policy's greedy answers flip), the late mean less."""
    end = row["curve"][-1][0]  # samples trained at the end
    late = [y for x, y in row["curve"] if x > end / 2]
    return statistics.fmean(late) if late else row["accuracy_end"]


def eta_of(arm: str) -> str:
    return arm.split("eta")[1].split("-")[0] if "eta" in arm else "-"


def report(results: dict) -> str:
    """One base model's table. Each arm's gaps to sync are over the seeds both ran (the mean of sync over
    those seeds, not over all of sync's: arms were run at different seeds), as is sync's spread beside them."""
    if not results:
        return "no results yet"
    sync = {r["seed"]: r for r in results.get("sync", [])}
    lines = ["| arm | eta | seeds | held-out accuracy at start | at end, mean [min, max] | gain (points) | "
             "end - sync, same seeds (points) | sync's spread, those seeds (points) | late mean, mean [min, max] | "
             "late - sync late, same seeds (points) | staleness histogram (samples) | importance weight mean | "
             "clipped share | samples/s |", "|" + "---|" * 14]
    for arm in ARMS:
        rows = results.get(arm)
        if not rows:
            continue
        ends = [r["accuracy_end"] for r in rows]
        gains = [r["accuracy_end"] - r["accuracy_start"] for r in rows]
        both = [r for r in rows if r["seed"] in sync]  # (sync itself: every one of its seeds, a gap of 0)
        theirs = [sync[r["seed"]] for r in both]
        def difference(of: Callable[[dict], float]) -> str:
            return f"{100 * (statistics.fmean(map(of, both)) - statistics.fmean(map(of, theirs))):+.1f}" if both else "-"

        gap, late_gap = difference(lambda r: r["accuracy_end"]), difference(late_mean)
        sync_ends = [s["accuracy_end"] for s in theirs]
        sync_spread = f"{100 * (max(sync_ends) - min(sync_ends)):.1f}" if len(sync_ends) > 1 else "-"
        lates = [late_mean(r) for r in rows]
        late = f"{spread(lates)} | {late_gap}"
        histogram: dict = {}
        for r in rows:
            for k, v in r["staleness_histogram"].items():
                histogram[k] = histogram.get(k, 0) + v
        total = sum(histogram.values())
        shown = ", ".join(f"{k}: {v / total:.0%}" for k, v in sorted(histogram.items(), key=lambda kv: int(kv[0])))
        weight = [r["importance_weight_mean"] for r in rows if r["importance_weight_mean"] is not None]
        cut = [r["importance_weight_clipped"] for r in rows if r["importance_weight_clipped"] is not None]
        lines.append(f"| {arm} | {eta_of(arm)} | {len(rows)} | {spread([r['accuracy_start'] for r in rows])} | "
                     f"{spread(ends)} | {statistics.fmean(gains) * 100:+.1f} | {gap} | {sync_spread} | {late} | {shown} | "
                     f"{statistics.fmean(weight):.3f} | {statistics.fmean(cut):.2%} | "
                     f"{statistics.fmean(r['samples_per_s'] for r in rows):.0f} |" if weight and cut else
                     f"| {arm} | {eta_of(arm)} | {len(rows)} | - | {spread(ends)} | - | {gap} | {sync_spread} | "
                     f"{late} | {shown} | - | - | - |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    etas = [e for e in ETAS if any(a in results for a in (f"bidirl-eta{e}", f"async-eta{e}"))] or [0]
    fig, axes = plt.subplots(1, len(etas), figsize=(4.5 * len(etas), 3.6), sharey=True, squeeze=False)
    for ax, eta in zip(axes[0], etas):
        arms = ["sync"] + sorted(a for a in results if a != "sync" and eta_of(a) == str(eta))
        for arm in arms:
            rows = results.get(arm)
            if not rows:
                continue
            xs = [x for x, _ in rows[0]["curve"]]
            curves = [[100 * y for _, y in r["curve"]] for r in rows if len(r["curve"]) == len(xs)]
            mean = [statistics.fmean(c[i] for c in curves) for i in range(len(xs))]
            style = "--" if arm.endswith("-decoupled") else ":" if arm.endswith("-none") else "-"
            line, = ax.plot([x / 1000 for x in xs], mean, style, marker="o", ms=3, label=f"{arm} ({len(curves)} seeds)")
            if len(curves) > 1:
                ax.fill_between([x / 1000 for x in xs], [min(c[i] for c in curves) for i in range(len(xs))],
                                [max(c[i] for c in curves) for i in range(len(xs))], color=line.get_color(), alpha=0.2)
        ax.set_title(f"eta = {eta}")
        ax.set_xlabel("samples trained (thousands)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("held-out greedy accuracy (%)")
    fig.suptitle("Mean over seeds, band = min-max", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def by_base_model(results: dict) -> "list[tuple[float, dict]]":
    """Results grouped by the base model they started from (its held-out accuracy at start names it: a
    rebuilt base model need not be the same one), the group with the most runs first. Arms are compared
    within a group, or seed by seed (:func:`paired`), never across base models."""
    groups: dict = {}
    for arm, rows in results.items():
        for row in rows:
            groups.setdefault(round(row["accuracy_start"], 4), {}).setdefault(arm, []).append(row)
    return sorted(groups.items(), key=lambda kv: -sum(len(v) for v in kv[1].values()))


def same_run(row: dict) -> tuple:
    """What two arms' runs share when paired: the seed (hence the prompts) and the base model (the seed
    that built it, and its start: the build is reproducible on one machine only)."""
    return row["seed"], row.get("base_seed", 0), round(row["accuracy_start"], 4)


def base_model_name(rows: list) -> str:
    """A base model as the report names it: its held-out accuracy at start and the seed that built it."""
    seeds = sorted({r.get("base_seed", 0) for r in rows})
    return f"{100 * rows[0]['accuracy_start']:.1f}% (model.tiny.seed {', '.join(map(str, seeds))})"


def result_name(arm: str, seed: int, base_seed: int) -> str:
    """``<arm>-seed<S>.json`` from the base model of ``model.tiny.seed`` 0 (the study's first runs),
    ``<arm>-seed<S>-base<N>.json`` from another."""
    return f"{arm}-seed{seed}{f'-base{base_seed}' if base_seed else ''}.json"


def paired(results: dict) -> str:
    """Each arm against sync *at the same seed and from the same base model* (hence the same prompts):
    the mean and range over seeds of the difference, final and late. (A seed run again on another
    machine may start from another base model: the build is reproducible on one machine only.)"""
    sync = {same_run(r): r for r in results.get("sync", [])}
    lines = ["| arm | seeds | end - sync, same seed: mean [min, max] (points) | "
             "late - sync late, same seed: mean [min, max] (points) |", "|---|---|---|---|"]
    for arm in ARMS:
        pairs = [(r, sync[same_run(r)]) for r in results.get(arm, []) if arm != "sync" and same_run(r) in sync]
        if not pairs:
            continue
        ends = [r["accuracy_end"] - s["accuracy_end"] for r, s in pairs]
        lates = [late_mean(r) - late_mean(s) for r, s in pairs]
        def show(vs: list) -> str:
            mean = f"{100 * statistics.fmean(vs):+.1f}"
            return f"{mean} [{100 * min(vs):+.1f}, {100 * max(vs):+.1f}]" if len(vs) > 1 else mean

        lines.append(f"| {arm} | {','.join(str(r['seed']) for r, _ in pairs)} | {show(ends)} | {show(lates)} |")
    return "\n".join(lines)


def borrowing(results: dict) -> str:
    """bidirl against async *at the same eta, seed and base model*: what borrowing alone changes (the
    same staleness bound, the same prompts; only where the work runs, and so which samples are drawn).
    Mean, [min, max] and the standard error of the mean over the pairs, per base model and over both."""
    def show(vs: list) -> str:
        if len(vs) < 2:
            return f"{100 * vs[0]:+.1f}"
        se = statistics.stdev(vs) / len(vs) ** 0.5
        return f"{100 * statistics.fmean(vs):+.1f} [{100 * min(vs):+.1f}, {100 * max(vs):+.1f}] (SE {100 * se:.1f})"

    lines = ["| eta | base model at start | seeds | bidirl - async at the end: mean [min, max] (SE), points | "
             "late: mean [min, max] (SE), points |", "|---|---|---|---|---|"]
    for suffix in CORRECTIONS:
        for eta in ETAS:
            asynchronous = {same_run(r): r for r in results.get(f"async-eta{eta}{suffix}", [])}
            pairs = [(r, asynchronous[same_run(r)]) for r in results.get(f"bidirl-eta{eta}{suffix}", [])
                     if same_run(r) in asynchronous]
            starts = sorted({round(r["accuracy_start"], 4) for r, _ in pairs}, reverse=True)
            for start in [*starts, None] if len(starts) > 1 else starts:
                some = [(r, a) for r, a in pairs if start is None or round(r["accuracy_start"], 4) == start]
                ends = [r["accuracy_end"] - a["accuracy_end"] for r, a in some]
                lates = [late_mean(r) - late_mean(a) for r, a in some]
                where = "all" if start is None else base_model_name([r for r, _ in some])
                seeds = ",".join(str(r["seed"]) for r, _ in sorted(some, key=lambda p: p[0]["seed"]))
                lines.append(f"| {eta}{suffix} | {where} | {seeds} | {show(ends)} | {show(lates)} |")
    return "\n".join(lines)


def write_report(steps: int, task: str = "default") -> None:
    name = study_name(steps, task)
    results = load_results(steps, task)
    sections = []
    tags: set = set()
    for start, group in by_base_model(results):  # (named by its start accuracy: the order can change)
        seeds = sorted({r["seed"] for rows in group.values() for r in rows})
        tag = f"{100 * start:.1f}".replace(".", "")  # 65.5% -> start655
        tag = tag if tag not in tags else f"{tag}-{len(tags)}"  # (two base models within 0.05 points)
        tags.add(tag)
        figure = f"figures/curves-{name}-start{tag}.png"
        sections.append(f"## The base model at {base_model_name([r for rows in group.values() for r in rows])}, seeds "
                        f"{', '.join(map(str, seeds))}\n\n{report(group)}\n\n![curves]({figure})")
        plot(group, HERE / figure)
    if results:
        sections.append(f"## Every seed, each arm against sync at the same seed\n\n{paired(results)}")
        sections.append(f"## Borrowing alone: bidirl against async at the same eta and seed\n\n{borrowing(results)}")
    text = "\n\n".join(sections) if sections else "no results yet"
    (HERE / f"results-{name}.md").write_text(text + "\n")
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                        help=f"comma-separated, of: {', '.join(ARMS)} (default: the issue's arms)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--base-seed", type=int, default=0,
                        help="model.tiny.seed of the base model every run starts from (default 0)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run (the CPU default's 200)")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--task", choices=list(TASKS), default="default",
                        help="default: the CPU default's task (605 held-out problems); terms4: chains of up to 4 "
                             "terms, 2,500 held-out problems (a standard error of at most 1 point)")
    parser.add_argument("--report", action="store_true",
                        help="only rebuild results-steps<N>[-<task>].md and its figures "
                             "(figures/curves-steps<N>[-<task>]-start<acc>.png)")
    args = parser.parse_args()
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"--arms: unknown arm {unknown[0]!r} (known: {', '.join(ARMS)})")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds: comma-separated integers, got {args.seeds!r}")
    if not args.report:
        results_dir(args.steps, args.task).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as scratch:
            for seed in seeds:  # seed-major: a partial study still has every arm at some seeds
                for arm in arms:
                    target = results_dir(args.steps, args.task) / result_name(arm, seed, args.base_seed)
                    if target.exists():
                        continue
                    print(f"{arm} seed {seed} base model {args.base_seed} ...", flush=True)
                    row = run_arm(arm, seed, args.steps, args.eval_every, Path(scratch), args.base_seed, args.task)
                    target.write_text(json.dumps(row, indent=1) + "\n")
                    print(f"  accuracy {row['accuracy_start']:.3f} -> {row['accuracy_end']:.3f}, "
                          f"{row['samples_per_s']:.0f} samples/s, {row['wall_s']:.0f} s", flush=True)
    write_report(args.steps, args.task)


if __name__ == "__main__":
    main()
