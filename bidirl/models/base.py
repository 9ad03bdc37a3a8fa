"""The tiny base model: build, briefly supervise, evaluate, cache.

Cache key = hash of the model shape, the SFT recipe, the task (name, config, seed), the prompt style
and :data:`TINY_RECIPE_VERSION`; any change builds a new entry, the same config reuses the old one.
The entry's ``bidirl_model.json`` records the held-out greedy accuracy, the SFT loss and timings.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from bidirl.config import PipelineConfig
from bidirl.data import load_problems, load_reasoning_gym
from bidirl.errors import BidirlError
from bidirl.evaluate import greedy_accuracy
from bidirl.models.cache import PreparedModel, cache_key, cached_entry, write_entry
from bidirl.models.sft import supervised_finetune
from bidirl.models.tiny import build_model, build_tokenizer, save_hf
from bidirl.prompts import PromptBuilder, target_completion
from bidirl.ui import progress_bar

TINY_RECIPE_VERSION = 1  # bump when the tiny model recipe changes, to invalidate old caches


def tiny_cache_dir(cfg: PipelineConfig) -> Path:
    tiny = asdict(cfg.model.tiny)
    if tiny["sft_target"] == "answer":  # the original recipe: its cache keys stay as they were
        del tiny["sft_target"]
    del tiny["seed"]  # keyed as "seed", where the RL seed used to be (caches of seed 0 stay valid)
    parts = {
        "tiny": tiny,
        "task": cfg.data.task,
        "task_config": dict(cfg.data.task_config),
        "data_seed": cfg.data.seed,
        "prompt_style": cfg.data.prompt_style,
        "seed": cfg.model.tiny.seed,
        "recipe": TINY_RECIPE_VERSION,
    }
    if cfg.data.few_shot:  # the base model is supervised on the prompts it will see (few-shot included)
        parts["few_shot"] = cfg.data.few_shot
    return Path(cfg.model.cache_dir) / f"tiny-{cfg.data.task}-{cache_key(parts)}"


def prepare_tiny(cfg: PipelineConfig, report: Optional[Callable[[str], None]] = None) -> PreparedModel:
    if cfg.data.source != "reasoning_gym":
        from bidirl.errors import ConfigError

        raise ConfigError("model.source 'tiny' is trained on a reasoning_gym task; set data.source=reasoning_gym")
    target = tiny_cache_dir(cfg)
    found = cached_entry(target)
    if found:
        if report:
            report(f"reusing cached base model {target} ({built_accuracy(found.info)})")
        return found
    return write_entry(target, lambda tmp: _build_tiny(cfg, tmp))


def built_accuracy(info: Dict[str, Any]) -> str:
    """The held-out accuracy a cache entry recorded, with what it was measured on: the run that built it
    evaluated with its own ``data.eval_size`` and ``rollout.max_new_tokens``, which a later run may not share
    (the run's own step-0 evaluation is its starting accuracy)."""
    if "accuracy" not in info:
        return "held-out accuracy not recorded"
    on = [f"{info['eval_problems']} problems"] if "eval_problems" in info else []
    on += [f"max_new_tokens {info['eval_max_new_tokens']}"] if "eval_max_new_tokens" in info else []
    return f"held-out accuracy {info['accuracy']:.1%} when built" + (f", on {', '.join(on)}" if on else "")


def check_tiny_prompt_style(style: str) -> None:
    if style == "chat":
        raise BidirlError("the tiny model has no chat template: use data.prompt_style=plain or compact")


def _build_tiny(cfg: PipelineConfig, out: Path) -> Dict[str, Any]:
    import torch

    start = time.time()
    tokenizer = build_tokenizer()
    model = build_model(cfg.model.tiny, len(tokenizer), cfg.model.tiny.seed)
    data = cfg.data
    train = load_reasoning_gym(data.task, data.task_config, data.seed, "train", cfg.model.tiny.sft_examples)
    held_out = load_problems(data, "test")
    check_tiny_prompt_style(data.prompt_style)
    prompt = PromptBuilder.for_run(data)  # the form it will be prompted with in RL and evaluation
    with progress_bar("SFT tiny base model", cfg.model.tiny.sft_steps, cfg.logging.progress) as advance:
        losses = supervised_finetune(
            model, tokenizer, train, prompt, lambda p: target_completion(p, cfg.model.tiny.sft_target),
            cfg.model.tiny, cfg.model.tiny.seed,
            on_step=lambda step, loss: advance(loss=loss),
        )
    sft_s = time.time() - start
    with progress_bar("evaluate base model", len(held_out), cfg.logging.progress) as advance:
        result = greedy_accuracy(model, tokenizer, held_out, prompt, cfg.rollout.max_new_tokens, on_batch=advance)
    save_hf(model, tokenizer, out)
    return {
        "source": "tiny",
        "parameters": sum(p.numel() for p in model.parameters()),
        "task": data.task,
        "task_config": dict(data.task_config),
        "sft_steps": cfg.model.tiny.sft_steps,
        "sft_final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
        "sft_s": round(sft_s, 1),
        "accuracy": round(result.accuracy, 4),
        "eval_problems": result.num_problems,
        "eval_max_new_tokens": cfg.rollout.max_new_tokens,
        "torch_threads": torch.get_num_threads(),
    }
