"""Response-length workloads for the simulator: long tails, a cap, correlated groups, drift over steps.

Lengths of one prompt's samples are strongly correlated (PolyTrace): a prompt draws a log-normal
"difficulty" mean, its G samples scatter around it with a smaller spread. A share of samples hits the
cap (reasoning at 16k). Drift multiplies every mean by ``1 + drift * step / steps`` (RL makes reasoning
longer as training proceeds). Deterministic for a seed. Presets follow ``calibration.md``. A workload
measured by ``bidirl profile`` can instead replay its measured groups (``empirical``): a task's
lengths need not be log-normal (chains of 2-16 steps give nearly uniform lengths, whose tail a
log-normal of the same mean and spread overstates).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Dict, List, Tuple


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_tokens: int
    mean_tokens: float  # mean response length before the cap
    cap: int
    prompt_sigma: float  # log-normal spread of per-prompt means (between prompts)
    sample_sigma: float  # spread of samples around their prompt's mean (within a group)
    drift: float = 0.0  # relative growth of the mean over the whole run
    # share of samples the trainer computes gradients on: GRPO drops groups whose rewards are all equal
    # (zero advantage); 1.0 for systems that train them anyway (the published presets' step times)
    informative: float = 1.0
    # measured groups of response lengths (a profile's own rollout): when given, a group's lengths are
    # one of them, picked by its draw and scaled to ``mean_tokens``, instead of the log-normal shape
    empirical: Tuple[Tuple[int, ...], ...] = ()

    def group_lengths(self, draws: "GroupDraws", group: int, step: int, steps: int) -> List[int]:
        """Lengths of prompt group ``group``'s samples when it is generated at ``step``: fixed standard
        normal draws per group, scaled by this workload (and its drift at ``step``)."""
        return self.groups_lengths(draws, group, 1, step, steps)[0]

    def groups_lengths(self, draws: "GroupDraws", first: int, count: int, step: int, steps: int) -> List[List[int]]:
        """``group_lengths`` of the ``count`` groups from ``first`` on, all generated at ``step`` (a chunk)."""
        mean = self.mean_at(step, steps)
        if self.empirical:
            return [self._measured_group(z_prompt, len(z_samples), mean)
                    for z_prompt, z_samples in map(draws.draws, range(first, first + count))]
        # log-normal with the requested mean: mu = ln(mean) - sigma^2 / 2, per prompt, then per sample
        # max(1, min(cap, int(exp(mu + sigma * z)))), written out: called for every group generated
        prompt_mu, prompt_sigma = math.log(mean) - self.prompt_sigma ** 2 / 2, self.prompt_sigma
        half_variance, cap, sigma, exp, log = self.sample_sigma ** 2 / 2, self.cap, self.sample_sigma, math.exp, math.log
        groups = []
        for z_prompt, z_samples in map(draws.draws, range(first, first + count)):
            mu = log(exp(prompt_mu + prompt_sigma * z_prompt)) - half_variance
            groups.append([1 if (n := int(exp(mu + sigma * z))) < 1 else cap if n > cap else n for z in z_samples])
        return groups

    def capped_mean(self, mean: float) -> float:
        """The mean of the lengths drawn with ``mean`` before the cap, after it (log-normal, sigma^2 the sum of
        the prompt and sample variances: E[min(X, cap)]); to within the rounding to whole tokens."""
        sigma = math.sqrt(self.prompt_sigma ** 2 + self.sample_sigma ** 2)
        if sigma == 0:
            return min(mean, self.cap)
        mu, log_cap = math.log(mean) - sigma ** 2 / 2, math.log(self.cap)
        phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
        return mean * phi((log_cap - mu - sigma ** 2) / sigma) + self.cap * (1 - phi((log_cap - mu) / sigma))

    def uncapped_mean(self, measured: float) -> float:
        """The mean before the cap (``mean_tokens``) whose lengths average ``measured`` after it: what lengths
        measured in a run say about this workload. A measured workload (``empirical``) scales its groups and
        caps them afterwards, so its mean is the measured one."""
        if self.empirical or measured <= 0:
            return measured
        low, high = measured, measured  # capped_mean(m) <= m, and grows with m towards the cap
        while self.capped_mean(high) < measured and high < 1e3 * measured:
            high *= 2
        for _ in range(60):
            middle = math.sqrt(low * high)
            low, high = (middle, high) if self.capped_mean(middle) < measured else (low, middle)
        return high

    def mean_at(self, step: int, steps: int) -> float:
        """The mean response length (before the cap) of groups generated at ``step``: drift grows it."""
        return self.mean_tokens * (1.0 + self.drift * step / max(1, steps))

    def _measured_group(self, z: float, size: int, mean: float) -> List[int]:
        """The measured group the draw ``z`` picks (its quantile), its lengths scaled so that the
        measured mean becomes ``mean`` and kept under the cap; G samples, cycling if the group is smaller."""
        pick = self.empirical[min(len(self.empirical) - 1,
                                  int(0.5 * (1 + math.erf(z / math.sqrt(2))) * len(self.empirical)))]
        measured_mean = sum(map(sum, self.empirical)) / sum(map(len, self.empirical))
        scale = mean / measured_mean
        return [max(1, min(self.cap, round(pick[i % len(pick)] * scale))) for i in range(size)]


class GroupDraws:
    """Standard normal draws per prompt group that depend only on (seed, group): every policy sees the
    same prompts (common random numbers). Drawn in blocks, because seeding a generator per group
    would dominate a 1024-device simulation."""

    BLOCK = 256
    KEEP = 64  # blocks kept: chunks of several versions are in flight at once, so groups of a few
    # neighbouring blocks alternate (eta 4 at 512 groups a batch spans 10 blocks)

    def __init__(self, seed: int, group_size: int):
        self.seed, self.G = seed, group_size
        self.blocks: Dict[int, list] = {}

    def draws(self, group: int):
        block, offset = divmod(group, self.BLOCK)
        cached = self.blocks.get(block)
        if cached is None:
            z, width = standard_normals(self.seed * 1_000_003 + block, self.BLOCK * (self.G + 1)), self.G + 1
            cached = [(z[i], z[i + 1:i + width]) for i in range(0, self.BLOCK * width, width)]
            if len(self.blocks) >= self.KEEP:
                del self.blocks[min(self.blocks)]  # groups are drawn in rising order: the oldest block is done
            self.blocks[block] = cached
        return cached[offset]


def standard_normals(seed: int, n: int) -> List[float]:
    """The first ``n`` values ``random.Random(seed).gauss(0.0, 1.0)`` returns, bit for bit, 4x faster:
    its Box-Muller transform written out over uniforms drawn in one go (a pair of uniforms gives two
    values, the cosine one first, as ``gauss`` caches the sine one for its next call)."""
    uniform = random.Random(seed).random
    u = [uniform() for _ in range(n + (n & 1))]
    z: List[float] = []
    cos, sin, log, sqrt, tau = math.cos, math.sin, math.log, math.sqrt, math.tau
    for a, b in zip(u[0::2], u[1::2]):
        angle, radius = a * tau, sqrt(-2.0 * log(1.0 - b))
        z.append(cos(angle) * radius)
        z.append(sin(angle) * radius)
    return z[:n]


PRESETS: Dict[str, Workload] = {
    # veRL GSM8K report: prompt ~93, response mean ~232, cap 1024 rarely hit
    "gsm8k": Workload("gsm8k", prompt_tokens=93, mean_tokens=232, cap=1024, prompt_sigma=0.35, sample_sigma=0.25),
    # OpenMathInstruct-2 / MATH: mean ~1-3k with a 4k cap
    "math": Workload("math", prompt_tokens=150, mean_tokens=1600, cap=4096, prompt_sigma=0.6, sample_sigma=0.35,
                     drift=0.2),
    # reasoning with a 16k cap: mean 7-10k, 10-30% at the cap, lengths drift upwards
    "reasoning": Workload("reasoning", prompt_tokens=200, mean_tokens=9000, cap=16384, prompt_sigma=0.7,
                          sample_sigma=0.3, drift=0.3),
    # responses that grow eightfold over the run (400 -> 3,200 tokens: a policy learning to reason at
    # length, as DeepSeek-R1-style runs report), for re-planning at run time
    "math-drift": Workload("math-drift", prompt_tokens=150, mean_tokens=400, cap=4096, prompt_sigma=0.6,
                           sample_sigma=0.35, drift=7.0),
    # veRL fully-async case B (DAPO, Qwen2.5-Math-7B, 28k cap, 32xH20), from its published colocated step:
    # update_actor 269.8 s at 6N FLOPs/token, MFU 0.33 -> ~1,130 tokens per sample (old_log_prob 107.7 s
    # at 2N -> ~1,350), and generation 357 s ~ one sequence decoding alone to the 28k cap (~370 s): a
    # mean ~1.1k response with a tail that reaches the cap about once per 8,192-sample step.
    "dapo-28k": Workload("dapo-28k", prompt_tokens=150, mean_tokens=1100, cap=28672, prompt_sigma=1.0,
                         sample_sigma=0.5),
}


def preset(name: str) -> Workload:
    if name not in PRESETS:
        raise ValueError(f"unknown workload '{name}' (known: {', '.join(PRESETS)})")
    return PRESETS[name]
