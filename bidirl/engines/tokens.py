"""Token-level helpers shared by the trainer and the transformers rollout engine.

Both compute a completion token's log-prob the same way -- ``log_softmax(logits / T)`` at the position
before it -- so that for identical weights the trainer reproduces the behaviour log-probs exactly.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

from bidirl.samples import Sample


def pack(samples: Sequence[Sample], pad_id: int, torch: Any, device: Any = None) -> Tuple[Any, Any, Any]:
    """Right-padded ``prompt + completion`` ids, attention mask, and a mask of completion targets, built
    on the host and moved to ``device`` (the model's) in one copy each.

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
    if device is not None and torch.device(device).type != "cpu":
        return ids.to(device), attention.to(device), targets.to(device)
    return ids, attention, targets


def token_logprobs(model: Any, ids: Any, attention: Any, temperature: float, torch: Any, chunk_tokens: int = 0) -> Any:
    """[B, T-1] log-prob of each next token under ``softmax(logits / T)``.

    With ``chunk_tokens``, the output head and the fp32 log-softmax run over that many token positions
    at a time, each chunk recomputed in the backward pass: the full-vocabulary fp32 logits of a
    micro-batch (64 x 1k tokens x 152k vocabulary = 40 GB for Qwen2.5) never exist at once. The result
    equals the whole computation (same operations per position). Models whose head is not a plain
    projection of the last hidden state (logit soft-capping or scaling) take the whole computation.
    """
    head = _plain_head(model) if chunk_tokens else None
    if head is None:
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        return _gather_logprobs(logits, ids[:, 1:], temperature, torch)
    from torch.utils.checkpoint import checkpoint

    hidden = model.get_decoder()(input_ids=ids, attention_mask=attention).last_hidden_state[:, :-1]
    rows, width = hidden.shape[0], hidden.shape[1]
    flat, targets = hidden.reshape(rows * width, -1), ids[:, 1:].reshape(-1)
    part = lambda h, t: _gather_logprobs(head(h), t, temperature, torch)  # noqa: E731
    pieces = []
    for start in range(0, flat.shape[0], chunk_tokens):
        h, t = flat[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        pieces.append(checkpoint(part, h, t, use_reentrant=False) if torch.is_grad_enabled() else part(h, t))
    return torch.cat(pieces).view(rows, width)


def _gather_logprobs(logits: Any, targets: Any, temperature: float, torch: Any) -> Any:
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


_SCALED_HEADS = ("final_logit_softcapping", "logit_scale", "logits_scaling")  # Gemma 2, Cohere, Granite


def _plain_head(model: Any) -> Any:
    """The output projection, when logits are exactly ``head(last hidden state)``; else None."""
    if any(getattr(model.config, name, None) not in (None, 1, 1.0) for name in _SCALED_HEADS):
        return None
    try:
        return model.get_output_embeddings() if model.get_decoder() is not None else None
    except (AttributeError, NotImplementedError):
        return None


def completion_slices(samples: Sequence[Sample], logp: Any) -> List[List[float]]:
    """Per-sample lists of completion-token log-probs from a packed [B, T-1] tensor."""
    out = []
    for row, sample in enumerate(samples):
        start = len(sample.prompt_ids) - 1
        out.append(logp[row, start : start + len(sample.completion_ids)].tolist())
    return out
