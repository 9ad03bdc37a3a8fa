"""Every mechanism of the bidirectional scheduler in one live run on the real CPU base model.

Slow (a minute of run, plus building the cpu-long base model on a fresh machine): run with
`make test-slow`. The setting is the planner's *medium* fidelity setting (`cpu-long.yaml`, responses
capped at 40 tokens, eta 1), where rollout and training take turns as the bottleneck: the idle trainer
is lent to rollout and takes older tails over mid-generation, and the rollout device, blocked by the
staleness bound, is lent to training and joins steps in progress.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bidirl.config import load_config
from bidirl.sched.trace import intervals

pytestmark = pytest.mark.slow

BIDIRL = [str(Path(sys.executable).with_name("bidirl"))]


def test_one_live_run_lends_both_ways_joins_a_step_and_migrates_requests_with_staleness_within_eta(tmp_path):
    args = ["launch", "pipelines/cpu-long.yaml", f"output_dir={tmp_path}", "cluster.devices=2", "launch.mode=bidirl",
            "algorithm.staleness=1", "rollout.max_new_tokens=40", "train.steps=30", "logging.eval_every=0",
            "logging.wandb_mode=disabled", "logging.progress=false"]
    result = subprocess.run(BIDIRL + args, capture_output=True, text=True, timeout=3600)
    assert result.returncode == 0, result.stderr[-3000:]
    (root,) = Path(tmp_path).iterdir()
    summary = json.loads((root / "summary.json").read_text())
    trace = [json.loads(line) for line in (root / "trace.jsonl").read_text().splitlines()]
    assert summary["leases"]["train->rollout"]["leases"] > 0 and summary["leases"]["rollout->train"]["leases"] > 0
    assert any(r["reason"].startswith("joins batch") and r["home"] == "rollout" for r in trace)
    # in a step of two devices one runs out of micro-batches first and waits for the other: idle, not busy;
    # a wait is time in the TRAINING state, never more
    assert sum(summary["step_wait_s"].values()) > 0
    homes = {d: home for d, home in enumerate(summary["homes"])}
    training = {pool: sum(stop - start for device, state, _, start, stop in intervals(trace, trace[-1]["t"])
                          if state == "training" and homes[device] == pool) for pool in summary["step_wait_s"]}
    assert all(summary["step_wait_s"][pool] <= training[pool] + 1e-3 for pool in training), (summary, training)
    assert summary["migrations"] and any(h["unfinished"] > 0 for h in summary["handovers"])
    batch = load_config("pipelines/cpu-long.yaml").train.prompts_per_step
    assert set(summary["staleness_histogram"]) <= {"0", "1"}  # the bound held
    assert sum(summary["staleness_histogram"].values()) == 30 * batch  # every group trained once
