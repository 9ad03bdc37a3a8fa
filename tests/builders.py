"""Tiny builders shared by tests: a small random Qwen2 saved to disk, a config pointing at it."""

from __future__ import annotations

from pathlib import Path

from bidirl.config import TinyModelConfig, load_config
from bidirl.models.tiny import build_model, build_tokenizer, save_hf

SMALL = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)


def small_model_dir(directory: Path, seed: int = 0) -> str:
    tokenizer = build_tokenizer()
    save_hf(build_model(SMALL, len(tokenizer), seed), tokenizer, directory)
    return str(directory)


def small_config(*overrides: str):
    return load_config(None, ["logging.progress=false", "logging.wandb_mode=disabled", "train.lr=1e-2",
                              "rollout.max_new_tokens=6", *overrides])
