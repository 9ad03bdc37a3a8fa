"""Synchronous GRPO on one device: the veRL-style colocated baseline.

Every step, top to bottom::

    prompts  <- next `train.prompts_per_step` training problems (reshuffled each epoch)
    samples  <- rollout engine: `rollout.group_size` completions per prompt, with behaviour log-probs
    rewards  <- numeric reward of each completion against its reference answer
    advantages <- group-normalised rewards (bidirl.grpo)
    trainer.step(samples)               one optimizer step; the policy version goes up by one
    rollout.update_weights(trainer)     in-place weight sync; the next step samples from the new policy
    every `logging.eval_every` steps: held-out greedy accuracy through the rollout engine

Because generation always uses the weights of the previous optimizer step, every sample is fresh
(staleness 0) and the decoupled-PPO weight is 1: this is on-policy GRPO. The asynchronous modes of the
runtime reuse the same engines and loss with staleness > 0.
"""

from __future__ import annotations

import random
import time
from typing import Any, Dict, List, Optional, Sequence

from bidirl.config import PipelineConfig
from bidirl.data import Problem, load_problems
from bidirl.engines import build_rollout_engine, build_train_engine
from bidirl.engines.protocols import Sample, SamplingParams
from bidirl.evaluate import engine_accuracy
from bidirl.grpo import assign_advantages
from bidirl.prompts import format_prompt
from bidirl.reward import numeric_reward
from bidirl.rundir import RunDir
from bidirl.ui import progress_bar, say


class PromptSampler:
    """Cycles through the training problems, reshuffled every epoch (seeded)."""

    def __init__(self, problems: Sequence[Problem], seed: int):
        self.problems, self.rng, self.order = list(problems), random.Random(seed), []

    def next(self, count: int) -> List[Problem]:
        batch = []
        while len(batch) < count:
            if not self.order:
                self.order = list(range(len(self.problems)))
                self.rng.shuffle(self.order)
            batch.append(self.problems[self.order.pop()])
        return batch


def score(samples: Sequence[Sample], problems: Sequence[Problem], format_reward: float) -> None:
    for sample in samples:
        sample.reward = numeric_reward(sample.text, problems[sample.prompt_index].answer, format_reward)


def train_sync(cfg: PipelineConfig, run: RunDir, model_path: str, rollout: Optional[Any] = None) -> Dict[str, Any]:
    """Runs ``train.steps`` GRPO steps; ``rollout`` may be an engine already started on ``model_path``."""
    start = time.time()
    rollout = rollout or build_rollout_engine(cfg, model_path)
    trainer = build_train_engine(cfg, model_path)
    say(f"engines ready in {time.time() - start:.1f} s (rollout: {cfg.rollout.engine}, train: {cfg.train.engine})")
    tokenizer = trainer.tokenizer
    prompt = lambda p: format_prompt(p, cfg.data.prompt_style, tokenizer)  # noqa: E731
    sampler = PromptSampler(load_problems(cfg.data, "train"), cfg.seed)
    held_out = load_problems(cfg.data, "test")
    held_out_prompts = [prompt(p) for p in held_out]
    params = SamplingParams(n=cfg.rollout.group_size, max_new_tokens=cfg.rollout.max_new_tokens,
                            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, seed=cfg.seed)
    evaluate = lambda: engine_accuracy(rollout, held_out, held_out_prompts, cfg.rollout.max_new_tokens).accuracy  # noqa: E731
    curve = [(0, 0.0, evaluate())]
    run.started = time.time()  # the learning curve's clock starts at the first RL step
    run.log(0, eval_accuracy=curve[0][2])
    say(f"step 0: held-out greedy accuracy {curve[0][2]:.1%}")
    step_seconds = 0.0
    with progress_bar("GRPO (sync)", cfg.train.steps, cfg.logging.progress) as advance:
        for step in range(1, cfg.train.steps + 1):
            metrics = _one_step(cfg, rollout, trainer, sampler, prompt, params)
            step_seconds += metrics["step_s"]
            if step % cfg.logging.eval_every == 0 or step == cfg.train.steps:
                metrics["eval_accuracy"] = evaluate()
                curve.append((step, time.time() - run.started, metrics["eval_accuracy"]))
            run.log(step, **metrics)
            advance(reward=metrics["reward_mean"], acc=curve[-1][2])
    trainer.save(str(run.path / "checkpoint"))
    return {"curve": [{"step": s, "minutes": round(t / 60, 2), "accuracy": a} for s, t, a in curve],
            "accuracy_start": curve[0][2], "accuracy_end": curve[-1][2], "final_version": trainer.version,
            "rl_seconds": round(step_seconds, 2),  # generate + train + sync, without evaluations
            "checkpoint": str(run.path / "checkpoint")}


def _one_step(cfg: PipelineConfig, rollout: Any, trainer: Any, sampler: PromptSampler, prompt: Any,
              params: SamplingParams) -> Dict[str, Any]:
    problems = sampler.next(cfg.train.prompts_per_step)
    t0 = time.perf_counter()
    samples = rollout.generate([prompt(p) for p in problems], params)
    t1 = time.perf_counter()
    score(samples, problems, cfg.algorithm.format_reward)
    assign_advantages(samples, cfg.algorithm.std_normalize)
    # Groups whose rewards are all equal have zero advantage and add nothing to the gradient: skip them.
    informative = [s for s in samples if s.advantage != 0.0]
    stats = trainer.step(informative) if informative else trainer.apply_grads()
    t2 = time.perf_counter()
    sync_s = rollout.update_weights(trainer.state_dict(), trainer.version)
    t3 = time.perf_counter()
    tokens = sum(len(s.completion_ids) for s in samples)
    return {
        "reward_mean": sum(s.reward for s in samples) / len(samples),
        "completion_tokens_mean": tokens / len(samples),
        "finished_ratio": sum(s.finished for s in samples) / len(samples),
        "informative_ratio": len(informative) / len(samples),
        "rollout_s": round(t1 - t0, 4), "train_s": round(t2 - t1, 4), "sync_s": round(sync_s, 4),
        "step_s": round(t3 - t0, 4),
        "samples_per_s": len(samples) / (t3 - t0), "tokens_per_s": tokens / (t3 - t0),
        **{k: v for k, v in stats.items() if isinstance(v, (int, float))},
    }
