"""Live fidelity of the performance model: the step time the planner predicts for the live 2-device
runtime, from ``bidirl profile`` on this machine, against the step time the runtime then measures.

    .venv/bin/python experiments/planner/fidelity.py             # every setting and policy, 3 runs each
    .venv/bin/python experiments/planner/fidelity.py --settings short --steps 10 --repeats 1

Per setting (response lengths, one task each):
  short   the CPU default (``pipelines/cpu-tiny.yaml``): answers of ~2-4 tokens
  medium  ``pipelines/cpu-long.yaml`` with responses capped at 40 tokens (the same base model)
  long    ``pipelines/cpu-long.yaml`` as shipped, chains of 2-16 terms: ~10-130 tokens
1. ``bidirl profile`` measures the devices through the real engines and the task's own response
   lengths (profile.json);
2. per policy, the simulator predicts the run on that profile (``bidirl.sim.run.simulate`` with
   ``sim.profile`` and the live runtime's capabilities: what ``bidirl plan`` scores a live launch with), and
3. ``bidirl launch`` runs it live: 2 devices, 1 rollout / 1 train, eta 1, the same steps and seed.
Steps 1-3 are one round; ``--repeats`` rounds (profile again, run again: this machine's speed drifts
by up to ~30% over tens of minutes, so a prediction is only compared with a run minutes after its
profile, and one round per cell cannot resolve 10%; the seed stays, as it also builds the base model).
Two predictions per run, both on the profile's device model: *one-shot*, on the lengths the profile
measured (the base model's, on the prompts the run draws first: all a planner knows before the run),
and *at the run's lengths*, on the same profiled length groups scaled to the mean response length the
live run measured per step (a straight line over its steps: a start and a drift, as the simulator's
workloads drift) -- RL changes the lengths as the policy learns (the long setting's responses shorten
from ~85 to ~50 tokens in 30 steps), which no profile of the base model can foresee, and the second
prediction separates that from the device model's own error. Neither fits a constant to the measured
step time.
Reported: predicted and measured steady-state step time (the mean step after the first three: the
pipeline filling and the engines' first calls are a start-up cost, not a step; both the mean over
the rounds, with the range of the measured), the ratio of the means and of each round, the plain
means, and each pool's busy share, which
says where they differ. The profile measures each stage beside the other (two CPU devices share this
machine), which the prediction charges. Writes ``fidelity.json`` (next to
this file unless ``--out``; the settings measured replace their rows, the others' stay) and prints a
markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bidirl.config import load_config
from bidirl.sched.trace import steady_step_s
from bidirl.sim.run import sim_workload, simulate

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"  # (so that a script runs from any folder)

BIDIRL = str(Path(sys.executable).with_name("bidirl"))
SETTINGS = {
    "short": (str(PIPELINES / "cpu-tiny.yaml"), ["train.prompts_per_step=64", "train.micro_batch_size=64",
                                          "launch.chunk_groups=16"]),
    "medium": (str(PIPELINES / "cpu-long.yaml"), ["rollout.max_new_tokens=40"]),
    "long": (str(PIPELINES / "cpu-long.yaml"), []),
}
POLICIES = ("async", "bidirl")
LIVE = ["cluster.devices=2", "cluster.rollout_devices=1", "algorithm.staleness=1", "logging.eval_every=0",
        "logging.wandb_mode=disabled", "logging.progress=false"]


def profile(pipeline: str, overrides: list, root: Path) -> str:
    """``bidirl profile`` into ``root``; a profile already there (``--work`` of an earlier run) is reused."""
    done = sorted((root / "profile").glob("*/profile.json"))
    if done:
        return str(done[-1])
    out = subprocess.run([BIDIRL, "profile", pipeline, *overrides, f"output_dir={root}/profile",
                          "logging.progress=false"], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def live(pipeline: str, overrides: list, root: Path, policy: str) -> dict:
    """``bidirl launch`` into ``root``; a finished run already there is reused."""
    runs = root / f"live-{policy}"
    done = sorted(runs.glob("*/summary.json")) if runs.exists() else []
    wanted = next((int(o.split("=", 1)[1]) for o in overrides if o.startswith("train.steps=")), None)
    if done and wanted is not None and json.loads(done[-1].read_text()).get("steps") != wanted:
        raise SystemExit(f"{done[-1].parent}: a kept run of other train.steps than {wanted}: use another --work")
    if not done:
        subprocess.run([BIDIRL, "launch", pipeline, *overrides, f"launch.mode={policy}",
                        f"output_dir={runs}"], capture_output=True, text=True, check=True)
        done = sorted(runs.glob("*/summary.json"))
    summary = json.loads(done[-1].read_text())
    if "step_wait_s" not in summary:  # its time breakdown counts a train step's waits as busy, the prediction's not
        raise SystemExit(f"{done[-1].parent}: a kept run from before summaries counted a train step's waits "
                         "(step_wait_s): use another --work")
    steps = [json.loads(line) for line in (done[-1].parent / "metrics.jsonl").read_text().splitlines()]
    if "version_times" not in summary:  # a run kept from before summaries recorded them: its metrics have them
        summary["version_times"] = [0.0] + [r["time_s"] for r in steps if "version" in r]
    summary["step_metrics"] = [r for r in steps if "completion_tokens_mean" in r]
    return summary


def run_lengths(cfg, summary: dict):
    """The profile's workload at the live run's response lengths: a least-squares line through each
    step's mean response length against the version its groups were generated at (step - 1 - staleness),
    as a start ``mean_tokens`` and a relative ``drift`` over the run (the simulator's drift)."""
    rows = summary["step_metrics"]
    xs = [r["step"] - 1 - r["staleness_mean"] for r in rows]
    ys = [r["completion_tokens_mean"] for r in rows]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    start = my - slope * mx
    return dataclasses.replace(sim_workload(cfg), mean_tokens=start, drift=slope * cfg.train.steps / start)


def measure(name: str, steps: int, root: Path, repeats: int) -> list:
    """``repeats`` rounds of (profile, then each policy live), so that every prediction comes from a
    profile measured minutes before the run it predicts: this machine's speed drifts by up to ~30%
    over tens of minutes (the same training step, same process: 1.36-1.90 s)."""
    pipeline, overrides = SETTINGS[name]
    overrides = [*overrides, *LIVE, f"train.steps={steps}"]
    pairs = {policy: [] for policy in POLICIES}  # policy -> [(predicted, summary, profile, at run lengths)]
    for repeat in range(repeats):
        profile_json = profile(pipeline, overrides, root / name / f"round{repeat}")
        for policy in POLICIES:
            cfg = load_config(pipeline, [*overrides, f"launch.mode={policy}", f"sim.profile={profile_json}"])
            # the live runtime's capabilities: one chunk in flight per device, no mid-step join, a load
            # waits for the chunk in flight (what `bidirl plan` scores a live launch with)
            predicted = simulate(cfg, policy, rollout_devices=1, with_bound=False, driver=cfg.live_driver())
            # the live run starts from the same profile (the cost-aware policies' prior estimates)
            summary = live(pipeline, [*overrides, f"sim.profile={profile_json}"], root / name / f"round{repeat}", policy)
            lengths = run_lengths(cfg, summary)
            at_run = simulate(cfg, policy, rollout_devices=1, with_bound=False, driver=cfg.live_driver(), workload=lengths)
            pairs[policy].append((predicted, summary, json.loads(Path(profile_json).read_text()), at_run, lengths))
            print(f"{name:6s} {policy:7s} round {repeat}: predicted {predicted.steady_step_s:.3f} s (at the run's "
                  f"lengths {at_run.steady_step_s:.3f} s)  measured {steady_step_s(summary['version_times']):.3f} s",
                  flush=True)
    rows = []
    for policy, runs in pairs.items():
        predicted = [p.steady_step_s for p, *_ in runs]
        at_run = [a.steady_step_s for _, _, _, a, _ in runs]
        measured = [steady_step_s(s["version_times"]) for _, s, *_ in runs]
        summaries, fits = [s for _, s, *_ in runs], runs[-1][2]
        rows.append({"setting": name, "policy": policy, "predicted_step_s": round(statistics.mean(predicted), 4),
                     "measured_step_s": round(statistics.mean(measured), 4),
                     "predicted_runs_s": [round(v, 4) for v in predicted],
                     "measured_runs_s": [round(v, 4) for v in measured],
                     "ratio": round(statistics.mean(predicted) / statistics.mean(measured), 3),
                     "ratios": [round(p / m, 3) for p, m in zip(predicted, measured)],
                     "at_run_lengths_step_s": round(statistics.mean(at_run), 4),
                     "at_run_lengths_runs_s": [round(v, 4) for v in at_run],
                     "at_run_lengths_ratio": round(statistics.mean(at_run) / statistics.mean(measured), 3),
                     "at_run_lengths_ratios": [round(p / m, 3) for p, m in zip(at_run, measured)],
                     "run_lengths": [{"start_tokens": round(w.mean_tokens, 1), "drift": round(w.drift, 3)}
                                     for *_, w in runs],
                     "predicted_mean_step_s": round(statistics.mean(p.step_s for p, *_ in runs), 4),
                     "measured_mean_step_s": round(statistics.mean(s["rl_seconds"] / s["steps"] for s in summaries), 4),
                     "predicted_switches": [p.switches for p, *_ in runs],
                     "measured_switches": [s["switches"]["count"] for s in summaries],
                     "fit_errors": {k: round(fits[k]["error"], 4) for k in ("decode", "prefill", "train")},
                     "co_running": [f.get("co_running") for _, _, f, *_ in runs],
                     "predicted_breakdown": mean_breakdown([p.time_breakdown for p, *_ in runs]),
                     "measured_breakdown": mean_breakdown([s["time_breakdown"] for s in summaries]),
                     "workload": {k: v for k, v in fits["workload"].items() if k != "groups"},
                     "measured_tokens_per_sample": round(statistics.mean(
                         s["tokens_per_s"] / s["samples_per_s"] for s in summaries), 1)})
    return rows


def mean_breakdown(breakdowns: list) -> dict:
    return {pool: {cause: round(statistics.mean(b[pool][cause] for b in breakdowns), 4) for cause in shares}
            for pool, shares in breakdowns[0].items()}


def busy(breakdown: dict) -> str:
    return " / ".join(f"{pool} {100 * shares.get('busy', 0):.0f}%" for pool, shares in sorted(breakdown.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2, help="rounds (profile + live runs) per setting")
    parser.add_argument("--out", default=str(Path(__file__).with_name("fidelity.json")))
    parser.add_argument("--work", default="", help="keep the profiles and live runs here (default: a temporary folder)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.settings.split(","):
            rows += measure(name, args.steps, Path(args.work or scratch), args.repeats)
    out = Path(args.out)  # the settings measured now replace theirs; the others' rows stay
    kept = [r for r in (json.loads(out.read_text()) if out.exists() else []) if r["setting"] not in args.settings.split(",")]
    out.write_text(json.dumps(sorted(kept + rows, key=lambda r: list(SETTINGS).index(r["setting"])), indent=2))
    print("\n| setting | mean response: profiled / live | policy | measured step s, mean [range] | one-shot "
          "predicted s | one-shot / measured (each round) | at the run's lengths, predicted s | at the run's lengths "
          "/ measured (each round) | busy, predicted | busy, measured | switches, predicted / measured |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        runs = r["measured_runs_s"]
        print(f"| {r['setting']} | {r['workload']['mean_tokens']:.1f} / {r['measured_tokens_per_sample']:.1f} | "
              f"{r['policy']} | {r['measured_step_s']:.3f} [{min(runs):.3f}-{max(runs):.3f}] | "
              f"{r['predicted_step_s']:.3f} | {r['ratio']:.2f} ({', '.join(f'{x:.2f}' for x in r['ratios'])}) | "
              f"{r['at_run_lengths_step_s']:.3f} | {r['at_run_lengths_ratio']:.2f} "
              f"({', '.join(f'{x:.2f}' for x in r['at_run_lengths_ratios'])}) | "
              f"{busy(r['predicted_breakdown'])} | {busy(r['measured_breakdown'])} | "
              f"{','.join(map(str, r['predicted_switches']))} / {','.join(map(str, r['measured_switches']))} |")


if __name__ == "__main__":
    main()
