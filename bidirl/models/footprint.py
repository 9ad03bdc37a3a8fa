"""What a Hugging Face model weighs, counted from its config without allocating it.

The model is built from its config under ``accelerate.init_empty_weights()`` -- every parameter on
the meta device, no memory behind it -- and its parameters and buffers are counted, so the analytic
performance model and the planner's memory check see the real architecture (tied embeddings counted
once, biases, norms, whatever the model class builds), not a hand-written parameter formula. Seconds
on a CPU even for 32B.

KV bytes per token, the one figure a parameter count cannot give, come from the config's attention
shape: keys and values (2) for every layer and KV head, ``head_dim`` wide, in bf16 (2 bytes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

from bidirl.config import PipelineConfig
from bidirl.errors import BidirlError
from bidirl.perf.analytic import ModelSpec
from bidirl.perf.memory import DeviceBudget


def count_model(hf_config: Any, name: str) -> ModelSpec:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError, TypeError) as exc:
        raise BidirlError(f"{name}: cannot build a causal LM from its config ({str(exc).splitlines()[0]})") from None
    # Tie again outside the context: inside it, accelerate re-creates every registered parameter on the
    # meta device, so the tied output layer becomes a second tensor and would be counted twice.
    model.tie_weights()
    params = sum(p.numel() for p in model.parameters())  # shared (tied) tensors once
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    text = getattr(hf_config, "text_config", None) or hf_config
    return ModelSpec(name, float(params), kv_bytes_per_token(hf_config), buffer_bytes=float(buffer_bytes),
                     layers=int(text.num_hidden_layers), hidden_size=int(text.hidden_size),
                     intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * text.hidden_size),
                     vocab_size=int(text.vocab_size))


def kv_bytes_per_token(hf_config: Any) -> float:
    text = getattr(hf_config, "text_config", None) or hf_config  # multimodal configs nest the language model
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return float(2 * text.num_hidden_layers * kv_heads * head_dim * 2)


def config_from_fields(fields: Dict[str, Any]) -> Any:
    """A transformers config from a config.json's fields (``model_type`` names the class)."""
    from transformers import AutoConfig

    fields = dict(fields)
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise BidirlError("a model config needs 'model_type' (e.g. qwen2, llama)")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as exc:
        raise BidirlError(f"model_type {model_type!r}: {str(exc).splitlines()[0]}") from None


_COUNTED: Dict[str, ModelSpec] = {}  # the planner asks for the same model once per candidate


def model_spec_of(cfg: PipelineConfig, source: str) -> ModelSpec:
    """The counted size of ``source``: ``pipeline`` (the pipeline's own ``model.source``), a folder with a
    config.json, a config.json file, or a hub id (from the local Hugging Face cache when offline)."""
    key = f"{source}|{cfg.model}" if source == "pipeline" else source
    if key not in _COUNTED:
        _COUNTED[key] = _count(cfg, source)
    return _COUNTED[key]


def _count(cfg: PipelineConfig, source: str) -> ModelSpec:
    if source == "pipeline":
        if cfg.model.source == "tiny":
            from bidirl.models.tiny import tiny_config

            return count_model(tiny_config(cfg.model.tiny), "tiny")
        source = cfg.model.source
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json":
        try:
            fields = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise BidirlError(f"{path}: not a readable model config ({exc})") from None
        return count_model(config_from_fields(fields), path.parent.name or str(path))
    try:
        return count_model(hub_config(source), source)
    except OSError as exc:
        raise BidirlError(f"sim.model {source!r}: no model config found (a preset name, 'pipeline', a folder with "
                          f"config.json, or a hub id in the local cache): {str(exc).splitlines()[0]}") from None


def hub_config(repo_id: str) -> Any:
    """A hub model's config: from the local cache if it is there (no network wait), else fetched."""
    import functools

    from transformers import AutoConfig

    from bidirl.models.sources import from_hub_cache_first

    return from_hub_cache_first(functools.partial(AutoConfig.from_pretrained, repo_id), misses=(OSError,))


def device_budget(cfg: PipelineConfig, spec: ModelSpec) -> DeviceBudget:
    """The live runtime's memory budget of one accelerator (:mod:`bidirl.perf.memory`): every device keeps
    vLLM (``rollout.gpu_memory_utilization`` of ``sim.hardware``'s HBM) *and* a replicated trainer, so a
    setting whose sum does not fit is a BidirlError line, whatever the partition. ``bidirl launch``
    checks it on the prepared model; the planner (:func:`~bidirl.planner.live_device_budget`) on the
    pipeline's model when its size is known here."""
    from bidirl.perf.analytic import HARDWARE
    from bidirl.perf.memory import PROMPT_TOKENS, hot_switch_budget, rollout_share_holds_weights

    hardware, share = HARDWARE[cfg.sim.hardware], cfg.rollout.gpu_memory_utilization
    if not rollout_share_holds_weights(spec, hardware.hbm_bytes, share):
        raise BidirlError(f"rollout.gpu_memory_utilization={share:g}: vLLM's {share * hardware.hbm_bytes / 1e9:.1f} GB "
                          f"of a {hardware.name} cannot hold {spec.name}'s bf16 weights "
                          f"({spec.weight_bytes / 1e9:.1f} GB) and a KV cache; raise it")
    sequence = cfg.rollout.max_model_len or cfg.rollout.max_new_tokens + PROMPT_TOKENS
    budget = hot_switch_budget(spec, hardware.hbm_bytes, share, cfg.train.micro_batch_size, sequence,
                               compute_bytes=4 if cfg.model.dtype == "float32" else 2,
                               logprob_chunk_tokens=cfg.train.logprob_chunk_tokens,
                               gradient_checkpointing=cfg.train.gradient_checkpointing)
    if not budget.fits:
        raise BidirlError(f"{spec.name} on {hardware.name} (sim.hardware): a device holds both engines and "
                          f"{budget.verdict()}; lower rollout.gpu_memory_utilization or train.micro_batch_size, set "
                          "train.gradient_checkpointing=true, or use a smaller model")
    return budget
