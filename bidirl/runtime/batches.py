"""The RL data path of one run, in the order it happens (GRPO, stale samples corrected as bidirl.grpo says).

::

    1. prompts      the sampler draws B problems per step (reshuffled each epoch, seeded); the run's
                    one PromptBuilder writes them as prompts; a chunk of them goes to a rollout device
    2. rollout      the device samples G completions per prompt with the weights it holds, each token
                    with its behaviour log-prob and the version that produced it, and rewards them
                    (numeric match with the reference answer) -> ChunkGenerated
    3. groups       completions are grouped by prompt; a group waits until the scheduler puts it in
                    a batch (B groups, composed by the cluster bookkeeping: oldest version first)
    4. advantages   within each group: A_i = (r_i - mean r) / (std r + eps)     (bidirl.grpo)
    5. filter       groups whose rewards are all equal have zero advantage and teach nothing: dropped
    6. work queue   the informative samples, cut into micro-batches: the step's devices pull them one
                    at a time (a device that joins mid-step takes a share of what is left); each
                    scales its gradient by the whole batch's token count, so the parts add up to the
                    batch gradient, and the primary trainer applies one optimizer step -> version k + 1

A streamed step starts on the groups of its batch already done (``Cluster.stream_plan``): :class:`StreamedBatch` turns
each later arrival into micro-batches at once (unnormalised sums), and the step's normaliser comes when
the last group is in.

Steps 1-3 run while earlier batches train; the scheduler decides when and where each happens. This
module decides nothing about scheduling: it turns chunks into prompts and batches into train steps.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

from bidirl.config import PipelineConfig
from bidirl.data import PromptSampler, load_problems
from bidirl.grpo import assign_advantages
from bidirl.prompts import PromptBuilder
from bidirl.runtime import protocol as msg
from bidirl.samples import Sample, SamplingParams
from bidirl.sched.cluster import Chunk
from bidirl.sched.estimates import pulled_items

PROBE_SAMPLES = 8  # samples the primary re-scores before a step: the live check that weight loads arrive


@dataclass
class Batch:
    """One optimizer step's data: its micro-batches, in order, to be pulled by the step's devices, and
    what is logged about it."""

    step: int
    items: List[msg.ComputeGrads]
    stats: Dict[str, Any]
    probe: Tuple[Sample, ...]  # a few samples the primary re-scores with the weights it trains
    grad_scale: float = 1.0  # a streamed batch's normaliser, applied once its gradients are summed
    groups: Tuple[int, ...] = ()  # every prompt group the batch holds, informative or not (batches.jsonl)
    prompts: Tuple[int, ...] = ()  # their problems' positions in the seeded prompt stream (PromptSampler)
    # the (group, draw) of every sample not trained (zero advantage; batches.jsonl): with the trained ones,
    # every draw of every group, so a record can name a sample lost on the way
    untrained: Tuple[Tuple[int, int], ...] = ()


class RolloutData:
    def __init__(self, cfg: PipelineConfig, prompt: PromptBuilder):
        self.cfg, self.prompt = cfg, prompt
        self.params = SamplingParams(n=cfg.rollout.group_size, max_new_tokens=cfg.rollout.max_new_tokens,
                                     temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p)
        self.groups: Dict[int, List[List[Sample]]] = {}  # chunk -> its prompt groups not yet trained
        self.seconds: Dict[int, float] = {}  # chunk -> seconds its device spent generating it (so far)
        self.collected: Dict[int, int] = {}  # chunk -> its groups reported done so far
        # group -> its problem's position in the prompt stream, until a step trains it: what a checkpoint
        # keeps of the groups drawn and not trained yet, to draw them again on resume
        self.positions: Dict[int, int] = {}

    @functools.cached_property
    def sampler(self) -> PromptSampler:  # loaded at the first request (reading the problems takes a while)
        return PromptSampler(load_problems(self.cfg.data, "train"), self.cfg.seed)

    # 1. prompts
    def request(self, chunk: Chunk) -> msg.GenerateChunk:
        drawn = self.sampler.take(chunk.groups)
        self.positions.update((chunk.first + i, position) for i, (position, _) in enumerate(drawn))
        problems = [problem for _, problem in drawn]
        return msg.GenerateChunk(chunk=chunk.index, first_group=chunk.first, params=self.params,
                                 prompts=tuple(self.prompt(p) for p in problems),
                                 answers=tuple(p.answer for p in problems))

    # 2-3. rollout came back: group the rewarded samples by prompt
    def collect(self, chunk: int, samples: Sequence[Sample], seconds: float) -> int:
        """Groups of ``chunk`` done on one device (all of it, or -- in-flight migration -- the part that
        device finished); returns how many."""
        by_prompt = by_group(samples)
        self.groups.setdefault(chunk, []).extend(by_prompt[i] for i in sorted(by_prompt))
        self.seconds[chunk] = self.seconds.get(chunk, 0.0) + seconds
        self.collected[chunk] = self.collected.get(chunk, 0) + len(by_prompt)
        return len(by_prompt)

    # 4-6. a batch the scheduler composed -> its queue of micro-batches
    def batch(self, k: int, parts: Sequence[Tuple[Chunk, int]], devices: int = 1) -> Batch:
        samples, rollout_s = self.take(parts)
        informative = informative_samples(samples)
        total_tokens = max(1, sum(len(s.completion_ids) for s in informative))
        count = pulled_items(len(informative), self.cfg.train.micro_batch_size, devices)
        size = -(-len(informative) // count) if informative else 1
        items = [msg.ComputeGrads(step=k, samples=tuple(informative[i : i + size]), total_tokens=total_tokens,
                                  total_sequences=max(1, len(informative)))
                 for i in range(0, len(informative), size)]
        groups = group_ids(samples)
        return Batch(k, items, batch_stats(k, samples, informative, rollout_s), tuple(samples[:PROBE_SAMPLES]),
                     groups=groups, prompts=self.prompt_positions(groups), untrained=untrained_draws(samples))

    def prompt_positions(self, groups: Sequence[int]) -> Tuple[int, ...]:
        """The stream positions of ``groups``' problems, in the groups' order (``prompts[i]`` is ``groups[i]``'s)."""
        return tuple(self.positions[g] for g in groups)

    def trained(self, batch: Batch) -> None:
        """``batch``'s step is applied (its FinishStep sent): its groups are no longer drawn-and-untrained."""
        for group in batch.groups:
            del self.positions[group]

    def cursor(self) -> Dict[str, Any]:
        """The prompt stream's state for a checkpoint made now: positions drawn, and those to draw again on
        resume -- the groups drawn but not trained (generating, or done and waiting for a batch), and what
        a resumed run had still to draw again."""
        waiting = [position for position, _ in self.sampler.redo]
        return {"drawn": self.sampler.drawn, "redo": sorted([*self.positions.values(), *waiting])}

    def resume(self, cursor: Dict[str, Any]) -> None:
        self.sampler.resume(cursor["drawn"], cursor["redo"])

    def stream(self, k: int) -> "StreamedBatch":
        """Batch ``k`` of a streamed step, built as its groups finish."""
        return StreamedBatch(self, k)

    def take(self, parts: Sequence[Tuple[Chunk, int]]) -> Tuple[List[Sample], float]:
        """The samples of the groups ``parts`` name (each group once, with its GRPO advantages), and the
        device-seconds spent generating them."""
        samples: List[Sample] = []
        rollout_s = 0.0
        for chunk, groups in parts:
            for _ in range(groups):
                group = self.groups[chunk.index].pop(0)
                assign_advantages(group, self.cfg.algorithm.std_normalize)
                samples += group
            # device-seconds: the chunk's per group so far (groups reported as they end come before the
            # chunk's time is all in; once it is, this is its time times the share of its groups)
            rollout_s += self.seconds[chunk.index] * groups / (self.collected.get(chunk.index) or chunk.groups)
        return samples, rollout_s


class StreamedBatch:
    """A streamed step's data, built as its groups finish (``Cluster.stream_plan``). Each
    arrival's informative samples become micro-batches at once; the batch's token count is not known
    yet, so they are unnormalised sums (totals of 1), and ``close`` gives the normaliser the step's
    ``FinishStep`` applies: the same update as the whole batch's, up to the order of the sums."""

    def __init__(self, data: RolloutData, k: int):
        self.data, self.k = data, k
        self.samples: List[Sample] = []
        self.informative: List[Sample] = []
        self.rollout_s = 0.0

    def add(self, parts: Sequence[Tuple[Chunk, int]]) -> List[msg.ComputeGrads]:
        samples, rollout_s = self.data.take(parts)
        fresh = informative_samples(samples)
        self.samples += samples
        self.informative += fresh
        self.rollout_s += rollout_s
        micro = self.data.cfg.train.micro_batch_size
        return [msg.ComputeGrads(step=self.k, samples=tuple(fresh[i : i + micro]), total_tokens=1, total_sequences=1)
                for i in range(0, len(fresh), micro)]

    def close(self) -> Batch:
        if self.data.cfg.algorithm.loss_aggregation == "token_mean":
            scale = 1.0 / max(1, sum(len(s.completion_ids) for s in self.informative))
        else:  # seq_mean (the KL term too: bidirl.grpo.aggregate)
            scale = 1.0 / max(1, len(self.informative))
        stats = batch_stats(self.k, self.samples, self.informative, self.rollout_s)
        groups = group_ids(self.samples)
        return Batch(self.k, [], stats, tuple(self.samples[:PROBE_SAMPLES]), grad_scale=scale, groups=groups,
                     prompts=self.data.prompt_positions(groups), untrained=untrained_draws(self.samples))


def by_group(samples: Sequence[Sample]) -> Dict[int, List[Sample]]:
    """Samples by prompt group (index within their chunk), in order."""
    groups: Dict[int, List[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.prompt_index, []).append(sample)
    return groups


def group_ids(samples: Sequence[Sample]) -> Tuple[int, ...]:
    """The run-wide ids of the prompt groups ``samples`` belong to (set by the worker that generated them)."""
    return tuple(sorted({s.extra["group"] for s in samples if "group" in s.extra}))


def teaches(sample: Sample) -> bool:
    return sample.advantage != 0.0  # all-equal groups teach nothing


def informative_samples(samples: Sequence[Sample]) -> List[Sample]:
    return [s for s in samples if teaches(s)]


def untrained_draws(samples: Sequence[Sample]) -> Tuple[Tuple[int, int], ...]:
    """(group, draw) of each of ``samples`` not trained, as it teaches nothing (set by the worker that
    generated it)."""
    return tuple((s.extra["group"], s.extra["draw"]) for s in samples
                 if not teaches(s) and "group" in s.extra and "draw" in s.extra)


def batch_stats(k: int, samples: Sequence[Sample], informative: Sequence[Sample], rollout_s: float) -> Dict[str, Any]:
    return {
        "reward_mean": sum(s.reward for s in samples) / len(samples),
        "completion_tokens_mean": sum(len(s.completion_ids) for s in samples) / len(samples),
        "completion_tokens_min": min(len(s.completion_ids) for s in samples),  # the spread a long tail has
        "completion_tokens_max": max(len(s.completion_ids) for s in samples),
        "informative_ratio": len(informative) / len(samples),
        "staleness_mean": sum((k - s.version) for s in samples) / len(samples),
        "staleness_max": max(k - s.version for s in samples),
        "rollout_s": round(rollout_s, 4),
        "samples": len(samples), "tokens": sum(len(s.completion_ids) for s in samples)}
