"""Builds the engines a config names (once per process, never in a hot loop)."""

from __future__ import annotations

from pathlib import Path

from bidirl.config import PipelineConfig
from bidirl.errors import BidirlError
from bidirl.engines import ROLLOUT_ENGINES, TRAIN_ENGINES, engine_class
from bidirl.engines.protocols import RolloutEngine, RolloutSite, TrainEngine


def build_rollout_engine(cfg: PipelineConfig, model_path: str) -> RolloutEngine:
    cache_root = str(Path(cfg.model.cache_dir).parent / "vllm")  # vLLM's compile cache beside our models
    site = RolloutSite(cfg.cluster.device_type, cfg.rollout.gpu_memory_utilization, cfg.rollout.max_model_len,
                       cfg.rollout.max_num_seqs)
    return engine_class(ROLLOUT_ENGINES, cfg.rollout.engine)(model_path, cfg.model.dtype, cfg.seed, cache_root, site)


def check_runtime_train_engine(cfg: PipelineConfig) -> None:
    """The train engine as the runtime drives it -- ``bidirl launch`` and the in-process train stage alike:
    a step's micro-batches reach the trainer in several calls, and gradients are reduced by the runtime
    over train pools that change at run time. DeepSpeed's ZeRO 1-3 keep gradients in their own
    partitions and, at each call's accumulation boundary, rebuild the step's gradients from that call
    alone (on one device too, found in review): only ZeRO 0 trains the batch the runtime assembled."""
    if cfg.train.engine == "deepspeed" and cfg.train.zero_stage > 0:
        raise BidirlError(f"train.engine=deepspeed runs in bidirl's runtime with train.zero_stage=0 only, got "
                          f"{cfg.train.zero_stage}: ZeRO 1-3 keep gradients inside DeepSpeed's partitions, and the "
                          "runtime accumulates and reduces gradients itself over train pools that change at run time")


def build_train_engine(cfg: PipelineConfig, model_path: str, private_group: bool = False) -> TrainEngine:
    """``private_group``: the engine must not join a torchrun world (the runtime reduces gradients itself)."""
    return engine_class(TRAIN_ENGINES, cfg.train.engine)(model_path, cfg, private_group)
