"""Tests for grpo_roc.py: every function against values computed by hand from the paper's equations
(arXiv 2508.20722, sections 2.2 and 2.2.3), RoC's sampling statistics over many seeds, and the loss's value and
gradient against a naive per-token loop."""

import itertools
import math
import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # flat modules at the top
from grpo_roc import (ADV_EPS, ROC_EPS, drop_uninformative, group_advantages, policy_loss, roc_downsample,
                      roc_penalty)


# ---------------------------------------------------------------------------------------------------------------
# roc_penalty: p_total = p_err + p_format

@pytest.mark.parametrize("calls, errors, tags, turns, expected", [
    (0, 0, 1, 1, 0.5),    # no tool call: p_err = 0.5; one answer: p_format = 0
    (1, 0, 1, 2, 0.0),    # clean: one good call, one answer
    (4, 1, 1, 5, 0.25),   # 1 of 4 calls failed
    (3, 3, 0, 4, 2.0),    # every call failed and no answer: the maximum
    (2, 0, 3, 4, 0.5),    # (3 - 1) / 4 = 0.5
    (2, 1, 5, 3, 1.5),    # 0.5 + min(1, 4 / 3)
    (0, 0, 0, 0, 1.5),    # no call, no answer, no turn: 0.5 + 1
    (5, 2, 2, 10, 0.5),   # 2/5 + 1/10
])
def test_roc_penalty_hand_values(calls, errors, tags, turns, expected):
    assert roc_penalty(calls, errors, tags, turns) == pytest.approx(expected, abs=1e-12)


def test_roc_penalty_matches_the_equation_on_a_grid():
    # every small count: p_total = p_err + p_format written out as the paper states it
    for calls in range(5):
        for errors in range(calls + 1):
            for tags in range(5):
                for turns in range(1 if tags else 0, 7):
                    p_err = 0.5 if calls == 0 else errors / calls
                    p_format = 1.0 if tags == 0 else min(1.0, (tags - 1) / turns)
                    got = roc_penalty(calls, errors, tags, turns)
                    assert got == pytest.approx(p_err + p_format, abs=1e-12), (calls, errors, tags, turns)
                    assert 0.0 <= got <= 2.0


@pytest.mark.parametrize("args, fragment", [
    ((-1, 0, 1, 1), "tool_calls"),
    ((1, -1, 1, 1), "tool_errors"),
    ((1, 0, -1, 1), "answer_tags"),
    ((1, 0, 1, -1), "turns"),
    ((2, 3, 1, 1), "cannot exceed"),
    ((1, 0, 1, 0), "0 turns"),
])
def test_roc_penalty_rejects_bad_counts(args, fragment):
    with pytest.raises(ValueError, match=fragment):
        roc_penalty(*args)


# ---------------------------------------------------------------------------------------------------------------
# roc_downsample: counts, edge cases, modes

@pytest.mark.parametrize("mode", ["roc", "topk"])
def test_downsample_exact_counts_for_every_split_of_2g(mode):
    # 2G = 32 -> G = 16: floor(n_neg / 2) negatives and ceil(n_pos / 2) positives, for every n_pos.
    rng = random.Random(0)
    for n_pos in range(33):
        rewards = [1.0] * n_pos + [0.0] * (32 - n_pos)
        penalties = [rng.choice([0.0, 0.25, 0.5, 1.0, 1.5, 2.0]) for _ in range(32)]
        kept = roc_downsample(rewards, penalties, 16, rng, mode=mode)
        assert len(kept) == 16 and kept == sorted(set(kept))
        assert sum(rewards[i] > 0 for i in kept) == math.ceil(n_pos / 2)
        assert sum(rewards[i] == 0 for i in kept) == (32 - n_pos) // 2


def test_downsample_general_keep_and_fill():
    rng = random.Random(1)
    # n = 5, keep = 3: negatives floor(4 * 3 / 5) = 2, the one positive fills the last slot
    kept = roc_downsample([0, 0, 0, 0, 1], [0] * 5, 3, rng)
    assert len(kept) == 3 and 4 in kept
    # no positives: negatives fill every slot; no negatives: positives fill every slot
    assert len(roc_downsample([0] * 5, [0] * 5, 3, rng)) == 3
    assert len(roc_downsample([1] * 5, [0.5] * 5, 3, rng)) == 3
    # keep >= len: everything, in order; keep = 0: nothing
    assert roc_downsample([1, 0, 1], [0, 0, 0], 3, rng) == [0, 1, 2]
    assert roc_downsample([1, 0, 1], [0, 0, 0], 10, rng) == [0, 1, 2]
    assert roc_downsample([1, 0, 1], [0, 0, 0], 0, rng) == []
    assert roc_downsample([], [], 4, rng) == []


