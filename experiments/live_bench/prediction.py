"""Live throughput, side by side, against the simulator's prediction from a profile of this machine.

    .venv/bin/python experiments/live_bench/prediction.py                    # 3 settings x 5 policies, 3 rounds
    .venv/bin/python experiments/live_bench/prediction.py --settings balanced --rounds 1 --steps 10
    .venv/bin/python experiments/live_bench/prediction.py --rounds 1 --scaling --work /tmp/prediction  # ~35 min

Settings (2 CPU devices, the project-built tiny models, eta 1):
  rollout-heavy  ``pipelines/cpu-long.yaml``: worked chains of 2-16 terms, long and spread-out answers
  train-heavy    ``pipelines/cpu-tiny.yaml``: 2-4 token answers, 128 prompt groups per step
  balanced       ``pipelines/cpu-long.yaml`` with answers capped at 40 tokens
Policies: ``sync`` (colocated, both devices), ``async``, ``verl-dynamic``, ``roll`` and ``bidirl``, the
disaggregated ones at the planned split (on two devices the only one: 1 rollout / 1 train).

One round per setting: ``bidirl profile`` of the devices (the real engines, the task's own lengths),
then per policy the simulator's prediction on that profile with the live runtime's capabilities (what
``bidirl plan`` scores a launch with), then the live run (``bidirl launch``, starting from the same
profile). Rounds repeat the whole, because this machine's speed drifts by up to ~30% over tens of
minutes: a prediction is only compared with a run minutes after its profile. Reported per setting and
policy: samples/s (mean over rounds, and each round), the prediction and its error, the steady step
(the mean after the first three: a live run's first steps also warm its engines up) and its
prediction, the device-seconds per step generating and training (measured and predicted), each pool's
time by cause (busy, waiting for data / weights / admission, switching), switches, leases by
direction; the last round's Gantt charts go to ``figures/prediction-<setting>-<policy>.png``.

Scaling (``--scaling``, simulator only, on the last profile of each setting): the ratio of bidirl to the
best other policy, every policy at its best split (all splits tried), as the device count grows (2, 4,
8) and as the response-length spread grows (the profile's measured groups, then log-normal spreads of
the same mean). Writes ``prediction.json``; prints markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "planner"))
from fidelity import live, profile  # noqa: E402  (the fidelity study's profile and launch helpers)

from bidirl.config import load_config  # noqa: E402
from bidirl.sched.trace import intervals, steady_step_s  # noqa: E402
from bidirl.sim.run import sim_workload, simulate  # noqa: E402

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"  # (so that a script runs from any folder)

SETTINGS = {
    "rollout-heavy": (str(PIPELINES / "cpu-long.yaml"), []),
    "train-heavy": (str(PIPELINES / "cpu-tiny.yaml"), ["train.prompts_per_step=128", "train.micro_batch_size=64",
                                                "launch.chunk_groups=32"]),
    "balanced": (str(PIPELINES / "cpu-long.yaml"), ["rollout.max_new_tokens=40"]),
}
POLICIES = ("sync", "async", "verl-dynamic", "roll", "bidirl")
LIVE = ["cluster.devices=2", "algorithm.staleness=1", "logging.eval_every=0", "logging.wandb_mode=disabled",
        "logging.progress=false"]
DEVICE_COUNTS = (2, 4, 8)
SPREADS = (None, 0.3, 0.6, 1.0)  # None: the profile's measured groups; else log-normal sigma (between prompts)


def split_of(policy: str) -> list:
    return [] if policy == "sync" else ["cluster.rollout_devices=1"]


def work_per_step(trace: list, end: float, steps: int) -> dict:
    """Device-seconds per step spent generating and training (all devices together): where a
    prediction's error comes from."""
    seconds = {"generating": 0.0, "training": 0.0}
    for _, state, _, start, stop in intervals(trace, end):
        if state in seconds:
            seconds[state] += stop - start
    return {state: round(total / steps, 3) for state, total in seconds.items()}


