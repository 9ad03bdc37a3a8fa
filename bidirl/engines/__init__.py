"""Rollout and training engines behind two small protocols (see :mod:`bidirl.engines.protocols`).

An engine is chosen once, by name, when a run is built (:func:`build_rollout_engine`,
:func:`build_train_engine`); the training loop only ever talks to the protocol.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bidirl.config import PipelineConfig


def build_rollout_engine(cfg: PipelineConfig, model_path: str) -> Any:
    if cfg.rollout.engine == "vllm":
        from bidirl.engines.vllm_rollout import VLLMRolloutEngine

        cache_root = str(Path(cfg.model.cache_dir).parent / "vllm")  # vLLM's own cache beside our models
        return VLLMRolloutEngine(model_path, cfg.model.dtype, cfg.seed, cache_root)
    from bidirl.engines.hf_rollout import HFRolloutEngine

    return HFRolloutEngine(model_path, cfg.model.dtype, cfg.seed)


def build_train_engine(cfg: PipelineConfig, model_path: str, private_group: bool = False) -> Any:
    """``private_group``: the engine must not join a torchrun world (the runtime reduces gradients itself)."""
    if cfg.train.engine == "deepspeed":
        from bidirl.engines.deepspeed_train import DeepSpeedTrainEngine

        return DeepSpeedTrainEngine(model_path, cfg, private_group)
    from bidirl.engines.torch_train import TorchTrainEngine

    return TorchTrainEngine(model_path, cfg)
