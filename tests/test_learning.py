"""GRPO really learns: a short synchronous run on the CPU default raises held-out greedy accuracy.

Slow (about four minutes on 2 cores): run with `make test-slow`. The margin, 10 points, is four
binomial standard errors of one accuracy estimate on 400 held-out problems (at most 2.5 points each),
so noise alone does not pass it; the CPU default gains about 15-20 points in this many steps.
"""

import json

import pytest

from bidirl.config import load_config
from bidirl.pipeline import run_pipeline

pytestmark = pytest.mark.slow


def test_sync_grpo_raises_held_out_greedy_accuracy_beyond_noise(tmp_path):
    cfg = load_config("pipelines/cpu-tiny.yaml", [
        "stages=[prepare_model,train]", f"output_dir={tmp_path}", "logging.wandb_mode=disabled",
        "logging.progress=false", "train.steps=150", "logging.eval_every=50", "data.eval_size=400",
    ])
    run = run_pipeline(cfg)
    summary = json.loads((run.path / "summary.json").read_text())["train"]
    gain = summary["accuracy_end"] - summary["accuracy_start"]
    assert gain > 0.10, summary["curve"]
    assert (run.path / "learning_curve.png").stat().st_size > 0
