"""Token-level helpers shared by the trainer and the transformers rollout engine.

Both compute a completion token's log-prob the same way -- ``log_softmax(logits / T)`` at the position
before it -- so that for identical weights the trainer reproduces the behaviour log-probs exactly.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

from bidirl.samples import Sample


def pack(samples: Sequence[Sample], pad_id: int, torch: Any) -> Tuple[Any, Any, Any]:
    """Right-padded ``prompt + completion`` ids, attention mask, and a mask of completion targets.

    The completion mask is aligned with ``input_ids[:, 1:]`` (the predicted tokens).
    """
    width = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    targets = torch.zeros((len(samples), width - 1), dtype=torch.float32)
    for row, sample in enumerate(samples):
        seq = list(sample.prompt_ids) + list(sample.completion_ids)
        ids[row, : len(seq)] = torch.tensor(seq)
        attention[row, : len(seq)] = 1
        targets[row, len(sample.prompt_ids) - 1 : len(seq) - 1] = 1.0
    return ids, attention, targets


def token_logprobs(model: Any, ids: Any, attention: Any, temperature: float, torch: Any) -> Any:
    """[B, T-1] log-prob of each next token under ``softmax(logits / T)``."""
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def completion_slices(samples: Sequence[Sample], logp: Any) -> List[List[float]]:
    """Per-sample lists of completion-token log-probs from a packed [B, T-1] tensor."""
    out = []
    for row, sample in enumerate(samples):
        start = len(sample.prompt_ids) - 1
        out.append(logp[row, start : start + len(sample.completion_ids)].tolist())
    return out
