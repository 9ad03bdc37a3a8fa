"""What one hot-switch device holds: a resident rollout engine *and* a resident trainer, item by item.

Every device of the live runtime keeps both (that is what makes a role switch take milliseconds), so
its memory is the sum, not the larger of the two::

    vLLM                      gpu_memory_utilization x HBM (weights + KV cache + its activations)
    trainer weights           fp32 master copy                                          4 B/param
    gradients                 fp32                                                      4 B/param
    AdamW moments             two fp32                                                  8 B/param
    compute copies            bf16/fp16 weights autocast casts for the forward          2 B/param (0 in fp32)
    flat buffers              a weight staging buffer + the step's flat gradient        8 B/param
    activations               one micro-batch: per token, every layer's input kept (gradient
                              checkpointing) or every layer's working set (without), + one layer's
    logits                    the output head's fp32 logits, log-softmax and gradient (~10 B per
                              vocabulary entry), for ``train.logprob_chunk_tokens`` positions at once
    reserve                   CUDA context, NCCL buffers, allocator fragmentation: 3 GB + 5% of HBM

The per-token activation terms are the analytic model's (:meth:`AnalyticModel.activation_bytes`).
A micro-batch's sequence is ``rollout.max_model_len`` when set, else ``max_new_tokens`` plus
:data:`PROMPT_TOKENS` (a stated allowance for the prompt). Pure Python: used by ``bidirl launch``
before anything starts and by tests against real model configs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

from bidirl.perf.analytic import ModelSpec

PROMPT_TOKENS = 512
RESERVE_BYTES, RESERVE_SHARE = 3e9, 0.05
GB = 1e9


@dataclass
class DeviceBudget:
    hbm: float
    items: Dict[str, float] = field(default_factory=dict)  # bytes by item, in the order above

    @property
    def total(self) -> float:
        return sum(self.items.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.hbm

    def table(self) -> str:
        rows = [f"  {name:<18} {value / GB:7.1f} GB" for name, value in self.items.items()]
        return "\n".join(rows + [f"  {'total':<18} {self.total / GB:7.1f} GB of {self.hbm / GB:.0f} GB"])

    def verdict(self) -> str:
        """One line: whether it fits and, if not, the largest items."""
        largest = sorted(self.items.items(), key=lambda kv: -kv[1])[:3]
        parts = ", ".join(f"{name} {value / GB:.1f} GB" for name, value in largest)
        word = "fits" if self.fits else "does not fit"
        return f"{self.total / GB:.1f} GB per device {word} in {self.hbm / GB:.0f} GB (largest: {parts})"


def hot_switch_budget(model: ModelSpec, hbm: float, rollout_share: float, micro_batch: int, sequence: int,
                      compute_bytes: int = 2, logprob_chunk_tokens: int = 2048,
                      gradient_checkpointing: bool = False) -> DeviceBudget:
    """The budget of one device holding ``model`` for both roles (see the module docstring).

    ``compute_bytes``: 2 for a bf16/fp16 model (autocast), 4 for fp32 (no compute copy)."""
    p, h, layers = model.params, model.hidden_size, model.layers
    tokens = micro_batch * sequence
    one_layer = 12 * h + 8 * model.intermediate_size  # bytes per token, the analytic model's terms
    kept = 2 * h * layers + one_layer if gradient_checkpointing else one_layer * layers
    head_positions = min(tokens, logprob_chunk_tokens) if logprob_chunk_tokens else tokens
    return DeviceBudget(hbm, {
        "vLLM": rollout_share * hbm,
        "trainer weights": 4 * p,
        "gradients": 4 * p,
        "AdamW moments": 8 * p,
        "compute copies": (compute_bytes * p) if compute_bytes < 4 else 0.0,
        "flat buffers": 8 * p,
        "activations": tokens * kept,
        "logits": head_positions * 10 * model.vocab_size,
        "reserve": RESERVE_BYTES + RESERVE_SHARE * hbm,
    })


def rollout_share_holds_weights(model: ModelSpec, hbm: float, rollout_share: float, kv_floor: float = 0.1) -> bool:
    """vLLM's share must hold its bf16 weights and leave at least ``kv_floor`` of the share for KV cache."""
    return model.weight_bytes + model.buffer_bytes <= (1 - kv_floor) * rollout_share * hbm
