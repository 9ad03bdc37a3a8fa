"""How long `bidirl simulate` takes: 32 GPUs x 200 steps and 1024 GPUs x 100 steps of a GSM8K-like workload.

    .venv/bin/python experiments/sim_validation/speed.py [policy ...]      # one simulate() call each
    .venv/bin/python experiments/sim_validation/speed.py --cli [rounds]    # the whole command, plots included

Targets: under 5 s (32 x 200, the pipelines issue: the command as a user types it, plots included) and
under 60 s (1024 x 100, the scheduler issue) on a 2-core machine. Measured, never asserted in tests.

``--cli`` runs `bidirl simulate pipelines/sim-32gpu.yaml --policies bidirl train.steps=200` in a fresh
process, alternately with the split given (``cluster.rollout_devices=18``, the planner's choice since
fcfd9b2; 15 before) and planned (the pipeline's ``cluster.rollout_devices: 0``: the planner simulates
candidate splits first), ``rounds`` times each (default 5), and prints each wall time and the median.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bidirl.config import load_config
from bidirl.sim.run import simulate

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"  # (so that a script runs from any folder)

CASES = [
    ("32 GPUs x 200 steps", ["cluster.devices=32", "train.steps=200", "train.prompts_per_step=512"], 5.0),
    ("1024 GPUs x 100 steps", ["cluster.devices=1024", "train.steps=100", "train.prompts_per_step=8192",
                               "launch.chunk_groups=16"], 60.0),
]
COMMAND = ["simulate", str(PIPELINES / "sim-32gpu.yaml"), "--policies", "bidirl", "train.steps=200",
           "algorithm.plan_staleness=false"]  # (the split at eta 1, as first measured: the staleness's cost apart)
CLI_CASES = {"split given (18/14)": ["cluster.rollout_devices=18"], "split planned": []}


def time_cli(rounds: int) -> None:
    bidirl = str(Path(sys.executable).with_name("bidirl"))
    seconds = {name: [] for name in CLI_CASES}
    with tempfile.TemporaryDirectory() as out:
        for _ in range(rounds):
            for name, extra in CLI_CASES.items():  # alternately: this machine's speed drifts
                start = time.perf_counter()
                subprocess.run([bidirl, *COMMAND, *extra, f"output_dir={out}"], check=True, capture_output=True)
                seconds[name].append(time.perf_counter() - start)
    for name, times in seconds.items():
        print(f"bidirl simulate, 32 GPUs x 200 steps, {name:20s} median {statistics.median(times):5.2f} s "
              f"(target < 5 s); each: {', '.join(f'{t:.2f}' for t in times)}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--cli"]:
        time_cli(int(sys.argv[2]) if len(sys.argv) > 2 else 5)
        sys.exit()
    policies = sys.argv[1:] or ["areal", "bidirl"]
    for name, overrides, target in CASES:
        cfg = load_config(str(PIPELINES / "sim-32gpu.yaml"), overrides)
        for policy in policies:
            start = time.perf_counter()
            result = simulate(cfg, policy)
            seconds = time.perf_counter() - start
            print(f"{name:24s} {policy:14s} {seconds:7.2f} s (target < {target:.0f} s)  "
                  f"{result.samples_per_s:9.2f} simulated samples/s", flush=True)
