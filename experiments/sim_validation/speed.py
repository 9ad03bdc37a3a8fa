"""How long `bidirl simulate` takes: 32 GPUs x 200 steps and 1024 GPUs x 100 steps of a GSM8K-like workload.

    .venv/bin/python experiments/sim_validation/speed.py [policy ...]

Targets (scheduler issue): under 5 s and under 60 s on a 2-core machine. Measured, never asserted in tests.
"""

from __future__ import annotations

import sys
import time

from bidirl.config import load_config
from bidirl.sim.run import simulate

CASES = [
    ("32 GPUs x 200 steps", ["cluster.devices=32", "train.steps=200", "train.prompts_per_step=512"], 5.0),
    ("1024 GPUs x 100 steps", ["cluster.devices=1024", "train.steps=100", "train.prompts_per_step=8192",
                               "launch.chunk_groups=16"], 60.0),
]

if __name__ == "__main__":
    policies = sys.argv[1:] or ["areal", "bidirl"]
    for name, overrides, target in CASES:
        cfg = load_config("pipelines/sim-32gpu.yaml", overrides)
        for policy in policies:
            start = time.perf_counter()
            result = simulate(cfg, policy)
            seconds = time.perf_counter() - start
            print(f"{name:24s} {policy:14s} {seconds:7.2f} s (target < {target:.0f} s)  "
                  f"{result.samples_per_s:9.2f} simulated samples/s", flush=True)
