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


def shared_model_cache(test_folder: Path) -> Path:
    """The session's one cache of built base models, beside a test's own folder (each ``tmp_path`` and
    ``tmp_path_factory.mktemp`` folder is one of pytest's basetemp). A live run's launcher that finds its
    tiny model built neither builds it nor imports transformers and torch: about 8 s less a run on 2
    cores. (The cache's entries are named by everything that builds them; the cache's own tests keep
    theirs apart.)"""
    return test_folder.parent / "model-cache"


def small_config(*overrides: str):
    return load_config(None, ["logging.progress=false", "logging.wandb_mode=disabled", "train.lr=1e-2",
                              "rollout.max_new_tokens=6", *overrides])
