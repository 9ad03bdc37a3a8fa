"""Held-out greedy accuracy of weight snapshots, computed after training so it never perturbs the timeline.

The primary trainer saves a snapshot at version 0, every ``logging.eval_every`` versions and at the end
(a few milliseconds for the tiny model); when training has finished, one device loads each snapshot into
its rollout engine in place and decodes the held-out set greedily.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

from bidirl.config import PipelineConfig
from bidirl.data import load_problems
from bidirl.evaluate import engine_accuracy
from bidirl.prompts import PromptBuilder


def evaluate_snapshots(cfg: PipelineConfig, rollout: Any, train: Any,
                       snapshots: Sequence[Tuple[int, str]]) -> Tuple[List[Tuple[int, float]], int]:
    """(version, accuracy) of each snapshot, and how many held-out problems each was scored on (a task's
    held-out split may hold fewer distinct problems than ``data.eval_size`` asks for)."""
    import torch

    problems = load_problems(cfg.data, "test")
    prompt = PromptBuilder.for_run(cfg.data, train.tokenizer)
    prompts = [prompt(p) for p in problems]
    results = []
    for version, path in snapshots:
        rollout.update_weights(torch.load(path, map_location="cpu", weights_only=True), version)
        results.append((version, engine_accuracy(rollout, problems, prompts, cfg.rollout.max_new_tokens).accuracy))
    return results, len(problems)
