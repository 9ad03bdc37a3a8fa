"""Analytic time-performance models for hardware we do not have, calibrated on public figures.

Rollout (one vLLM instance per device; :mod:`bidirl.sim.instance` does the continuous batching)::

    decode step(B, ctx) = a + b(ctx) * B            a = weight bytes / HBM bandwidth / 0.75
    b(ctx) = (b0 + b1 * ctx) * kv_bytes / 147 KB    fitted to ML.ENERGY H100 ITL data:
                                                    0.080 ms/seq at ~0.5k context, 0.261 at ~4k
    prefill = 2 N * prompt tokens / (MFU * peak)    concurrency <= KV capacity / (kv bytes * context)
    rollout_efficiency scales the decode step and the prefill alike (the whole rollout engine): serving
    benchmarks run CUDA graphs at steady state, RL rollouts do not; it is the one free constant, fitted on
    validation case A (veRL GSM8K).

Tensor-parallel instances of k devices: each device reads 1/k of the weights and of the KV cache
(its share of the heads), and every layer adds two small all-reduces (``TP_ALLREDUCE_S`` each); the
context-independent part of the per-sequence slope does not split::

    a_k = a / k + 2 * layers * TP_ALLREDUCE_S        b_k(ctx) = (b0 + b1 * ctx / k) * kv_bytes / 147 KB

with the KV cache of all k devices and prefill at k times the FLOP/s. Against the published TP rows:
intercept -5% .. +5%, slope +0.4% and +1.4% (32B TP2) but +26% (70B TP4, where the unsplit part
looks smaller). The simulator and the planner run such instances as whole scheduling units
(``cluster.instance_devices``, :mod:`bidirl.perf.instances`).

Model sizes (parameters, KV bytes per token) are counted from a model's config, never written from a
formula: the presets' published architectures are in ``ARCHITECTURES``, their counts in ``MODELS``
(recounted by the tests), and any other model is counted when named (:mod:`bidirl.models.footprint`).

Memory of a train device (FSDP/ZeRO-3, per-layer activation checkpointing, as veRL and AReaL train):
the training state (bf16 weights and gradients, fp32 master weights, two AdamW moments: 16 bytes per
parameter) sharded over the train pool, plus the activations of one micro-batch of T tokens::

    activations(T) = T * (2 h * layers           every layer's input, kept for the backward pass
                          + 12 h + 8 i           one layer recomputed: attention ~10h + residuals, the
                                                 SwiGLU MLP's four i-wide tensors (bf16, flash attention)
                          + 10 V)                the logits: bf16, their fp32 log-softmax and its gradient

(h hidden size, i MLP width, V vocabulary; Korthikanti et al. 2022's per-layer count with the
attention-score term gone under flash attention). T is a micro-batch packed to
``TRAIN_TOKENS_PER_MICRO_BATCH`` tokens (veRL's default ``ppo_max_token_len_per_gpu``), or one whole
sequence where that is longer. For 7B at 16k tokens: 3.3 + 3.2 + 24.9 = 31 GB -- the logits dominate.

Training (FSDP): tokens * k * N / (MFU * peak FLOP/s * devices) + ring all-reduce of bf16 gradients,
with k = 6 (update) [+ 2 recomputing old log-probs, veRL/AReaL] [+ 2 with a reference model]. MFU 0.33 (veRL report).
Weight sync: latency + bf16 bytes / bandwidth (7B in < 0.3 s over NCCL). A trainer's gradients
returned to the primary (a lent device, Trainer-on-RollPool): bf16 gradient bytes / link bandwidth,
serialised at the primary.

Role switch, the same rule for every policy whose devices switch: a device cannot hold a rollout
engine's full KV cache *and* its training state in HBM, so a switch releases one and reallocates the
other, as veRL's hybrid engine does with vLLM sleep/wake -- weights offloaded to or reloaded from host
memory plus a fixed cost of rebuilding the KV cache and process state::

    switch = fixed + bf16 weight bytes / host<->device bandwidth

``fixed`` = 0.36 s comes from the one published figure, veRL's 1.2 s train -> generation reshard of a
7B model on 8xH100 (two switches a step: 0.6 s each, of which 15.2 GB over PCIe Gen5's 64 GB/s is
0.24 s). ``sim.switch_s`` replaces the whole switch, weight transfer included and whatever the instance
size, for a sensitivity sweep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    peak_flops: float  # dense bf16 FLOP/s
    link_bw: float  # bytes/s for gradient all-reduce / weight broadcast across devices
    host_bw: float = 64e9  # bytes/s host <-> device (PCIe Gen5 each way; Gen4 on A100)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float
    kv_bytes_per_token: float  # bf16 keys and values of every layer
    buffer_bytes: float = 0.0  # non-parameter tensors the model holds (rotary tables, ...)
    layers: int = 0  # transformer blocks (each costs a tensor-parallel instance two all-reduces per step)
    hidden_size: int = 0  # the three widths the activations of a training step scale with
    intermediate_size: int = 0
    vocab_size: int = 0

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params  # bf16


HARDWARE: Dict[str, Hardware] = {
    "H100": Hardware("H100", 80e9, 3.35e12, 989e12, 50e9),
    "H200": Hardware("H200", 141e9, 4.8e12, 989e12, 50e9),
    "H20": Hardware("H20", 96e9, 4.0e12, 148e12, 50e9),
    "A100": Hardware("A100", 80e9, 2.0e12, 312e12, 25e9, host_bw=32e9),
}
# The presets' published architectures (their config.json fields on the hub) and the sizes counted
# from them by bidirl.models.footprint (empty weights: parameters once each, KV bytes from the attention
# shape); tests/test_models.py recounts them. Any other model: ``sim.model`` names its config.
ARCHITECTURES: Dict[str, Dict[str, object]] = {
    "1.5B": dict(model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,  # Qwen2.5-1.5B
                 num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "7B": dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,  # Qwen2.5-7B
               num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "8B": dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,  # Qwen3-8B
               num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
               tie_word_embeddings=False),
    "14B": dict(model_type="qwen2", hidden_size=5120, num_hidden_layers=48, num_attention_heads=40,  # Qwen2.5-14B
                num_key_value_heads=8, intermediate_size=13824, vocab_size=152064, tie_word_embeddings=False),
    "32B": dict(model_type="qwen2", hidden_size=5120, num_hidden_layers=64, num_attention_heads=40,  # Qwen2.5-32B
                num_key_value_heads=8, intermediate_size=27648, vocab_size=152064, tie_word_embeddings=False),
}
MODELS: Dict[str, ModelSpec] = {
    "1.5B": ModelSpec("1.5B", 1.5437e9, 28672, 512, 28, 1536, 8960, 151936),
    "7B": ModelSpec("7B", 7.6156e9, 57344, 512, 28, 3584, 18944, 152064),
    "8B": ModelSpec("8B", 8.1907e9, 147456, 512, 36, 4096, 12288, 151936),
    "14B": ModelSpec("14B", 14.770e9, 196608, 512, 48, 5120, 13824, 152064),
    "32B": ModelSpec("32B", 32.764e9, 262144, 512, 64, 5120, 27648, 152064),
}
TRAIN_TOKENS_PER_MICRO_BATCH = 16384  # veRL's ppo_max_token_len_per_gpu default (dynamic batch size)


# One small all-reduce in a tensor-parallel group over NVLink, two per layer per decode step: the mean
# of what the three TP rows of calibration.md leave over the weight reads (ML.ENERGY, vLLM on H100:
# Qwen3-32B TP2 chat 10 us and reasoning 16 us, Llama-3.3-70B TP4 chat 6 us); tests/test_sim.py
# checks the resulting errors.
TP_ALLREDUCE_S = 10e-6


@dataclass
class PerfModel:
    hardware: Hardware
    model: ModelSpec
    mfu: float = 0.33
    rollout_efficiency: float = 1.0  # >1 = slower than the serving-benchmark fit (fitted on case A)
    kv_fraction: float = 0.85  # of HBM left after weights that vLLM gives to the KV cache
    sync_latency_s: float = 0.05
    with_reference: bool = False
    recompute_logprob: bool = True
    switch_fixed_s: float = 0.36  # veRL 7B/8xH100 reshard: 0.6 s per switch minus 15.2 GB over 64 GB/s
    load_s: float = 0.1  # applying staged weights in place in a rollout engine (checkpoint-engine class)

    # ---- the PerformanceModel interface (bidirl.perf.model) -------------------------------------
    def decode_line(self, context: float, instance_devices: int = 1) -> Tuple[float, float]:
        """(a, b): a decode step with B running sequences of mean context ``context`` takes a + b * B,
        on an instance of ``instance_devices`` devices (tensor parallel: see the module docstring)."""
        k = instance_devices
        intercept = self.step_intercept / k + (2 * self.model.layers * TP_ALLREDUCE_S if k > 1 else 0.0)
        return intercept * self.rollout_efficiency, self.step_slope(context, k) * self.rollout_efficiency

    def prefill_seconds_per_token(self, instance_devices: int = 1) -> float:
        flops = self.mfu * self.hardware.peak_flops * instance_devices
        return 2 * self.model.params / flops * self.rollout_efficiency

    def request_overhead_seconds(self) -> float:
        # per-request CPU work (scheduling, detokenising, scoring) overlaps a GPU's decode steps, and the
        # calibration against published end-to-end figures (validation case A) already includes it
        return 0.0

    def load_seconds(self) -> float:
        return self.load_s

    def warmup_seconds(self, stage: str) -> float:
        # a GPU engine warms up (CUDA graph capture, allocator) while it starts, before a run's clock,
        # and the published figures it is calibrated on are steady-state throughputs
        return 0.0

    def micro_batch_overhead_seconds(self) -> float:
        # a micro-batch's command and reply are small control messages beside a GPU's seconds of work,
        # and the published step times it is calibrated on include them
        return 0.0

    def step_overhead_seconds(self) -> float:
        return 0.0

    def memory_bytes(self, longest_sequence: int = 0) -> Dict[str, float]:
        """Bytes a device may hold: bf16 weights (a rollout engine), the whole training state (bf16 weights
        and gradients, fp32 master weights and two AdamW moments: 16 bytes per parameter, to be sharded
        over a train pool), one micro-batch's activations on a train device (sequences up to
        ``longest_sequence`` tokens), and the device's HBM."""
        tokens = max(TRAIN_TOKENS_PER_MICRO_BATCH, longest_sequence)
        return {"weights": self.model.weight_bytes + self.model.buffer_bytes, "train_state": 16 * self.model.params,
                "activations": self.activation_bytes(tokens), "hbm": self.hardware.hbm_bytes}

    def activation_bytes(self, tokens: float) -> float:
        """Peak activations of one training micro-batch of ``tokens`` (see the module docstring)."""
        m = self.model
        return tokens * (2 * m.hidden_size * m.layers + 12 * m.hidden_size + 8 * m.intermediate_size
                         + 10 * m.vocab_size)

    # ---- rollout ------------------------------------------------------------------------------
    @property
    def step_intercept(self) -> float:
        return self.model.weight_bytes / self.hardware.hbm_bw / 0.75

    def step_slope(self, context: float, instance_devices: int = 1) -> float:
        """Per running sequence: a part that does not split over a TP group, and the KV-cache reads that
        grow with the context, which do (each device holds 1/k of the KV heads)."""
        scale = self.model.kv_bytes_per_token / 147e3 * 3.35e12 / self.hardware.hbm_bw
        return (0.054e-3 + 5.2e-8 * context / instance_devices) * scale

    def decode_slowdown_beside_training(self) -> float:
        return 1.0  # one GPU's decode does not slow down because another GPU trains

    def decode_slowdown_beside_decoding(self) -> float:
        return 1.0  # nor because another GPU decodes

    def max_concurrency(self, context: float, instance_devices: int = 1) -> int:
        free = (instance_devices * self.hardware.hbm_bytes - self.model.weight_bytes) * self.kv_fraction
        return max(1, int(free / (self.model.kv_bytes_per_token * max(context, 1.0))))

    # ---- training -----------------------------------------------------------------------------
    def train_seconds(self, tokens: float, devices: int) -> float:
        return self.train_compute_seconds(tokens) / devices + self.allreduce_seconds(devices)

    def train_compute_seconds(self, tokens: float, recompute_logprob: bool = None) -> float:  # type: ignore[assignment]
        """Device-seconds of gradient computation for ``tokens`` (split evenly over data-parallel devices)."""
        recompute = self.recompute_logprob if recompute_logprob is None else recompute_logprob
        k = 6 + (2 if recompute else 0) + (2 if self.with_reference else 0)
        return k * self.model.params * tokens / (self.mfu * self.hardware.peak_flops)

    def allreduce_seconds(self, devices: int) -> float:
        """Ring all-reduce of bf16 gradients over ``devices``."""
        return 0.0 if devices == 1 else 2 * (devices - 1) / devices * self.model.weight_bytes / self.hardware.link_bw

    def gradient_return_seconds(self, devices: int) -> float:
        """``devices`` lent trainers each send their bf16 gradients to the primary, one after another."""
        return devices * self.model.weight_bytes / self.hardware.link_bw

    def train_state_seconds(self) -> float:
        """The primary's training state (fp32 master weights and two AdamW moments) sent to one device."""
        return 12 * self.model.params / self.hardware.link_bw

    def switch_seconds(self, to: str = "", instance_devices: int = 1) -> float:
        """One role switch with sleep/wake (see the module docstring): the same for every policy. The
        devices of a tensor-parallel instance switch at once, each moving its 1/k of the weights."""
        return self.switch_fixed_s + self.model.weight_bytes / instance_devices / self.hardware.host_bw

    def sync_seconds(self, devices: int) -> float:
        return self.sync_latency_s + self.model.weight_bytes / self.hardware.link_bw if devices > 1 else 0.0
