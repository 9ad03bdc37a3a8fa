"""Brief supervised fine-tuning that turns the random tiny model into an RL base model.

The goal is not a good model but a useful *starting point* for RL: one that is right sometimes and
far from always (15-50% greedy accuracy on held-out problems), so that GRPO groups contain both
rewarded and unrewarded samples. The number of steps sets where it lands.

Loss: next-token cross-entropy on the completion tokens only (`` <answer><eos>``); prompt and padding
positions are masked out. AdamW with a linear warm-up and cosine decay.
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable, List, Optional, Sequence

from bidirl.config import TinyModelConfig
from bidirl.data import Problem


def supervised_finetune(
    model: Any,
    tokenizer: Any,
    problems: Sequence[Problem],
    prompt_fn: Callable[[Problem], str],
    target_fn: Callable[[Problem], str],
    cfg: TinyModelConfig,
    seed: int,
    on_step: Optional[Callable[[int, float], None]] = None,
) -> List[float]:
    """Runs ``cfg.sft_steps`` steps; returns the loss of each step."""
    import torch

    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(cfg.sft_steps))
    model.train()
    losses = []
    for step in range(cfg.sft_steps):
        batch = rng.sample(list(problems), min(cfg.sft_batch_size, len(problems)))
        input_ids, labels, mask = _encode(tokenizer, batch, prompt_fn, target_fn, torch)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if on_step:
            on_step(step, losses[-1])
    model.eval()
    return losses


def _encode(tokenizer: Any, batch: Sequence[Problem], prompt_fn: Callable, target_fn: Callable, torch: Any):
    """Right-padded prompt+target ids with labels only on the target (and its EOS)."""
    rows = []
    for problem in batch:
        prompt = tokenizer(prompt_fn(problem), add_special_tokens=False).input_ids
        target = tokenizer(target_fn(problem), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append((prompt, target))
    width = max(len(p) + len(t) for p, t in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (prompt, target) in enumerate(rows):
        ids = prompt + target
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, len(prompt) : len(ids)] = torch.tensor(target)
        mask[i, : len(ids)] = 1
    return input_ids, labels, mask


def _warmup_cosine(total_steps: int) -> Callable[[int], float]:
    warmup = max(1, total_steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor
