"""Builds the engines a config names (once per process, never in a hot loop)."""

from __future__ import annotations

from pathlib import Path

from bidirl.config import PipelineConfig
from bidirl.engines import ROLLOUT_ENGINES, TRAIN_ENGINES, engine_class
from bidirl.engines.protocols import RolloutEngine, RolloutSite, TrainEngine


def build_rollout_engine(cfg: PipelineConfig, model_path: str) -> RolloutEngine:
    cache_root = str(Path(cfg.model.cache_dir).parent / "vllm")  # vLLM's compile cache beside our models
    site = RolloutSite(cfg.cluster.device_type, cfg.rollout.gpu_memory_utilization, cfg.rollout.max_model_len,
                       cfg.rollout.max_num_seqs)
    return engine_class(ROLLOUT_ENGINES, cfg.rollout.engine)(model_path, cfg.model.dtype, cfg.seed, cache_root, site)


def build_train_engine(cfg: PipelineConfig, model_path: str, private_group: bool = False) -> TrainEngine:
    """``private_group``: the engine must not join a torchrun world (the runtime reduces gradients itself)."""
    return engine_class(TRAIN_ENGINES, cfg.train.engine)(model_path, cfg, private_group)
