"""Builds the engines a config names (once per process, never in a hot loop)."""

from __future__ import annotations

from pathlib import Path

from bidirl.config import PipelineConfig
from bidirl.engines import ROLLOUT_ENGINES, TRAIN_ENGINES, engine_class
from bidirl.engines.protocols import RolloutEngine, TrainEngine


def build_rollout_engine(cfg: PipelineConfig, model_path: str) -> RolloutEngine:
    cache_root = str(Path(cfg.model.cache_dir).parent / "vllm")  # vLLM's compile cache beside our models
    return engine_class(ROLLOUT_ENGINES, cfg.rollout.engine)(model_path, cfg.model.dtype, cfg.seed, cache_root)


def build_train_engine(cfg: PipelineConfig, model_path: str, private_group: bool = False) -> TrainEngine:
    """``private_group``: the engine must not join a torchrun world (the runtime reduces gradients itself)."""
    return engine_class(TRAIN_ENGINES, cfg.train.engine)(model_path, cfg, private_group)