def test_downsample_validation():
    rng = random.Random(0)
    with pytest.raises(ValueError, match="roc.*topk.*none"):
        roc_downsample([1, 0], [0, 0], 1, rng, mode="best")
    with pytest.raises(ValueError, match="penalties"):
        roc_downsample([1, 0], [0], 1, rng)
    with pytest.raises(ValueError, match="keep"):
        roc_downsample([1, 0], [0, 0], -1, rng)
    with pytest.raises(ValueError, match="finite"):
        roc_downsample([1, 0], [-0.5, 0], 1, rng)
    with pytest.raises(ValueError, match="finite"):
        roc_downsample([1, 0], [float("nan"), 0], 1, rng)
    with pytest.raises(ValueError, match="rewards must be finite"):
        roc_downsample([float("nan"), 0], [0, 0], 1, rng)


def test_downsample_is_reproducible_from_the_rng():
    rewards = [1, 0] * 16
    penalties = [(i % 5) / 2 for i in range(32)]
    for mode in ("roc", "topk", "none"):
        a = roc_downsample(rewards, penalties, 16, random.Random(7), mode=mode)
        b = roc_downsample(rewards, penalties, 16, random.Random(7), mode=mode)
        assert a == b


def test_topk_keeps_lowest_penalty_positives_and_breaks_ties_at_random():
    rewards = [1, 1, 1, 1, 0, 0, 0, 0]
    penalties = [2.0, 0.5, 1.0, 0.25, 0, 0, 0, 0]   # 4 positives, keep 2: indices 3 (0.25) and 1 (0.5)
    for seed in range(50):
        kept = roc_downsample(rewards, penalties, 4, random.Random(seed), mode="topk")
        assert [i for i in kept if rewards[i]] == [1, 3]
    # all positives tie: every one of them gets kept sometimes (the released code would always keep 0 and 1)
    seen = set()
    for seed in range(200):
        kept = roc_downsample(rewards, [1.0] * 8, 4, random.Random(seed), mode="topk")
        seen.update(i for i in kept if rewards[i])
    assert seen == {0, 1, 2, 3}


def test_zero_penalty_positives_come_first():
    # 8 positives, 8 negatives, keep 8: 4 negatives, 4 positives; the three zero-penalty positives
    # (weight 1 / eps = 1e6) are always among them, the fourth comes from the penalised ones.
    rewards = [1] * 8 + [0] * 8
    penalties = [0.5, 0.0, 1.0, 0.0, 1.5, 2.0, 0.0, 1.0] + [0.0] * 8
    for seed in range(300):
        kept = roc_downsample(rewards, penalties, 8, random.Random(seed))
        assert {1, 3, 6} <= set(kept)


def _inclusion_probabilities(weights, k):
    """Exact P(i is kept) for drawing k of len(weights) without replacement, each draw with P proportional to w
    among those left: the sum over every ordered sequence of draws."""
    p = [0.0] * len(weights)
    for seq in itertools.permutations(range(len(weights)), k):
        prob, left = 1.0, sum(weights)
        for i in seq:
            prob *= weights[i] / left
            left -= weights[i]
        for i in seq:
            p[i] += prob
    return p


def test_roc_statistics_match_inverse_penalty_weighting_and_uniform_negatives():
    # 4 positives with penalties 0.25, 0.5, 1, 2 (weights 4 : 2 : 1 : 0.5) and 4 negatives; 8 -> 4 keeps
    # 2 of each. Positives: hand-derived successive-sampling probabilities. Negatives: each kept half the time.
    rewards = [1, 1, 1, 1, 0, 0, 0, 0]
    penalties = [0.25, 0.5, 1.0, 2.0, 2.0, 0.0, 1.0, 0.5]   # negatives' penalties must not matter
    weights = [1 / (p + ROC_EPS) for p in penalties[:4]]
    expected = _inclusion_probabilities(weights, 2)
    # by hand for the cleanest (W = 7.5): 4/7.5 + (2/7.5)(4/5.5) + (1/7.5)(4/6.5) + (0.5/7.5)(4/7) = 0.8474
    assert expected[0] == pytest.approx(0.8474, abs=1e-4)
    trials = 20000
    counts = [0] * 8
    for seed in range(trials):
        for i in roc_downsample(rewards, penalties, 4, random.Random(seed)):
            counts[i] += 1
    freq = [c / trials for c in counts]
    for i in range(4):   # sd of each frequency <= sqrt(0.25 / 20000) = 0.0035
        assert freq[i] == pytest.approx(expected[i], abs=0.015), (i, freq, expected)
    assert freq[0] > freq[1] > freq[2] > freq[3]
    # negatives: floor(4 / 2) = 2 of the 4 kept uniformly, so each half the time, whatever its penalty
    for i in range(4, 8):
        assert freq[i] == pytest.approx(0.5, abs=0.015), (i, freq)