def live_trace(summary: dict) -> list:
    path = Path(summary["run_dir"]) / "trace.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def one_round(name: str, steps: int, root: Path, figures: Path) -> dict:
    pipeline, overrides = SETTINGS[name]
    overrides = [*overrides, *LIVE, f"train.steps={steps}"]
    profile_json = profile(pipeline, overrides, root)
    out = {"profile": profile_json}
    for policy in POLICIES:
        chosen = [*overrides, *split_of(policy), f"launch.mode={policy}", f"sim.profile={profile_json}"]
        cfg = load_config(pipeline, chosen)
        predicted = simulate(cfg, policy, rollout_devices=None if policy == "sync" else 1, with_bound=False,
                             driver=cfg.live_driver(), keep_trace=True)
        summary = live(pipeline, [*overrides, *split_of(policy), f"sim.profile={profile_json}"], root, policy)
        gantt = Path(summary["gantt"])
        if gantt.exists():
            shutil.copy(gantt, figures / f"prediction-{name}-{policy}.png")
        out[policy] = {"measured_samples_per_s": summary["samples_per_s"],
                       "predicted_samples_per_s": round(predicted.samples_per_s, 2),
                       # the mean step after the first three: the live run's first steps also warm its
                       # engines up (its first step took 2-3x a later one), which no model predicts
                       "measured_steady_step_s": round(steady_step_s(summary["version_times"]), 4),
                       "predicted_steady_step_s": round(predicted.steady_step_s, 4),
                       "measured_work_per_step": work_per_step(live_trace(summary), summary["rl_seconds"], steps),
                       "predicted_work_per_step": work_per_step(predicted.cluster.trace, predicted.makespan_s, steps),
                       "measured_breakdown": summary["time_breakdown"],
                       "predicted_breakdown": predicted.time_breakdown,
                       "measured_switches": summary["switches"]["count"], "predicted_switches": predicted.switches,
                       "measured_leases": summary["leases"], "predicted_leases": predicted.leases,
                       "migrations": len(summary.get("migrations", []))}
        print(f"{name:13s} {policy:12s} measured {summary['samples_per_s']:7.1f} samples/s, predicted "
              f"{predicted.samples_per_s:7.1f}", flush=True)
    return out


def scaling(name: str, profile_json: str, steps: int) -> list:
    """Simulated bidirl / best other policy on clusters of the profiled CPU device."""
    pipeline, overrides = SETTINGS[name]
    rows = []
    for spread in SPREADS:
        for devices in DEVICE_COUNTS:
            cfg = load_config(pipeline, [*overrides, *LIVE, f"train.steps={steps}", f"cluster.devices={devices}",
                                         f"sim.profile={profile_json}"])
            workload = sim_workload(cfg)
            if spread is not None:
                workload = dataclasses.replace(workload, empirical=(), prompt_sigma=spread, sample_sigma=spread / 2)
            best = {}
            for policy in POLICIES:
                splits = [None] if policy == "sync" else range(1, devices)
                best[policy] = max(simulate(cfg, policy, rollout_devices=x, with_bound=False, workload=workload,
                                            driver=cfg.live_driver()).samples_per_s for x in splits)
            rival = max((p for p in POLICIES if p != "bidirl"), key=lambda p: best[p])
            rows.append({"setting": name, "devices": devices, "spread": spread or "measured",
                         "samples_per_s": {p: round(v, 2) for p, v in best.items()}, "best_other": rival,
                         "ratio": round(best["bidirl"] / best[rival], 3)})
            print(f"{name:13s} {devices:2d} devices, spread {spread or 'measured'}: bidirl / {rival} = "
                  f"{rows[-1]['ratio']:.3f}", flush=True)
    return rows


def busy(breakdown: dict) -> str:
    return " / ".join(f"{pool} {100 * shares.get('busy', 0):.0f}%" for pool, shares in sorted(breakdown.items()))


def work(per_step: dict) -> str:
    return f"{per_step['generating']:.2f} / {per_step['training']:.2f}"


