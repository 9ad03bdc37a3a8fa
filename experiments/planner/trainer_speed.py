"""Is the live trainer's step slower than the step ``bidirl profile`` times? In one process, one thread:

    .venv/bin/python experiments/planner/trainer_speed.py [pipeline] [key=value ...]

Times, alternating, three ways of training the same model on the task's own batches:
  profile  the profile's step: a whole sampled batch, every advantage nonzero (``profiling.trainable``)
  live     the live trainer's step: only the informative groups (rewards differ), micro-batched by
           ``train.micro_batch_size`` with the whole batch's normaliser, then one optimizer step
  fresh    as ``live``, but a different batch every step (the live trainer never sees one twice)
and prints each one's milliseconds per token (prompt + completion), median over the repeats. Defaults:
the short fidelity setting (``cpu-tiny.yaml``, 64 prompts x 4, micro-batch 64).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"  # (so that a script runs from any folder)

DEFAULT = [str(PIPELINES / "cpu-tiny.yaml"), "train.prompts_per_step=64", "train.micro_batch_size=64",
           "launch.chunk_groups=16", "cluster.devices=2"]
REPEATS, BATCHES = 8, 4


def main(argv: list) -> None:
    import torch

    from bidirl.config import load_config
    from bidirl.data import PromptSampler, load_problems
    from bidirl.engines.build import build_rollout_engine, build_train_engine
    from bidirl.grpo import assign_advantages
    from bidirl.models.sources import prepare_model
    from bidirl.profiling import rollout_batch, trainable

    argv = argv or DEFAULT
    cfg = load_config(argv[0], argv[1:])
    model = prepare_model(cfg)
    torch.set_num_threads(1)  # as a live device worker runs
    rollout, trainer = build_rollout_engine(cfg, model.path), build_train_engine(cfg, model.path)
    problems = load_problems(cfg.data, "train")
    sampler, B, micro = PromptSampler(problems, cfg.seed), cfg.train.prompts_per_step, cfg.train.micro_batch_size
    sampled = [rollout_batch(cfg, rollout, sampler.next(B)) for _ in range(BATCHES)]
    whole = trainable(copy.deepcopy(sampled[0]), cfg.algorithm.std_normalize)
    informative = []
    for by_group in sampled:
        batch = [s for g in by_group.values() if len({s.reward for s in g}) > 1 for s in g]
        for group in by_group.values():
            assign_advantages(group, cfg.algorithm.std_normalize)
        informative.append(batch)

    def tokens(batch) -> int:
        return sum(len(s.prompt_ids) + len(s.completion_ids) for s in batch)

    def profile_step(batch) -> None:
        trainer.step(batch)

    def live_step(batch) -> None:
        total = sum(len(s.completion_ids) for s in batch)
        for start in range(0, len(batch), micro):
            trainer.compute_grads(batch[start:start + micro], total, len(batch))
        trainer.apply_grads()

    arms = {"profile": (profile_step, lambda i: whole), "live": (live_step, lambda i: informative[0]),
            "fresh": (live_step, lambda i: informative[i % BATCHES])}
    ms: dict = {name: [] for name in arms}
    for i in range(REPEATS):
        for name, (step, batch_of) in arms.items():
            batch = batch_of(i)
            start = time.perf_counter()
            step(batch)
            ms[name].append(1000 * (time.perf_counter() - start) / tokens(batch))
    print(f"whole batch: {len(whole)} samples, {tokens(whole)} tokens; informative: "
          f"{statistics.mean(len(b) for b in informative):.0f} samples on average")
    for name, values in ms.items():
        print(f"{name:8s} ms/token: median {statistics.median(values):.4f}  "
              f"(range {min(values):.4f}-{max(values):.4f} over {REPEATS})")


if __name__ == "__main__":
    main(sys.argv[1:])