def test_roc_first_pick_ratio_is_the_inverse_penalty_ratio():
    # One positive slot between penalties 0.5 and 1.5: P = (1/0.5) / (1/0.5 + 1/1.5) = 0.75, i.e. 3 : 1.
    rewards, penalties = [0, 1, 0, 1], [0.0, 0.5, 0.0, 1.5]
    trials = 20000
    clean = sum(1 in roc_downsample(rewards, penalties, 2, random.Random(s)) for s in range(trials))
    assert clean / trials == pytest.approx(0.75, abs=0.015)


def test_mode_none_is_a_uniform_subset_blind_to_rewards():
    rewards = [1] * 30 + [0] * 2
    penalties = [0.0] * 15 + [2.0] * 15 + [0.0] * 2
    trials = 4000
    counts = [0] * 32
    negs_kept = set()
    for seed in range(trials):
        kept = roc_downsample(rewards, penalties, 16, random.Random(seed), mode="none")
        assert len(kept) == 16 and kept == sorted(set(kept))
        negs_kept.add(sum(rewards[i] == 0 for i in kept))
        for i in kept:
            counts[i] += 1
    assert all(c / trials == pytest.approx(0.5, abs=0.04) for c in counts)   # clean and dirty alike
    assert negs_kept == {0, 1, 2}   # not the fixed floor(2 / 2) = 1 of RoC


def test_drop_uninformative():
    assert drop_uninformative([[1, 1, 1], [0, 0], [0, 1, 1], [], [1], [0.0, 0.5]]) == \
        [False, False, True, False, False, True]


def test_drop_uninformative_over_random_groups():
    # the rule: keep a group exactly when it holds two different rewards
    rng = random.Random(3)
    for _ in range(500):
        group = [rng.choice([0.0, 1.0, 0.5]) for _ in range(rng.randint(0, 6))]
        assert drop_uninformative([group]) == [len(set(group)) > 1], group
    groups = [[rng.randint(0, 1) for _ in range(rng.randint(1, 5))] for _ in range(50)]
    assert drop_uninformative(groups) == [len(set(g)) > 1 for g in groups]   # one flag per group, in order


# ---------------------------------------------------------------------------------------------------------------
# group_advantages: A_i = (r_i - mean) / (population std + eps)

def test_group_advantages_hand_values():
    # [1, 0, 0, 0]: mean 0.25, std sqrt(0.25 * 0.75) = sqrt(3) / 4; A = [sqrt(3), -1 / sqrt(3) x 3]
    a = group_advantages([1, 0, 0, 0])
    assert a.dtype == torch.float32 and a.shape == (4,)
    assert torch.allclose(a, torch.tensor([math.sqrt(3)] + [-1 / math.sqrt(3)] * 3), rtol=1e-5)
    # [0, 1] -> [-1, 1] (population std 0.5, not the sample std 0.707 that would give -0.707, 0.707)
    assert torch.allclose(group_advantages([0, 1]), torch.tensor([-1.0, 1.0]), rtol=1e-5)
    # 16 kept, 4 correct: mean 0.25, same std: correct ones get sqrt(3), wrong ones -1 / sqrt(3)
    a = group_advantages([1] * 4 + [0] * 12)
    assert a[0].item() == pytest.approx(math.sqrt(3), rel=1e-5)
    assert a.sum().item() == pytest.approx(0.0, abs=1e-5)
    assert (a ** 2).mean().item() == pytest.approx(1.0, rel=1e-5)


def test_group_advantages_match_the_formula_over_random_groups():
    # A_i = (r_i - mean) / (pstdev + 1e-6), computed with the statistics module, over many random groups
    import statistics
    rng = random.Random(5)
    for _ in range(300):
        g = rng.randint(2, 32)
        rewards = [rng.choice([0.0, 1.0]) if rng.random() < 0.7 else rng.uniform(-1, 2) for _ in range(g)]
        if len(set(rewards)) == 1:
            continue
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        expected = torch.tensor([(r - mean) / (std + ADV_EPS) for r in rewards])
        got = group_advantages(rewards)
        assert got.dtype == torch.float32 and got.shape == (g,)
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), rewards
        assert got.sum().item() == pytest.approx(0.0, abs=1e-4)


