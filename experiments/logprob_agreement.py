"""How closely each rollout engine's behaviour log-probs match the trainer's, before and after a sync.

Prints, for the transformers and the vLLM engine, the mean and max |log mu - log pi| over sampled
completion tokens of the pipeline's base model: for fresh weights, for stale weights after one
optimizer step, and after the in-place weight sync (with its duration).

    .venv/bin/python experiments/logprob_agreement.py [pipelines/cpu-tiny.yaml] [key=value ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

PIPELINES = Path(__file__).resolve().parents[1] / "pipelines"  # (so that a script runs from any folder)


def gaps(trainer, samples):
    values = [abs(a - b) for s, r in zip(samples, trainer.logprobs(samples)) for a, b in zip(s.logprobs, r)]
    return sum(values) / len(values), max(values)


def main() -> None:
    from bidirl.config import load_config
    from bidirl.data import load_problems
    from bidirl.engines.build import build_rollout_engine, build_train_engine
    from bidirl.samples import SamplingParams
    from bidirl.grpo import assign_advantages
    from bidirl.models.sources import prepare_model
    from bidirl.prompts import format_prompt
    from bidirl.runtime_env import prepare_process
    from bidirl.reward import numeric_reward

    args = sys.argv[1:]
    pipeline = args.pop(0) if args and args[0].endswith(".yaml") else str(PIPELINES / "cpu-tiny.yaml")
    for engine in ("hf", "vllm"):
        cfg = load_config(pipeline, [*args, f"rollout.engine={engine}", "train.lr=1e-4", "train.lr_warmup_steps=1"])
        prepare_process(cfg.cluster.device_type)
        path = prepare_model(cfg).path
        rollout, trainer = build_rollout_engine(cfg, path), build_train_engine(cfg, path)
        problems = load_problems(cfg.data, "train")[: cfg.train.prompts_per_step]
        prompts = [format_prompt(p, cfg.data.prompt_style, trainer.tokenizer) for p in problems]
        params = SamplingParams(n=cfg.rollout.group_size, max_new_tokens=cfg.rollout.max_new_tokens,
                                temperature=cfg.rollout.temperature)
        samples = rollout.generate(prompts, params)
        fresh = gaps(trainer, samples)
        for s in samples:
            s.reward = numeric_reward(s.text, problems[s.prompt_index].answer)
        assign_advantages(samples)
        trainer.step(samples)
        stale = gaps(trainer, rollout.generate(prompts, params))
        seconds = rollout.update_weights(trainer.state_dict(), trainer.version)
        synced = gaps(trainer, rollout.generate(prompts, params))
        print(f"{engine:5s} fresh mean {fresh[0]:.2e} max {fresh[1]:.2e} | after a step, stale mean {stale[0]:.2e}"
              f" | after sync ({seconds * 1000:.0f} ms) mean {synced[0]:.2e} max {synced[1]:.2e}", flush=True)


if __name__ == "__main__":
    main()
