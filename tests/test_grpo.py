import pytest
import torch

from bidirl.samples import Sample
from bidirl.grpo import IMPORTANCE_WEIGHT_CAP, assign_advantages, group_advantages, policy_loss


def sample(prompt_index, reward):
    return Sample(prompt_index, [1], [2], "", [0.0], 0, reward=reward)


def test_group_advantages_are_centred_and_scaled_by_the_group_std():
    adv = group_advantages([1.0, 0.0, 0.0, 0.0])
    assert sum(adv) == pytest.approx(0.0, abs=1e-6)
    assert adv[0] == pytest.approx(3 ** 0.5, rel=1e-4) and adv[1] == pytest.approx(-(3 ** -0.5), rel=1e-4)


def test_a_group_with_equal_rewards_carries_no_signal():
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    # format rewards: the mean of eight 0.1s misses 0.1 by 1e-17, which over std + eps was ~1e-11
    assert group_advantages([0.1] * 8) == [0.0] * 8 and group_advantages([1.1] * 3) == [0.0] * 3


def test_the_stale_gap_statistic_measures_the_trained_policy_against_the_behaviour_policy_whatever_the_correction():
    logp, behaviour = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.5, -0.5]])
    for correction in ("naive", "decoupled", "none"):  # (under naive it read 0 always: it used the behaviour policy)
        assert _loss(logp, behaviour, [1.0], correction=correction)["stats"]["behaviour_logp_abs_diff"] == \
            pytest.approx(0.5)


def test_without_std_scaling_advantages_are_reward_minus_group_mean():
    assert group_advantages([1.0, 0.0], std_normalize=False) == [0.5, -0.5]


def test_advantages_are_computed_within_each_prompts_group():
    samples = [sample(0, 1.0), sample(1, 1.0), sample(0, 0.0), sample(1, 1.0)]
    assign_advantages(samples)
    assert samples[0].advantage > 0 > samples[2].advantage
    assert samples[1].advantage == samples[3].advantage == 0.0


def _loss(logp, behaviour, adv, aggregation="token_mean", correction="naive"):
    mask = torch.ones_like(logp)
    return policy_loss(logp, behaviour, torch.tensor(adv), mask, 0.2, aggregation,
                       int(mask.sum()), logp.shape[0], correction=correction)


def test_gradient_raises_log_probs_of_positive_advantage_tokens_and_lowers_negative_ones():
    logp = torch.tensor([[-1.0, -2.0], [-1.5, -0.5]], requires_grad=True)
    _loss(logp, logp.detach(), [1.0, -1.0])["loss"].backward()
    assert (logp.grad[0] < 0).all() and (logp.grad[1] > 0).all()  # descent raises row 0, lowers row 1


def test_fresh_samples_have_unit_importance_weight():
    logp = torch.tensor([[-1.0, -2.0]])
    assert _loss(logp, logp, [1.0])["stats"]["importance_weight_mean"] == pytest.approx(1.0)


def test_decoupled_ppo_reweights_stale_samples_by_current_over_behaviour_probability_capped():
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.0 - 0.5, -1.0 + 10.0]])  # one token more likely now, one far less
    out = _loss(logp, behaviour, [1.0], correction="decoupled")
    out["loss"].backward()
    expected = torch.tensor([torch.exp(torch.tensor(0.5)).item(), torch.exp(torch.tensor(-10.0)).item()])
    assert torch.allclose(-logp.grad[0] * 2, expected, rtol=1e-4)
    huge = _loss(torch.tensor([[0.0]]), torch.tensor([[-50.0]]), [1.0], correction="decoupled")
    assert huge["stats"]["importance_weight_mean"] == pytest.approx(IMPORTANCE_WEIGHT_CAP)


def test_by_default_a_stale_token_that_already_moved_its_advantages_way_past_the_clip_teaches_nothing():
    logp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.1, -1.0 - 0.5, -1.0 + 0.5]])  # ratios e^0.1 (inside), e^0.5 (past 1.2), e^-0.5
    _loss(logp, behaviour, [1.0])["loss"].backward()
    grads = -logp.grad[0] * 3
    assert grads[0] == pytest.approx(torch.exp(torch.tensor(0.1)).item(), rel=1e-4)  # weighted by pi / mu
    assert grads[1] == 0  # already 1.65x likelier than when sampled: the trust region holds it
    assert grads[2] == pytest.approx(torch.exp(torch.tensor(-0.5)).item(), rel=1e-4)  # less likely: still pushed up


def test_sequence_mean_weighs_each_sequence_equally_whatever_its_length():
    logp = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-1.0, 0.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    policy_loss(logp, logp.detach(), torch.tensor([1.0, 1.0]), mask, 0.2, "seq_mean", 5, 2)["loss"].backward()
    assert logp.grad[0, 0].item() == pytest.approx(-1 / 8) and logp.grad[1, 0].item() == pytest.approx(-1 / 2)


def test_with_sequence_mean_the_kl_penalty_also_weighs_each_sequence_equally():
    from bidirl.grpo import k3_kl

    logp = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-1.0, 0.0, 0.0, 0.0]], requires_grad=True)
    ref = logp.detach() - 0.5  # every token: k3 = e^-0.5 + 0.5 - 1
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    per_token = torch.exp(torch.tensor(-0.5)).item() - 0.5
    assert k3_kl(logp, ref, mask, "seq_mean", 5, 2).item() == pytest.approx(per_token)  # each sequence's mean
    k3_kl(logp, ref, mask, "seq_mean", 5, 2).backward()
    assert logp.grad[0, 0].item() == pytest.approx(logp.grad[1, 0].item() / 4)  # a token of the long one: 1/4
    assert k3_kl(logp, ref, mask, "token_mean", 5, 2).item() == pytest.approx(per_token)


def test_naive_ppo_drops_stale_tokens_outside_the_clip_range_where_the_decoupled_correction_weights_them():
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    stale = torch.tensor([[-1.0, -3.0]])  # the second token: its behaviour policy gave it e^-2 the probability
    mask = torch.ones_like(logp)
    naive = policy_loss(logp, stale, torch.tensor([1.0]), mask, 0.2, "token_mean", 2, 1, correction="naive")
    naive["loss"].backward()
    assert logp.grad[0, 1] == 0 and logp.grad[0, 0] != 0  # rho = e^2 is clipped: that token teaches nothing
    assert naive["stats"]["importance_weight_clipped"] == pytest.approx(0.5)
    logp.grad = None
    decoupled = policy_loss(logp, stale, torch.tensor([1.0]), mask, 0.2, "token_mean", 2, 1, correction="decoupled")
    decoupled["loss"].backward()
    assert logp.grad[0, 1] != 0  # weighted by min(e^2, w_max) instead
    assert decoupled["stats"]["importance_weight_clipped"] == pytest.approx(0.5)  # e^2 > 5: cut at the cap


def test_without_a_correction_a_stale_token_teaches_exactly_what_a_fresh_one_would():
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    stale = torch.tensor([[-1.0, -3.0]])
    mask = torch.ones_like(logp)
    none = policy_loss(logp, stale, torch.tensor([1.0]), mask, 0.2, "token_mean", 2, 1, correction="none")
    none["loss"].backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, -0.5]]))  # both tokens: -A / total_tokens
    assert none["stats"]["importance_weight_clipped"] == 0