def test_group_advantages_never_nan():
    for rewards in ([1, 1, 1], [0, 0, 0, 0], [0.3] * 7, [1], [0]):
        a = group_advantages(rewards)
        assert torch.equal(a, torch.zeros(len(rewards)))
    assert group_advantages([]).shape == (0,)
    a = group_advantages([1e-9, 0, 0])   # tiny but real spread: finite
    assert torch.isfinite(a).all()
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1, float("nan")])


# ---------------------------------------------------------------------------------------------------------------
# policy_loss: -(1/N) sum min(rho A, clip(rho, 0.8, 1.28) A)

def _hand_batch(adv):
    old = torch.zeros(1, 3)
    logprobs = torch.log(torch.tensor([[1.0, 1.5, 0.5]])).requires_grad_()   # rho = 1, 1.5, 0.5
    return logprobs, old, torch.tensor([adv]), torch.ones(1, 3)


def test_policy_loss_hand_values_positive_advantage():
    logprobs, old, adv, mask = _hand_batch(1.0)
    loss, stats = policy_loss(logprobs, old, adv, mask, return_stats=True)
    # min(1, 1) + min(1.5, 1.28) + min(0.5, 0.8) = 2.78 -> loss -2.78 / 3
    assert loss.item() == pytest.approx(-2.78 / 3, abs=1e-6)
    loss.backward()
    # d/dlogp of -rho A / 3 is -rho / 3, except where clipped (rho = 1.5 > 1.28: zero gradient)
    assert torch.allclose(logprobs.grad, torch.tensor([[-1 / 3, 0.0, -0.5 / 3]]), atol=1e-6)
    assert stats["clip_frac"] == pytest.approx(1 / 3) and stats["clip_frac_high"] == pytest.approx(1 / 3)
    assert stats["clip_frac_low"] == 0.0
    assert stats["ratio_mean"] == pytest.approx(1.0) and stats["ratio_max"] == pytest.approx(1.5)
    # k3: mean(rho - 1 - log rho) = (0 + 0.5 - ln 1.5 - 0.5 - ln 0.5) / 3
    assert stats["approx_kl"] == pytest.approx((0.5 - math.log(1.5) - 0.5 - math.log(0.5)) / 3, rel=1e-5)
    assert stats["num_tokens"] == 3


def test_policy_loss_hand_values_negative_advantage():
    logprobs, old, adv, mask = _hand_batch(-1.0)
    loss, stats = policy_loss(logprobs, old, adv, mask, return_stats=True)
    # min(-1, -1) + min(-1.5, -1.28) + min(-0.5, -0.8) = -3.3 -> loss 3.3 / 3
    assert loss.item() == pytest.approx(1.1, abs=1e-6)
    loss.backward()
    # rho = 1.5 is not clipped for A < 0 (the min keeps -1.5); rho = 0.5 < 0.8 is (the min keeps -0.8)
    assert torch.allclose(logprobs.grad, torch.tensor([[1 / 3, 0.5, 0.0]]), atol=1e-6)
    assert stats["clip_frac"] == pytest.approx(1 / 3) and stats["clip_frac_low"] == pytest.approx(1 / 3)
    assert stats["clip_frac_high"] == 0.0


def test_policy_loss_clip_range_is_configurable():
    logprobs, old, adv, mask = _hand_batch(1.0)
    # symmetric 0.2 clip: min(1.5, 1.2) -> (1 + 1.2 + 0.5) / 3
    loss = policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(-2.7 / 3, abs=1e-6)


def _naive_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28):
    """The equation, one token at a time."""
    total, count = 0.0, 0
    for b in range(logprobs.shape[0]):
        for t in range(logprobs.shape[1]):
            if not mask[b, t]:
                continue
            a = adv[b] if adv.dim() == 1 else adv[b, t]
            rho = torch.exp(logprobs[b, t] - old[b, t])
            total = total - torch.min(rho * a, torch.clamp(rho, 1 - clip_low, 1 + clip_high) * a)
            count += 1
    return total / count


