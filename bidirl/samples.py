"""What a rollout engine produces and a trainer consumes: the ground-floor data types.

A :class:`Sample` carries everything the trainer needs to correct for staleness: the token ids, the
behaviour policy's per-token log-probs and the policy version that produced them. Imports nothing
from bidirl, so every layer (engines, GRPO, the runtime's messages) can use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # samples per prompt (the GRPO group size)
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    seed: Optional[int] = None
    ignore_eos: bool = False  # always generate max_new_tokens (profiling decode steps at a known length)


@dataclass
class Sample:
    prompt_index: int  # which prompt of the request this sample answers
    prompt_ids: List[int]
    completion_ids: List[int]
    text: str
    logprobs: List[float]  # behaviour log-prob of each completion token (at the sampling temperature)
    version: int  # policy version of the weights that generated it
    finished: bool = True  # ended with EOS (False: cut at max_new_tokens)
    reward: float = 0.0
    advantage: float = 0.0
    extra: Dict[str, Any] = field(default_factory=dict)
    # the version behind each completion token, where they differ: a request stopped mid-generation and
    # resumed on another engine (migrated) holds tokens of two versions, and ``version`` is its oldest
    # (staleness counts the oldest token). Empty: every token is ``version``'s.
    token_versions: List[int] = field(default_factory=list)

    def versions(self) -> List[int]:
        """The version behind each completion token."""
        return list(self.token_versions) or [self.version] * len(self.completion_ids)

    def budget_left(self, max_new_tokens: int) -> int:
        """Tokens this sample may still generate within ``max_new_tokens`` in all (0 once it has ended)."""
        return 0 if self.finished else max(0, max_new_tokens - len(self.completion_ids))

    def continued(self, ids: List[int], logprobs: List[float], version: int, finished: bool, text: str) -> "Sample":
        """This unfinished sample with ``ids`` generated after it by ``version``'s weights (a resumed
        request): its own tokens and behaviour log-probs unchanged, the new ones appended."""
        assert len(ids) == len(logprobs), "one behaviour log-prob per generated token"
        versions = self.versions() + [version] * len(ids)
        return Sample(self.prompt_index, list(self.prompt_ids), list(self.completion_ids) + list(ids), text,
                      list(self.logprobs) + list(logprobs), min(versions, default=version), finished,
                      self.reward, self.advantage, dict(self.extra),
                      versions if len(set(versions)) > 1 else [])


def stop_token_ids(generation_config: Any, eos_token_id: Optional[int]) -> List[int]:
    """The ids that end a completion: the tokenizer's EOS, then every EOS id the model's generation
    config lists (a hub instruct model lists its turn end and its text end there: Qwen2.5-Instruct's
    ``<|im_end|>`` and ``<|endoftext|>``). vLLM stops at all of them too, so both engines end a
    completion at the same token."""
    listed = getattr(generation_config, "eos_token_id", None)
    listed = [listed] if isinstance(listed, int) else list(listed or [])
    return list(dict.fromkeys(i for i in [eos_token_id, *listed] if i is not None))
