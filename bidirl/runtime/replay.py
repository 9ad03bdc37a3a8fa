"""Retrain a live run's recorded batches, in order, on one device: the check that borrowing changes where
the work ran and nothing else.

A run with ``logging.record_batches=true`` writes ``batches.jsonl``: per optimizer step, the prompt groups
it held and every micro-batch it trained, as the trainer saw it (token ids, behaviour log-probs,
versions, advantages), with the device that computed it -- a home trainer, or a rollout device lent to
the step. :func:`replay` feeds the same micro-batches to one train engine, sums their gradients,
applies the streamed step's normaliser, and steps the optimizer once per recorded step, as
``Worker.finish_step`` does. Its weights should equal the run's final checkpoint up to the order in
which gradients were summed (fp32 rounding, which Adam can amplify on coordinates whose gradient is
rounding noise). :func:`check_record` states the bookkeeping invariants the record must satisfy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from bidirl.config import PipelineConfig, load_config
from bidirl.samples import Sample


@dataclass
class RecordedItem:
    device: int
    samples: Tuple[Sample, ...]
    total_tokens: int
    total_sequences: int


@dataclass
class RecordedStep:
    step: int  # the batch, = the version it was trained from
    groups: List[int]  # every prompt group of the batch, informative or not
    grad_scale: float
    members: List[int]  # the devices that computed it
    lent: List[int]  # of those, rollout devices lent to the step
    items: List[RecordedItem]
    prompts: List[int] = field(default_factory=list)  # their positions in the seeded prompt stream (absent: older)
    # (group, draw) of each sample of the step not trained (zero advantage); None: a record from before it
    untrained: Optional[List[Tuple[int, int]]] = None


def read_batches(run_path: str | Path) -> List[RecordedStep]:
    steps = []
    for line in (Path(run_path) / "batches.jsonl").read_text().splitlines():
        row = json.loads(line)
        items = [RecordedItem(i["device"], tuple(Sample(**s) for s in i["samples"]), i["total_tokens"],
                              i["total_sequences"]) for i in row["items"]]
        untrained = row.get("untrained")
        steps.append(RecordedStep(row["step"], row["groups"], row["grad_scale"], row["members"], row["lent"], items,
                                  row.get("prompts", []),
                                  None if untrained is None else [(g, d) for g, d in untrained]))
    return steps


def check_record(steps: List[RecordedStep], group_size: int, staleness: float,
                 groups_per_step: Optional[int] = None) -> List[str]:
    """What is wrong with a run's record (empty: nothing). Steps come in version order, one each; every
    group, and every problem drawn from the prompt stream, is trained in one step only; every trained
    sample belongs to its step's groups and appears once (by its draw number within the group, ``extra
    ["draw"]``: two draws of a short answer are often alike; records from before it: by content); every
    draw of every group is either trained or recorded as untrained, so none was lost (records from before
    ``untrained``: not checked); no token is more than ``staleness`` versions older than the step that
    trains it; with ``groups_per_step`` (B), every step holds B groups (a group lost whole is not among a
    step's groups, which come from its samples)."""
    problems: List[str] = []
    if [s.step for s in steps] != list(range(len(steps))):
        problems.append(f"steps out of order or missing: {[s.step for s in steps]}")
    seen_groups: Dict[int, int] = {}
    seen_prompts: Dict[int, int] = {}
    for step in steps:
        if groups_per_step is not None and len(step.groups) != groups_per_step:
            problems.append(f"step {step.step} holds {len(step.groups)} groups, not {groups_per_step}")
        for group in step.groups:
            if group in seen_groups:
                problems.append(f"group {group} trained in steps {seen_groups[group]} and {step.step}")
            seen_groups[group] = step.step
        if step.prompts and len(step.prompts) != len(step.groups):
            problems.append(f"step {step.step}: {len(step.groups)} groups but {len(step.prompts)} prompt positions")
        for position in step.prompts:
            if position in seen_prompts:
                problems.append(f"prompt {position} of the stream trained in steps {seen_prompts[position]} and {step.step}")
            seen_prompts[position] = step.step
        seen_samples = set()
        for item in step.items:
            for sample in item.samples:
                group = sample.extra.get("group")
                draw = sample.extra.get("draw")
                key = (group, draw) if draw is not None else \
                    (group, sample.prompt_index, tuple(sample.completion_ids), tuple(sample.logprobs))
                if draw is not None and not 0 <= draw < group_size:
                    problems.append(f"step {step.step} trained draw {draw} of group {group} (groups of {group_size})")
                if group not in step.groups:
                    problems.append(f"step {step.step} trained a sample of group {group}, not one of its groups")
                if key in seen_samples:
                    problems.append(f"step {step.step} trained a sample of group {group} twice")
                seen_samples.add(key)
                oldest = min(sample.versions(), default=sample.version)
                if step.step - oldest > staleness:
                    problems.append(f"step {step.step} trained a token of version {oldest} (staleness above {staleness:g})")
        problems += lost_draws(step, seen_samples, group_size)
        counts: Dict[Any, int] = {}
        for item in step.items:
            for sample in item.samples:
                counts[sample.extra.get("group")] = counts.get(sample.extra.get("group"), 0) + 1
        over = {g: n for g, n in counts.items() if n > group_size}
        if over:
            problems.append(f"step {step.step}: groups with more than {group_size} samples: {over}")
    return problems


def lost_draws(step: RecordedStep, trained: set, group_size: int) -> List[str]:
    """Draws of ``step``'s groups neither trained (``trained``: the (group, draw) keys seen) nor recorded as
    untrained, and draws recorded as both."""
    if step.untrained is None:
        return []
    problems = []
    untrained: set = set()
    for group, draw in step.untrained:
        if not 0 <= draw < group_size:
            problems.append(f"step {step.step} left out draw {draw} of group {group} (groups of {group_size})")
        if group not in step.groups:
            problems.append(f"step {step.step} left out a sample of group {group}, not one of its groups")
        if (group, draw) in untrained:
            problems.append(f"step {step.step} left out draw {draw} of group {group} twice")
        untrained.add((group, draw))
    for group, draw in sorted(untrained & trained):
        problems.append(f"step {step.step} both trained and left out draw {draw} of group {group}")
    accounted = trained | untrained
    for group in step.groups:
        lost = [d for d in range(group_size) if (group, d) not in accounted]
        if lost:
            problems.append(f"step {step.step} lost draw{'s' if len(lost) > 1 else ''} {lost} of group {group}: "
                            "neither trained nor left out")
    return problems


def replay(run_path: str | Path, model_path: str, cfg: PipelineConfig | None = None) -> Dict[str, Any]:
    """The weights after retraining ``run_path``'s recorded steps on one device from ``model_path``
    (the run's base model), with the run's own config."""
    from bidirl.engines.build import build_train_engine

    cfg = cfg or load_config(Path(run_path) / "config.yaml")
    train = build_train_engine(cfg, model_path)
    for step in read_batches(run_path):
        for item in step.items:
            train.compute_grads(item.samples, item.total_tokens, item.total_sequences)
        for p in train.parameters():  # as Worker.finish_step: a parameter without a gradient steps on zeros
            if p.grad is None:
                p.grad = p.detach().new_zeros(p.shape)
            if step.grad_scale != 1.0:  # a streamed step's gradients are unnormalised sums until it is complete
                p.grad.mul_(step.grad_scale)
        train.apply_grads()
    return train.state_dict()