@pytest.mark.parametrize("per_token_adv", [False, True])
def test_policy_loss_matches_naive_loop_value_and_gradient(per_token_adv):
    g = torch.Generator().manual_seed(0)
    B, T = 4, 9
    base = -torch.rand(B, T, generator=g) * 3
    old = base + torch.randn(B, T, generator=g) * 0.4   # ratios from about 0.3 to 3: both clips active
    mask = torch.rand(B, T, generator=g) > 0.3
    adv = torch.randn(B, T, generator=g) if per_token_adv else torch.randn(B, generator=g)
    lp1 = base.clone().requires_grad_()
    lp2 = base.clone().requires_grad_()
    fast, stats = policy_loss(lp1, old, adv, mask, return_stats=True)
    slow = _naive_loss(lp2, old, adv, mask)
    fast.backward()
    slow.backward()
    # value and gradient are the equation's, one token at a time: the mean over every masked token of the
    # batch (not a mean of per-sequence means), clipped to [0.8, 1.28]
    assert fast.item() == pytest.approx(slow.item(), abs=1e-6)
    assert torch.allclose(lp1.grad, lp2.grad, atol=1e-7)
    assert 0 < stats["clip_frac"] < 1
    assert stats["num_tokens"] == int(mask.sum())


def test_masked_tokens_get_zero_gradient_even_with_nan_and_inf():
    g = torch.Generator().manual_seed(1)
    B, T = 3, 6
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 0], [1, 0, 1, 0, 1, 0]], dtype=torch.bool)
    base = -torch.rand(B, T, generator=g)
    old = base + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    dirty_old, dirty_adv, dirty_lp = old.clone(), adv.clone(), base.clone()
    dirty_old[~mask] = torch.tensor([float("nan"), float("inf"), -float("inf")]).repeat(3)[: int((~mask).sum())]
    dirty_adv[~mask] = float("nan")
    dirty_lp[0, 5] = -float("inf")   # e.g. padding
    lp = dirty_lp.requires_grad_()
    loss = policy_loss(lp, dirty_old, dirty_adv, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert torch.equal(lp.grad[~mask], torch.zeros(int((~mask).sum())))
    assert (lp.grad[mask] != 0).any()
    # and the value is the one without any junk in the masked positions
    clean = policy_loss(base.clone().requires_grad_(), old, adv, mask)
    assert loss.item() == pytest.approx(clean.item(), abs=1e-7)


def test_num_tokens_makes_micro_batches_add_up_to_the_batch_token_mean():
    g = torch.Generator().manual_seed(2)
    B, T = 6, 8
    base = -torch.rand(B, T, generator=g) * 2
    old = base + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    lengths = torch.tensor([8, 1, 2, 7, 3, 5])   # uneven lengths: a mean of micro-batch means would differ
    mask = torch.arange(T)[None, :] < lengths[:, None]
    full_lp = base.clone().requires_grad_()
    full = policy_loss(full_lp, old, adv, mask)
    full.backward()
    acc_lp = base.clone().requires_grad_()
    n = int(mask.sum())
    total = 0.0
    for rows in (slice(0, 2), slice(2, 4), slice(4, 6)):
        part = policy_loss(acc_lp[rows], old[rows], adv[rows], mask[rows], num_tokens=n)
        part.backward()
        total += part.item()
    assert total == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(acc_lp.grad, full_lp.grad, atol=1e-7)
    with pytest.raises(ValueError, match="num_tokens"):
        policy_loss(full_lp, old, adv, mask, num_tokens=0)


def test_policy_loss_no_kl_no_entropy_and_edge_cases():
    # On-policy (rho = 1): the loss is exactly -mean over tokens of A, nothing else added.
    lp = torch.full((2, 3), -1.0, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    loss = policy_loss(lp, lp.detach(), torch.tensor([0.5, -2.0]), mask)
    assert loss.item() == pytest.approx(-(3 * 0.5 - 2.0) / 4, abs=1e-7)
    # all masked: zero loss, zero gradient, no NaN
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, stats = policy_loss(lp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3), return_stats=True)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(lp.grad, torch.zeros(2, 3)) and stats["num_tokens"] == 0
    # shapes
    with pytest.raises(ValueError, match="same"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))


def test_policy_loss_accepts_bf16_logprobs():
    lp = torch.log(torch.tensor([[1.0, 1.5, 0.5]])).to(torch.bfloat16).requires_grad_()
    loss = policy_loss(lp, torch.zeros(1, 3, dtype=torch.bfloat16), torch.tensor([1.0]), torch.ones(1, 3))
    loss.backward()
    assert loss.dtype == torch.float32 and lp.grad.dtype == torch.bfloat16
    assert loss.item() == pytest.approx(-2.78 / 3, abs=1e-2)
