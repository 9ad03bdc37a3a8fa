"""Rollout engine on plain transformers/torch: KV-cache sampling with ``model.generate``.

For machines without vLLM and for cross-checking it. Behaviour log-probs are computed from the raw
per-step logits that ``generate`` returns, as ``log_softmax(logits / T)`` -- the same expression the
trainer uses (:mod:`bidirl.engines.tokens`). Generation is synchronous, so ``pause`` takes effect
between generate calls (chunks of ``max_batch`` sequences).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from bidirl.engines.protocols import Generation, HandOver, PauseGate, RolloutSite
from bidirl.sched.events import choose_groups
from bidirl.samples import Sample, SamplingParams, stop_token_ids
from bidirl.models.sources import load_model


class HFRolloutEngine(PauseGate):
    max_batch = 256  # sequences per generate call

    def __init__(self, model_path: str, dtype: str = "float32", seed: int = 0, cache_root: str = "",
                 site: RolloutSite = RolloutSite()):
        import torch

        super().__init__()
        self.torch = torch
        self.model, self.tokenizer = load_model(model_path, dtype)
        self.model.to(torch.device(site.device_type))
        self.stop_ids = stop_token_ids(self.model.generation_config, self.tokenizer.eos_token_id)
        self.version = 0
        self._calls = 0
        self._seed = seed

    def generate(self, prompts: Sequence[str], params: SamplingParams, handover: Optional[HandOver] = None,
                 done: Optional[Callable[[List[Sample]], None]] = None) -> List[Sample]:
        """With ``handover``, ``model.generate`` stops (a stopping criterion) as soon as groups are asked
        for; they are handed over with their tokens so far -- prompts of a later call not started yet go
        as empty samples -- and the rest continue here (re-prefilled: this engine has no request-level
        abort). ``done`` is never called: every group is returned at the end (the groups of one static
        ``model.generate`` batch end together; a chunk of several batches is not reported batch by batch)."""
        per_call = max(1, self.max_batch // params.n)
        if handover is None:
            samples: List[Sample] = []
            for start in range(0, len(prompts), per_call):
                self.wait_if_paused()  # paused engines finish the chunk in flight, then wait here
                for sample in self._generate_chunk(prompts[start : start + per_call], params):
                    sample.prompt_index += start
                    samples.append(sample)
            return samples
        held: Dict[int, List[Sample]] = {}  # prompt index -> its samples, still held
        unstarted = list(range(len(prompts)))
        while unstarted:
            self.wait_if_paused()
            indices, unstarted = unstarted[:per_call], unstarted[per_call:]
            for sample in self._generate_chunk([prompts[i] for i in indices], params, handover.pending):
                sample.prompt_index = indices[sample.prompt_index]
                held.setdefault(sample.prompt_index, []).append(sample)
            unstarted = self._hand_over_and_continue(handover, held, params, prompts, unstarted)
        handover.close()
        return [s for index in sorted(held) for s in held[index]]

    def serve(self, joins: Callable[[], Optional[Generation]]) -> None:
        """One static batch at a time: each generation runs whole, then the next is polled."""
        while (generation := joins()) is not None:
            generation.over(self.generate(generation.prompts, generation.params, generation.handover, generation.done))

    def _hand_over_and_continue(self, handover: HandOver, held: Dict[int, List[Sample]], params: SamplingParams,
               prompts: Sequence[str], unstarted: List[int]) -> List[int]:
        """Answers the asks, then continues the unfinished samples held, until none is left; returns the
        prompts still to start (those handed over unstarted are gone)."""
        while True:
            for groups in handover.wanted():
                running = {i: sum(1 for s in ss if s.budget_left(params.max_new_tokens)) for i, ss in held.items()}
                running.update({i: params.n for i in unstarted})
                chosen = choose_groups(running, sorted([*held, *unstarted]), groups)
                for i in chosen:
                    if i in unstarted:
                        ids = self.tokenizer(prompts[i], add_special_tokens=False).input_ids
                        held[i] = [Sample(i, ids, [], "", [], self.version, False) for _ in range(params.n)]
                unstarted = [i for i in unstarted if i not in chosen]
                handover.give(chosen, [s for i in chosen for s in held.pop(i)])
            todo = [s for ss in held.values() for s in ss if s.budget_left(params.max_new_tokens)]
            if not todo:
                return unstarted
            resumed = dict(zip(map(id, todo), self._continue(todo, params, handover.pending)))
            for index, ss in held.items():
                held[index] = [resumed.get(id(s), s) for s in ss]

    def _generate_chunk(self, prompts: Sequence[str], params: SamplingParams,
                        stop: Optional[Callable[[], bool]] = None) -> List[Sample]:
        enc = self.tokenizer(list(prompts), return_tensors="pt", padding=True, add_special_tokens=False)
        new_tokens, logp = self._sample_tokens(enc["input_ids"], enc["attention_mask"], params, stop)
        prompt_ids = [ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"], enc["attention_mask"])]
        return [self._sample(i // params.n, prompt_ids[i // params.n], new_tokens[i], logp[i])
                for i in range(new_tokens.shape[0])]

    def _sample_tokens(self, input_ids: Any, attention_mask: Any, params: SamplingParams,
                       stop: Optional[Callable[[], bool]] = None) -> Tuple[Any, Any]:
        """Sampled continuations of left-padded ``input_ids`` ([B*n, steps] tokens) and each token's
        behaviour log-prob under ``softmax(logits / T)``; every row stops early once ``stop()`` is true."""
        torch = self.torch
        criteria = None
        if stop is not None:
            from transformers import StoppingCriteria, StoppingCriteriaList

            class StopWhenAsked(StoppingCriteria):
                def __call__(self, ids: Any, scores: Any, **kwargs: Any) -> Any:
                    return torch.full((ids.shape[0],), stop(), dtype=torch.bool, device=ids.device)

            criteria = StoppingCriteriaList([StopWhenAsked()])
        self._calls += 1
        torch.manual_seed((params.seed if params.seed is not None else self._seed) * 1_000_003 + self._calls)
        greedy = params.temperature <= 0
        with torch.no_grad():
            out = self.model.generate(
                input_ids=input_ids.to(self.model.device), attention_mask=attention_mask.to(self.model.device),
                max_new_tokens=params.max_new_tokens,
                do_sample=not greedy, min_new_tokens=params.max_new_tokens if params.ignore_eos else None,
                temperature=None if greedy else params.temperature, top_p=None if greedy else params.top_p,
                # the whole softmax(logits / T), which the log-probs below describe: transformers fills every
                # setting left None from the model's generation_config (a hub model's top_k, repetition
                # penalty, min_p) or its own defaults (top_k 50), and would sample from something else
                top_k=0, repetition_penalty=1.0, no_repeat_ngram_size=0, typical_p=1.0, min_p=0.0,
                epsilon_cutoff=0.0, eta_cutoff=0.0,
                num_return_sequences=params.n, output_logits=True, return_dict_in_generate=True,
                pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.stop_ids,
                stopping_criteria=criteria,
            )
        new_tokens = out.sequences[:, input_ids.shape[1] :]
        logits = torch.stack(out.logits, dim=1).float()  # [B*n, steps, vocab]
        if not greedy and params.temperature != 1.0:
            logits = logits / params.temperature
        return new_tokens, torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)

    def _sample(self, prompt_index: int, prompt_ids: List[int], tokens: Any, logp: Any) -> Sample:
        completion, finished = self._until_eos(tokens.tolist())
        text = self.tokenizer.decode(completion, skip_special_tokens=True)
        return Sample(prompt_index, prompt_ids, completion, text, logp[: len(completion)].tolist(), self.version,
                      finished)

    def _until_eos(self, ids: List[int]) -> Tuple[List[int], bool]:
        """Generated ids up to and including the first stop id (:func:`stop_token_ids`), and whether there was one."""
        for end, token in enumerate(ids):
            if token in self.stop_ids:
                return ids[: end + 1], True
        return ids, False

    def continue_samples(self, partial: Sequence[Sample], params: SamplingParams) -> List[Sample]:
        """Left-padded prefixes, generated to the longest remaining budget; each continuation is then cut
        to its own (a token past a request's budget would never have been sampled for it)."""
        return self._continue(partial, params)

    def _continue(self, partial: Sequence[Sample], params: SamplingParams,
                  stop: Optional[Callable[[], bool]] = None) -> List[Sample]:
        torch = self.torch
        todo = [s for s in partial if s.budget_left(params.max_new_tokens)]
        resumed = {}
        for start in range(0, len(todo), self.max_batch):
            self.wait_if_paused()
            batch = todo[start : start + self.max_batch]
            prefixes = [list(s.prompt_ids) + list(s.completion_ids) for s in batch]
            width = max(map(len, prefixes))
            pad = self.tokenizer.pad_token_id
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prefixes])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prefixes])
            budget = max(s.budget_left(params.max_new_tokens) for s in batch)
            new_tokens, logp = self._sample_tokens(ids, mask, dataclasses.replace(params, n=1, max_new_tokens=budget),
                                                   stop)
            for row, sample in enumerate(batch):
                tokens, finished = self._until_eos(new_tokens[row].tolist()[: sample.budget_left(params.max_new_tokens)])
                text = self.tokenizer.decode(list(sample.completion_ids) + tokens, skip_special_tokens=True)
                resumed[id(sample)] = sample.continued(tokens, logp[row, : len(tokens)].tolist(), self.version,
                                                       finished, text)
        return [resumed.get(id(s), s) for s in partial]

    def update_weights(self, state: Dict[str, Any], version: int) -> float:
        start = time.perf_counter()
        with self.torch.no_grad():
            for name, tensor in self.model.state_dict().items():
                tensor.copy_(state[name])
        self.version = version
        return time.perf_counter() - start
