"""The off-policy correction for the sampler/trainer gap (grpo_roc.sampler_weights, policy_loss(weights=...),
rl_update.sampler_correction_mode, the mismatch metrics of rl_update.engine_trainer_mismatch): the weights and
the loss's gradient against the equations written out one token at a time, and the paper's loss left exactly
as it is (bitwise) when the engine and the trainer agree or the correction is off."""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # flat modules at the top
import rl_update
import scheduler
from config import Config
from grpo_roc import policy_loss, sampler_weights

CAP, LOW, HIGH = 2.0, 0.5, 2.0


def _batch(seed=0, B=4, T=9):
    """Log-probs of the trainer's update (lp), its pi_old (old), the sampler's (engine) and a loss mask. The
    sampler is off by up to about +-1.2 nats, so that every case occurs: ratios r = pi_old / pi_sampler above the
    cap, inside and outside the band; sequences whose geometric mean leaves the band and sequences that stay."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 3
    old = lp + torch.randn(B, T, generator=g) * 0.4                       # rho = pi / pi_old: both clips active
    engine = old + torch.randn(B, T, generator=g) * 0.6                   # r = pi_old / pi_sampler
    engine[0] = old[0] - 1.0                                              # a sequence with geometric mean e > 2
    engine[1] = old[1] + 0.05 * torch.randn(T, generator=g)               # one well inside the band
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    adv = torch.randn(B, generator=g)
    return lp, old, engine, mask, adv


def _hand_weights(old, engine, mask, mode):
    """The weights written out, one token (or one sequence) at a time, in plain Python floats."""
    B, T = old.shape
    w = [[0.0] * T for _ in range(B)]
    for b in range(B):
        toks = [t for t in range(T) if mask[b, t]]
        logs = [float(old[b, t]) - float(engine[b, t]) for t in toks]        # log r_t = log pi_old - log pi_sampler
        geo = math.exp(sum(logs) / len(logs)) if logs else 1.0              # (prod r_t)^(1 / |seq|)
        for t, log_r in zip(toks, logs):
            r = math.exp(log_r)
            if mode == "tis":
                w[b][t] = min(r, CAP)                                       # w_t = min(r_t, C)
            elif mode == "mask_token":
                w[b][t] = 1.0 if LOW <= r <= HIGH else 0.0                  # keep r_t in [low, high]
            elif mode == "mask_seq":
                w[b][t] = 1.0 if LOW <= geo <= HIGH else 0.0                # keep the sequence if its geo mean is
            else:
                w[b][t] = 1.0
    return w


def _hand_loss(lp, old, adv, mask, w, clip_low=0.2, clip_high=0.28):
    """The paper's loss with the weights, one token at a time: -(1 / N) sum_t w_t min(rho_t A, clip(rho_t) A),
    N = the model tokens whose weight is not 0 (a masked token leaves the mean, as in verl)."""
    total, count = 0.0, 0
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if not mask[b, t] or w[b][t] == 0.0:
                continue
            rho = torch.exp(lp[b, t] - old[b, t])
            total = total - w[b][t] * torch.min(rho * adv[b], torch.clamp(rho, 1 - clip_low, 1 + clip_high) * adv[b])
            count += 1
    return total / max(count, 1)


@pytest.mark.parametrize("mode", ["tis", "mask_token", "mask_seq"])
def test_weights_and_gradient_equal_the_equations_written_out(mode):
    lp, old, engine, mask, adv = _batch()
    w, corrected = sampler_weights(old, engine, mask, mode, cap=CAP, low=LOW, high=HIGH)
    hand = _hand_weights(old, engine, mask, mode)
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[b, t]:
                assert float(w[b, t]) == pytest.approx(hand[b][t], rel=1e-6), (b, t)
    # every case occurs in this batch: some weights changed (truncated or masked), some not
    flagged = [bool(corrected[b, t]) for b in range(lp.shape[0]) for t in range(lp.shape[1]) if mask[b, t]]
    assert any(flagged) and not all(flagged)
    if mode == "mask_seq":
        assert not corrected[1][mask[1]].any() and corrected[0][mask[0]].all()   # one kept, one dropped whole
    lp1, lp2 = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    fast = policy_loss(lp1, old, adv, mask, weights=w)
    slow = _hand_loss(lp2, old, adv, mask, hand)
    fast.backward()
    slow.backward()
    assert fast.item() == pytest.approx(slow.item(), abs=1e-6)
    assert torch.allclose(lp1.grad, lp2.grad, atol=1e-7)


def test_truncated_and_masked_tokens_are_flagged():
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    engine = torch.log(torch.tensor([[1.0, 0.25, 0.8, 3.0]]))   # r = 1, 4, 1.25, 1/3
    mask = torch.tensor([[1, 1, 1, 0]])                         # the last one is not a model token
    w, c = sampler_weights(old, engine, mask, "tis", cap=2.0)
    assert torch.allclose(w[0, :3], torch.tensor([1.0, 2.0, 1.25])) and c[0].tolist() == [False, True, False, False]
    w, c = sampler_weights(old, engine, mask, "mask_token", low=0.5, high=2.0)
    assert w[0, :3].tolist() == [1.0, 0.0, 1.0] and c[0].tolist() == [False, True, False, False]
    # geometric mean (1 * 4 * 1.25)^(1/3) = 1.71 is inside [0.5, 2]; inside [0.5, 1.5] it is not
    w, c = sampler_weights(old, engine, mask, "mask_seq", low=0.5, high=2.0)
    assert w[0, :3].tolist() == [1.0, 1.0, 1.0] and not c.any()
    w, c = sampler_weights(old, engine, mask, "mask_seq", low=0.5, high=1.5)
    assert w[0, :3].tolist() == [0.0, 0.0, 0.0] and c[0].tolist() == [True, True, True, False]
    with pytest.raises(ValueError, match="mode"):
        sampler_weights(old, engine, mask, "auto")
    with pytest.raises(ValueError, match="cap"):
        sampler_weights(old, engine, mask, "tis", cap=0.9)     # identical log-probs must keep weight 1
    with pytest.raises(ValueError, match="band"):
        sampler_weights(old, engine, mask, "mask_token", low=1.1, high=2.0)


@pytest.mark.parametrize("mode", ["off", "tis", "mask_token", "mask_seq"])
def test_engine_equal_to_trainer_leaves_the_papers_loss_bitwise(mode):
    lp, old, _, mask, adv = _batch(1)
    w, corrected = sampler_weights(old, old.clone(), mask, mode, cap=CAP, low=LOW, high=HIGH)
    assert not corrected.any() and torch.equal(w[mask], torch.ones(int(mask.sum())))
    lp1, lp2 = lp.clone().requires_grad_(), lp.clone().requires_grad_()
    with_w, st1 = policy_loss(lp1, old, adv, mask, weights=w, return_stats=True)
    paper, st2 = policy_loss(lp2, old, adv, mask, return_stats=True)
    with_w.backward()
    paper.backward()
    assert torch.equal(with_w, paper) and torch.equal(lp1.grad, lp2.grad) and st1 == st2


def test_off_is_todays_loss():
    """weights=None is the code path of today's loss: the paper's equation (tests/test_grpo_roc.py), unchanged."""
    lp, old, _, mask, adv = _batch(2)
    lp1 = lp.clone().requires_grad_()
    loss = policy_loss(lp1, old, adv, mask)
    loss.backward()
    lp2 = lp.clone().requires_grad_()
    ones = [[1.0] * lp.shape[1] for _ in range(lp.shape[0])]
    hand = _hand_loss(lp2, old, adv, mask, ones)
    hand.backward()
    assert loss.item() == pytest.approx(hand.item(), abs=1e-6) and torch.allclose(lp1.grad, lp2.grad, atol=1e-7)


def test_masked_tokens_leave_the_mean_and_junk_under_them_is_harmless():
    lp = torch.zeros(1, 3, requires_grad=True)
    old = torch.zeros(1, 3)
    w = torch.tensor([[1.0, 0.0, 1.0]])
    adv = torch.tensor([1.0])
    loss = policy_loss(lp, old, adv, torch.ones(1, 3), weights=w)
    loss.backward()
    assert loss.item() == pytest.approx(-1.0) and lp.grad[0].tolist() == pytest.approx([-0.5, 0.0, -0.5])
    # all masked: zero loss, not 0 / 0
    assert policy_loss(lp, old, adv, torch.ones(1, 3), weights=torch.zeros(1, 3)).item() == 0.0
    with pytest.raises(ValueError, match="weights"):
        policy_loss(lp, old, adv, torch.ones(1, 3), weights=torch.ones(1, 2))


def test_auto_is_on_where_the_engine_differs_from_the_trainer():
    assert rl_update.sampler_correction_mode(Config(precision="fp32"), "cpu") == "off"     # the same fp32 code
    assert rl_update.sampler_correction_mode(Config(precision="bf16"), "cpu") == "tis"     # bf16 engine copy
    assert rl_update.sampler_correction_mode(Config(precision="fp32", engine="vllm"), "cpu") == "tis"
    assert rl_update.sampler_correction_mode(Config(precision="fp32"), "cuda") == "tis"    # vLLM / bf16 on GPU
    for mode in ("off", "tis", "mask_token", "mask_seq"):
        assert rl_update.sampler_correction_mode(Config(sampler_correction=mode, precision="bf16"), "cpu") == mode
    with pytest.raises(ValueError, match="sampler_correction"):
        rl_update.sampler_correction_mode(Config(sampler_correction="is"), "cpu")
    assert Config().sampler_correction == "auto" and Config().sampler_cap == 2.0


def test_mismatch_metrics_by_hand():
    """k3 = mean over model tokens of r - 1 - log r, r = pi_old / pi_sampler; ESS = (sum w)^2 / (N sum w^2)."""
    t = scheduler.Trajectory("p", [1, 2, 3], [scheduler.Segment([4, 5], 1, [-1.0, -2.0]), scheduler.Segment([6], 0),
                                               scheduler.Segment([7], 1, [-0.5])])
    old = torch.tensor([0.0, -9.0, -9.0, -1.25, -2.0, -9.0, 0.0])    # log r = -0.25, 0, +0.5 on the model tokens
    mask = t.loss_mask
    r = [math.exp(-0.25), 1.0, math.exp(0.5)]
    out = rl_update.engine_trainer_mismatch([t], [old], [mask])
    assert out["mismatch_k3"] == pytest.approx(sum(x - 1 - math.log(x) for x in r) / 3, rel=1e-6)
    assert out["mismatch_ess"] == pytest.approx(sum(r) ** 2 / (3 * sum(x * x for x in r)), rel=1e-6)
    assert out["is_ess"] is None and out["is_corrected_frac"] is None       # no correction applied
    # with the tis weights at cap 1.5: min(r, 1.5) truncates the last token (r = 1.65)
    engine = rl_update.engine_logprobs_at(t, old, mask)
    w, c = sampler_weights(old[None], engine[None], torch.tensor([mask]), "tis", cap=1.5)
    out = rl_update.engine_trainer_mismatch([t], [old], [mask], [w[0]], [c[0]])
    ws = [r[0], 1.0, 1.5]
    assert out["is_ess"] == pytest.approx(sum(ws) ** 2 / (3 * sum(x * x for x in ws)), rel=1e-6)
    assert out["is_corrected_frac"] == pytest.approx(1 / 3)
    assert out["logprob_diff_mean"] == pytest.approx(0.75 / 3)