def leases(entry: dict) -> str:
    return ", ".join(f"{k} {v['leases']}" for k, v in sorted(entry.items())) or "-"


def print_tables(results: dict, scaled: list) -> None:
    # (means over the rounds up to the errors; the columns after them are the last round's)
    print("\n| setting | policy | samples/s measured, mean (rounds) | predicted | error | steady step s, measured | "
          "predicted | error | generating / training device-s per step, measured (last round) | predicted | "
          "busy, measured (last round) | busy, predicted | switches measured / predicted (last round) | "
          "leases measured (last round) | leases predicted |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rate_errors, step_errors = [], []  # (of the means over rounds, as the table prints them)
    for name, rounds in results.items():
        for policy in POLICIES:
            cells = [r[policy] for r in rounds]
            measured = [c["measured_samples_per_s"] for c in cells]
            predicted = [c["predicted_samples_per_s"] for c in cells]
            m, p = statistics.fmean(measured), statistics.fmean(predicted)
            ms = statistics.fmean(c["measured_steady_step_s"] for c in cells)
            ps = statistics.fmean(c["predicted_steady_step_s"] for c in cells)
            rate_errors.append((p - m) / m)
            step_errors.append((ps - ms) / ms)
            print(f"| {name} | {policy} | {m:.1f} ({', '.join(f'{x:.1f}' for x in measured)}) | {p:.1f} | "
                  f"{100 * rate_errors[-1]:+.1f}% | {ms:.3f} | {ps:.3f} | {100 * step_errors[-1]:+.1f}% | "
                  f"{work(cells[-1]['measured_work_per_step'])} | {work(cells[-1]['predicted_work_per_step'])} | "
                  f"{busy(cells[-1]['measured_breakdown'])} | "
                  f"{busy(cells[-1]['predicted_breakdown'])} | {cells[-1]['measured_switches']} / "
                  f"{cells[-1]['predicted_switches']} | {leases(cells[-1]['measured_leases'])} | "
                  f"{leases(cells[-1]['predicted_leases'])} |")
    print(f"\nwithin 10% (unrounded): steady step {sum(abs(e) <= 0.10 for e in step_errors)} of {len(step_errors)} "
          f"cells, samples/s {sum(abs(e) <= 0.10 for e in rate_errors)} of {len(rate_errors)}")
    if scaled:
        print("\n| setting | length spread | " + " | ".join(f"{d} devices" for d in DEVICE_COUNTS) + " |")
        print("|---|---|" + "---|" * len(DEVICE_COUNTS))
        for name in dict.fromkeys(r["setting"] for r in scaled):
            for spread in dict.fromkeys(r["spread"] for r in scaled if r["setting"] == name):
                cells = [r for r in scaled if r["setting"] == name and r["spread"] == spread]
                print(f"| {name} | {spread} | " + " | ".join(f"{r['ratio']:.2f}x ({r['best_other']})" for r in cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--scaling", action="store_true", help="also the simulated scaling table")
    parser.add_argument("--out", default=str(HERE / "prediction.json"))
    parser.add_argument("--work", default="", help="keep the profiles and runs here (default: a temporary "
                        "folder); a profile or finished run already there is reused, so a stopped study resumes")
    args = parser.parse_args()
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"--settings: unknown setting {unknown[0]!r} (known: {', '.join(SETTINGS)})")
    figures = HERE / "figures"
    figures.mkdir(exist_ok=True)
    results, scaled = {}, []
    with tempfile.TemporaryDirectory() as temporary:
        scratch = args.work or temporary
        for name in names:
            results[name] = [one_round(name, args.steps, Path(scratch) / name / f"round{r}", figures)
                             for r in range(args.rounds)]
            if args.scaling:
                scaled += scaling(name, results[name][-1]["profile"], args.steps)
            # written after each setting: a study stopped part-way keeps what it measured
            Path(args.out).write_text(json.dumps({"rounds": results, "scaling": scaled}, indent=1) + "\n")
    print_tables(results, scaled)


if __name__ == "__main__":
    main()
