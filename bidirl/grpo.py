r"""GRPO on stale samples: PPO clipped around the behaviour policy, or AReaL's decoupled PPO.

For each prompt ``q`` the rollout engine draws a group of ``G`` completions ``o_1..o_G`` from the
behaviour policy ``mu`` (the weights of version ``v_mu`` that the rollout engine held), recording each
token's log-prob ``log mu(o_{i,t})``. With rewards ``r_i``:

    A_i = (r_i - mean_j r_j) / (std_j r_j + eps)          (std scaling optional: ``std_normalize``)

The trainer minimises, over the tokens of all completions in the batch,

    L(theta) = - agg_{i,t} [ w_{i,t} * min( rho_{i,t} A_i, clip(rho_{i,t}, 1-eps_c, 1+eps_c) A_i ) ]
               + beta * agg_{i,t} KL_k3( pi_theta || pi_ref )

with, by ``algorithm.correction``:

* ``naive`` (the default; AReaL's name for it): PPO whose old policy is the behaviour policy,
  ``rho = pi_theta / mu`` and ``w = 1``. A stale token whose ratio has already left ``[1-eps_c, 1+eps_c]``
  in its advantage's direction gives no gradient: a trust region around what generated the sample.
* ``decoupled`` (AReaL's decoupled PPO): ``rho = pi_theta / pi_prox`` (trust region around the proximal
  policy, the trainer's at the start of the step) and ``w = min(pi_prox / mu, w_max)``.
* ``none``: stale samples trained as if fresh, ``rho = pi_theta / pi_prox``, ``w = 1`` (a negative control).

Why ``naive`` is the default. bidirl takes one optimizer step per batch (the gradients of all
micro-batches are accumulated first), so during the whole gradient computation ``pi_theta == pi_prox``
and we take ``log pi_prox = log pi_theta`` detached (it saves a forward pass). Then the decoupled
``rho`` is 1 in value and its clip never binds: decoupled PPO degenerates to importance-weighted policy
gradient, ``w * A * grad log pi_theta``, with no trust region at all, and at staleness 4 it trails sync by
4-8 points of held-out accuracy while ``naive`` matches it (``experiments/convergence/README.md``).
The clip around ``mu`` is the one trust region that can bind on stale tokens. With fresh samples
(``mu == pi_theta``) every correction is ordinary on-policy GRPO.

* ``agg`` is ``token_mean`` (every token of the batch weighs the same, as in DAPO; the default) or
  ``seq_mean`` (mean over each sequence's tokens, then over sequences, as in the GRPO paper).
* The KL term uses the k3 estimator against a frozen copy of the initial policy, aggregated as the
  loss is, and only when ``kl_coef > 0`` (default 0: no reference model is kept).
* Log-probs are of the temperature-scaled distribution ``softmax(logits / T)`` that was sampled.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from bidirl.samples import Sample

IMPORTANCE_WEIGHT_CAP = 5.0


def group_advantages(rewards: Sequence[float], std_normalize: bool = True, eps: float = 1e-6) -> List[float]:
    """Advantages of one group: reward minus the group mean, optionally over the group std. A group whose
    rewards are all equal teaches nothing: exactly 0 each (the mean of equal floats such as 0.1 can miss
    them by 1e-17, which over std + eps left ~1e-11 and kept the group as informative)."""
    if max(rewards) == min(rewards):
        return [0.0] * len(rewards)
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not std_normalize:
        return centred
    std = (sum(c * c for c in centred) / len(centred)) ** 0.5
    return [c / (std + eps) for c in centred]


def assign_advantages(samples: Sequence[Sample], std_normalize: bool = True) -> None:
    """Fills ``sample.advantage`` group by group (a group = samples sharing ``prompt_index``)."""
    groups: Dict[int, List[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.prompt_index, []).append(sample)
    for group in groups.values():
        for sample, adv in zip(group, group_advantages([s.reward for s in group], std_normalize)):
            sample.advantage = adv


CORRECTIONS = ("naive", "decoupled", "none")  # the first is the default


def policy_loss(
    logp: Any, behaviour_logp: Any, advantages: Any, mask: Any, clip_eps: float, aggregation: str,
    total_tokens: int, total_sequences: int, correction: str = "naive",
) -> Dict[str, Any]:
    """Loss of one micro-batch, scaled so that summing over micro-batches gives the batch loss.

    Shapes: ``logp``, ``behaviour_logp``, ``mask``: [B, T]; ``advantages``: [B].

    ``correction``: "naive", "decoupled" or "none" (the module docstring).
    The statistics: the mean importance weight (``w``; naive: ``rho``) and the fraction of tokens it was
    cut at (``w_max``; naive: outside the clip range).
    """
    import torch

    if correction == "naive":
        prox = behaviour_logp
        ratio = torch.exp(logp - prox)
        weight = torch.ones_like(ratio)
        shown, cut = ratio.detach(), (ratio.detach() - 1).abs() > clip_eps
    elif correction == "none":
        prox = logp.detach()
        ratio = torch.exp(logp - prox)
        weight = torch.ones_like(ratio)
        shown, cut = torch.exp(prox - behaviour_logp), torch.zeros_like(ratio, dtype=torch.bool)
    else:
        prox = logp.detach()
        ratio = torch.exp(logp - prox)
        raw = torch.exp(prox - behaviour_logp)
        weight = raw.clamp(max=IMPORTANCE_WEIGHT_CAP)
        shown, cut = weight, raw > IMPORTANCE_WEIGHT_CAP
    adv = advantages.unsqueeze(1)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    loss = aggregate(-weight * surrogate * mask, mask, aggregation, total_tokens, total_sequences)
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        stats = {
            "importance_weight_mean": ((shown * mask).sum() / n).item(),
            "importance_weight_clipped": ((cut * mask).sum() / n).item(),
            # (the policy trained against the behaviour policy: under naive, prox *is* the behaviour policy)
            "behaviour_logp_abs_diff": (((logp.detach() - behaviour_logp).abs() * mask).sum() / n).item(),
        }
    return {"loss": loss, "stats": stats}


def aggregate(per_token: Any, mask: Any, aggregation: str, total_tokens: int, total_sequences: int) -> Any:
    """A micro-batch's share of the batch mean of ``per_token`` (masked): over every token of the batch
    (``token_mean``), or over each sequence's tokens, then over the batch's sequences (``seq_mean``)."""
    if aggregation == "seq_mean":
        return (per_token.sum(1) / mask.sum(1).clamp(min=1)).sum() / total_sequences
    return per_token.sum() / total_tokens


def k3_kl(logp: Any, ref_logp: Any, mask: Any, aggregation: str, total_tokens: int, total_sequences: int) -> Any:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref), aggregated as the policy loss is (the GRPO
    paper's objective averages the KL penalty inside each sequence's mean, with the surrogate)."""
    import torch

    delta = ref_logp - logp
    return aggregate((torch.exp(delta) - delta - 1) * mask, mask, aggregation, total_tokens, total_sequences)
