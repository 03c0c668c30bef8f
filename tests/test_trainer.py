"""The RL trainer (rstar2_mini.py): exact log-probs with the shared prompt, checkpoints, a full RL step with real
tool calls, exact resume, a learning test (the real loss raises reward; the flipped sign does not), and the
command line's errors for people."""
import copy
import dataclasses
import json
import math
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import curriculum
import distributed
import model as models
import rstar2_mini as R
import scheduler
import tasks

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------------------
# log-probs with the shared prefix == a plain full forward, values and gradients


def oracle_logprobs(m, seq: list[int], temperature: float = 1.0):
    """The plain computation: one trajectory alone, one full forward, no prefix sharing, no padding.
    Returns [len(seq)]: entry t is log_softmax(logits / T) at t - 1 of token seq[t]; entry 0 is 0."""
    full = torch.log_softmax(m(input_ids=torch.tensor([seq])).logits[0].float() / temperature, -1)
    return torch.cat([torch.zeros(1), full[:-1].gather(-1, torch.tensor(seq[1:]).unsqueeze(-1)).squeeze(-1)])


def random_trajectories(tokenizer, rng: random.Random, n: int, one_problem: bool = False) -> list:
    """Trajectories shaped like real ones: two problems (the same system prompt, different questions), and a
    short prompt of 30 tokens; responses that often begin alike ("<reason> I will", as after SFT); tool
    responses (mask 0) between model turns; lengths from 1 token on. one_problem: the 2G rollouts of one
    problem, nearly all beginning alike (where a shared prefix is most tempted to swallow model tokens)."""
    prompts = [scheduler.render_prompt(tokenizer, "What is 2+3?"), scheduler.render_prompt(tokenizer, "Compute 7*8.")]
    prompts.append(prompts[0][:30])
    if one_problem:
        prompts = prompts[:1]
    common = scheduler.encode(tokenizer, "<reason> I will")
    trajs = []
    for i in range(n):
        words = lambda k: [rng.randrange(100, 5000) for _ in range(k)]  # noqa: E731
        first = (common if rng.random() < (0.9 if one_problem else 0.6) else []) + words(rng.randint(1, 10))
        segments = [scheduler.Segment(first, 1)]
        for _ in range(rng.randint(0, 2)):
            segments += [scheduler.Segment(words(rng.randint(1, 8)), 0), scheduler.Segment(words(rng.randint(1, 9)), 1)]
        trajs.append(scheduler.Trajectory(f"p{i}", list(rng.choice(prompts)), segments))
    return trajs


def test_token_logprobs_equal_one_trajectory_alone_for_any_packing(tokenizer):
    """The oracle: for random packings (one row alone, rows sharing a response start, rows with a short prompt),
    every model token's log-prob equals a full forward of its trajectory alone, and every other position is 0."""
    m = models.tiny_model(tokenizer, seed=1)
    rng = random.Random(0)
    trajs = random_trajectories(tokenizer, rng, 12)
    with torch.no_grad():
        for trial in range(10):
            rows = rng.sample(trajs, rng.choice([1, 1, 2, 3, 5]))
            if trial == 0:  # two rows that share the whole first model turn
                rows = [trajs[0], scheduler.Trajectory("twin", trajs[0].prompt_ids, trajs[0].segments[:1] +
                                                       [scheduler.Segment([7, 8, 9], 1)])]
            temperature, share = rng.choice([1.0, 0.7]), rng.choice([True, True, False])
            seqs, masks = [t.input_ids for t in rows], [t.loss_mask for t in rows]
            logp = R.token_logprobs(m, seqs, temperature, share_prefix=share, masks=masks)
            assert logp.shape == (len(rows), max(map(len, seqs)))
            for b, (s, mask) in enumerate(zip(seqs, masks)):
                want = torch.tensor(mask, dtype=torch.bool)
                ref = oracle_logprobs(m, s, temperature)
                assert torch.allclose(logp[b, :len(s)][want], ref[want], atol=1e-5), (trial, b)
                assert torch.all(logp[b, :len(s)][~want] == 0) and torch.all(logp[b, len(s):] == 0)
                assert torch.all(ref[want] < 0)  # a real log-prob at every model token: none is missing


def test_token_logprobs_equal_full_forward_with_gradients(tokenizer):
    """Without masks every real token but the first gets its log-prob, gradients included."""
    m = models.tiny_model(tokenizer, seed=1)
    prompt = scheduler.render_prompt(tokenizer, "What is 2+3?")[:40]
    seqs = [prompt + [11, 12, 13, 14], prompt + [21, 22], prompt[:30] + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    logp = R.token_logprobs(m, seqs)
    logp.sum().backward()
    fast_grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    ref_total = 0.0
    for b, s in enumerate(seqs):
        ref = oracle_logprobs(m, s)
        assert torch.allclose(logp[b, :len(s)], ref, atol=1e-5)
        assert torch.all(logp[b, len(s):] == 0)  # padding contributes nothing
        ref_total = ref_total + ref.sum()
    ref_total.backward()
    for g_fast, p in zip(fast_grads, m.parameters()):
        assert torch.allclose(g_fast, p.grad, atol=1e-5)


def test_token_logprobs_with_loss_masks_compute_only_model_tokens(tokenizer):
    """masks=: log-probs (and gradients) of the model tokens equal the plain forward's; the rest are zero."""
    m = models.tiny_model(tokenizer, seed=3)
    prompt = scheduler.render_prompt(tokenizer, "What is 2+3?")[:40]
    seqs = [prompt + [11, 12, 13, 14, 15, 16], prompt + [21, 22, 23], prompt[:35] + [5, 6, 7, 8, 9, 10, 11]]
    masks = [[0] * 40 + [1, 1, 0, 0, 1, 1], [0] * 40 + [1, 0, 1], [0] * 35 + [1, 1, 1, 0, 0, 1, 1]]
    for share in (True, False):
        m.zero_grad()
        logp = R.token_logprobs(m, seqs, temperature=0.7, share_prefix=share, masks=masks)
        logp.sum().backward()
        fast_grads = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        ref_total = 0.0
        for b, (s, mask) in enumerate(zip(seqs, masks)):
            ref = oracle_logprobs(m, s, 0.7) * torch.tensor(mask, dtype=torch.float32)
            assert torch.allclose(logp[b, :len(s)], ref, atol=1e-5)
            assert torch.all(logp[b, len(s):] == 0)
            ref_total = ref_total + ref.sum()
        ref_total.backward()
        for g_fast, p in zip(fast_grads, m.parameters()):
            assert torch.allclose(g_fast, p.grad, atol=1e-5)


# The invariants that compare against an fp32 oracle (its gradient, the engine's log-probs, a resumed run's
# numbers) run in fp32 whatever the host: precision="auto" would pick bf16 autocast on a CPU with AVX512-BF16 or
# AMX units, and bf16 rounding is not what they test. Ratio 1 at lr = 0 holds in both precisions (below).
PRECISION = "fp32"


def lr0_update(tokenizer, kept, **cfg_kw):
    """policy_update on the tiny model with lr = 0 (the weights cannot change): (its numbers, the model)."""
    m = models.tiny_model(tokenizer, seed=5)
    cfg = R.Config(lr=0.0, warmup_steps=1, grad_clip=1e9, **{"precision": PRECISION, **cfg_kw})
    optimizer, schedule = R.make_optimizer(m, cfg)
    rt = R.Runtime(m, tokenizer, engines=[], pool=None, loop=None)
    return R.policy_update(rt, cfg, optimizer, schedule, kept, random.Random(1)), m


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_policy_update_with_lr_0_has_ratio_1_and_trains_every_model_token(tokenizer, precision):
    """The reviewer's first check: with lr = 0 pi_new = pi_old, so every ratio is 1 and nothing is clipped,
    whatever the packing (one-row micro-batches, several mini-batches), and every model token enters the loss.
    Also under bf16 autocast (the default where the CPU has bf16 units): the pi_old pass forwards the very
    micro-batches the update forwards, so bf16 rounds both alike."""
    rng = random.Random(2)
    settings = [(2, 4096, False), (2, 1, False), (1, 1, False), (1, 4096, False), (3, 900, False), (2, 1000, True),
                (1, 1500, True), (2, 4096, True)]
    for trial, (minibatches, micro, one_problem) in enumerate(settings):
        trajs = random_trajectories(tokenizer, rng, 7, one_problem)
        kept = [(t, rng.choice([-1.2, -0.5, 0.4, 1.1])) for t in trajs]
        out, _ = lr0_update(tokenizer, kept, minibatches=minibatches, micro_batch_tokens=micro,
                            temperature=rng.choice([1.0, 0.7]), precision=precision)
        assert out["clip_frac"] == 0.0, (trial, out)
        assert abs(out["ratio_min"] - 1) < 1e-6 and abs(out["ratio_max"] - 1) < 1e-6, (trial, out)
        assert out["loss_tokens"] == sum(sum(t.loss_mask) for t in trajs), trial


def test_policy_update_gradient_equals_the_papers_loss_on_the_oracles_logprobs(tokenizer):
    """The gradient left by policy_update (one mini-batch, micro-batches of one row each and of all rows) equals
    the gradient of the paper's loss written out on each trajectory's own full forward:
    L = -(1/N) sum_i sum_{t: mask} min(rho A_i, clip(rho) A_i), rho = pi / pi_old = 1 here, so
    grad L = -(1/N) sum_i A_i sum_{t: mask} grad log pi(t)."""
    rng = random.Random(3)
    for one_problem, micro in ((False, 1), (False, 4096), (True, 1), (True, 700)):
        # the system prompt runs once for the mini-batch (rl_update.shared_prompt_kv): 29 shared tokens with the
        # short prompt among the rows, ~450 with one problem's rollouts; its gradient comes back once at the end
        trajs = random_trajectories(tokenizer, rng, 5, one_problem)
        kept = [(t, a) for t, a in zip(trajs, [1.0, -0.5, 0.75, -1.25, 0.3])]
        _, m = lr0_update(tokenizer, kept, minibatches=1, micro_batch_tokens=micro, temperature=0.7)
        got = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        N = sum(sum(t.loss_mask) for t in trajs)
        loss = 0.0
        for t, a in kept:
            ref = oracle_logprobs(m, t.input_ids, 0.7)
            loss = loss - a * (ref * torch.tensor(t.loss_mask, dtype=torch.float32)).sum() / N
        loss.backward()
        for g, p in zip(got, m.parameters()):
            assert torch.allclose(g, p.grad, atol=1e-6, rtol=1e-4), micro


def test_policy_update_under_bf16_autocast_keeps_the_gradient_direction(tokenizer):
    """precision=bf16 (the default where the CPU has bf16 units): the forward passes run under bf16 autocast,
    the weights, log-ratios and loss stay fp32. Within the SFT's tolerance of the fp32 update: the gradient
    points the same way (cosine > 0.99), ratios stay 1 at lr = 0; and bf16 really ran (the gradients differ)."""
    rng = random.Random(4)
    trajs = random_trajectories(tokenizer, rng, 5, one_problem=True)
    kept = [(t, a) for t, a in zip(trajs, [1.0, -0.5, 0.75, -1.25, 0.3])]
    runs = []
    for precision in ("fp32", "bf16"):
        out, m = lr0_update(tokenizer, kept, minibatches=1, micro_batch_tokens=700, precision=precision)
        assert all(p.dtype == torch.float32 for p in m.parameters())
        assert abs(out["ratio_min"] - 1) < 1e-6 and abs(out["ratio_max"] - 1) < 1e-6
        runs.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    assert not torch.equal(runs[0], runs[1])
    assert torch.nn.functional.cosine_similarity(runs[0], runs[1], dim=0) > 0.99


def forwarded_tokens(m):
    """A counter of the tokens the model's embedding looks up (every forward, with or without gradient)."""
    seen = [0]
    m.get_input_embeddings().register_forward_hook(lambda mod, args, out: seen.__setitem__(0, seen[0] + args[0].numel()))
    return seen


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_first_minibatch_takes_pi_old_from_its_own_forward(tokenizer, precision):
    """Before the first optimizer step the weights are pi_old's, so the first mini-batch's own forward is its pi_old
    pass: with one mini-batch the update forwards each token once, not twice (a no-grad pass, then the update);
    with two, the later one's rows still get a no-grad pass at the weights before the update. The oracle is that
    two-pass computation (mask_token draws every pi_old from the pass, and without engine log-probs it masks
    nothing): the same loss and, after steps at lr > 0, the same weights, bitwise, in fp32 and under bf16."""
    rng = random.Random(8)
    trajs = random_trajectories(tokenizer, rng, 6, one_problem=True)
    kept = [(t, a) for t, a in zip(trajs, [1.0, -0.5, 0.75, -1.25, 0.3, 0.6])]
    for minibatches in (1, 2):
        runs = {}
        for mode in ("off", "mask_token"):
            m = models.tiny_model(tokenizer, seed=5)
            cfg = R.Config(lr=1e-2, warmup_steps=1, minibatches=minibatches, micro_batch_tokens=700,
                           sampler_correction=mode, precision=precision)
            optimizer, schedule = R.make_optimizer(m, cfg)
            rt = R.Runtime(m, tokenizer, engines=[], pool=None, loop=None)
            seen = forwarded_tokens(m)
            out = R.policy_update(rt, cfg, optimizer, schedule, kept, random.Random(1))
            runs[mode] = (out, seen[0], [p.detach().clone() for p in m.parameters()])
        (one, one_tokens, one_w), (two, two_tokens, two_w) = runs["off"], runs["mask_token"]
        assert one["loss"] == two["loss"] and one["ratio_max"] == two["ratio_max"], minibatches
        assert all(torch.equal(a, b) for a, b in zip(one_w, two_w)), minibatches
        if minibatches == 1:  # one pass against two passes of the same tokens (the shared prompt once a pass)
            assert 2 * one_tokens == two_tokens, (one_tokens, two_tokens)
        else:                 # the first mini-batch's rows are forwarded once fewer
            assert one_tokens < two_tokens, (one_tokens, two_tokens)


def test_engine_trainer_mismatch_over_model_tokens():
    """The metric is |engine log-prob - trainer log-prob| over model tokens only, in order."""
    t = scheduler.Trajectory("p", [1, 2, 3], [scheduler.Segment([4, 5], 1, [-1.0, -2.0]), scheduler.Segment([6], 0),
                                               scheduler.Segment([7], 1, [-0.5])])
    old = torch.tensor([0.0, -9.0, -9.0, -1.25, -2.0, -9.0, -0.0])
    out = R.engine_trainer_mismatch([t], [old], [t.loss_mask])
    assert out["logprob_diff_mean"] == pytest.approx((0.25 + 0.0 + 0.5) / 3)
    assert out["logprob_diff_max"] == pytest.approx(0.5)
    assert R.engine_trainer_mismatch([t], [None], [t.loss_mask])["logprob_diff_mean"] is None  # another rank's


def with_engine_logprobs(kept, old, shift):
    """Copies of the kept trajectories whose model tokens carry engine log-probs: pi_old + shift(), per token."""
    out = []
    for (t, a), o in zip(kept, old):
        t = copy.deepcopy(t)
        pos = len(t.prompt_ids)
        for s in t.segments:
            if s.loss_mask:
                s.logprobs = [float(o[pos + k]) + shift() for k in range(len(s.ids))]
            pos += len(s.ids)
        out.append((t, a))
    return out


def test_sampler_correction_reaches_the_loss_and_is_exact_where_engine_and_trainer_agree(tokenizer, monkeypatch):
    """policy_update with the engine's log-probs on the trajectories: equal to the trainer's pi_old, tis (and the
    masks) leave the loss and every gradient bitwise those of correction off; perturbed, tis changes the loss to
    the hand value -(1/N) sum_t min(pi_old / pi_sampler, C) A_i (lr = 0: rho = 1), and the metrics say so."""
    import rl_update

    seen = {}
    real = rl_update.engine_trainer_mismatch
    monkeypatch.setattr(rl_update, "engine_trainer_mismatch",
                        lambda trajs, old, *a, **kw: seen.update(old=old) or real(trajs, old, *a, **kw))
    rng = random.Random(6)
    trajs = random_trajectories(tokenizer, rng, 5, one_problem=True)
    kept = [(t, a) for t, a in zip(trajs, [1.0, -0.5, 0.75, -1.25, 0.3])]
    run = dict(minibatches=1, micro_batch_tokens=700)
    off, m_off = lr0_update(tokenizer, kept, sampler_correction="off", **run)
    grads_off = [p.grad.clone() for p in m_off.parameters()]
    old = seen["old"]

    same = with_engine_logprobs(kept, old, lambda: 0.0)
    for mode in ("tis", "mask_token", "mask_seq"):
        out, m = lr0_update(tokenizer, same, sampler_correction=mode, **run)
        assert out["loss"] == off["loss"] and out["loss_tokens"] == off["loss_tokens"], mode
        assert all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), grads_off)), mode
        assert out["sampler_correction"] == mode and out["mismatch_k3"] == 0.0
        assert out["is_ess"] == 1.0 and out["is_corrected_frac"] == 0.0

    noise = random.Random(7)
    shifted = with_engine_logprobs(kept, old, lambda: noise.uniform(-1.0, 1.0))
    out, _ = lr0_update(tokenizer, shifted, sampler_correction="tis", **run)
    weights, n = 0.0, 0
    for (t, a), o in zip(shifted, old):   # the paper's loss at rho = 1, each token weighted by min(r, 2)
        engine = [lp for s in t.segments if s.loss_mask for lp in s.logprobs]
        trainer = o[torch.tensor(t.loss_mask, dtype=torch.bool)].tolist()
        weights += sum(-a * min(math.exp(x - y), 2.0) for x, y in zip(trainer, engine))
        n += len(engine)
    assert out["loss"] != off["loss"] and out["loss"] == pytest.approx(weights / n, rel=1e-5)
    assert 0 < out["is_corrected_frac"] < 1 and 0 < out["is_ess"] < 1 and out["mismatch_k3"] > 0
    off_shifted, _ = lr0_update(tokenizer, shifted, sampler_correction="off", **run)
    assert off_shifted["loss"] == off["loss"] and off_shifted["mismatch_k3"] == out["mismatch_k3"]
    assert off_shifted["is_ess"] is None and off_shifted["sampler_correction"] == "off"
    masked, _ = lr0_update(tokenizer, shifted, sampler_correction="mask_token", **run)
    assert masked["loss_tokens"] < off["loss_tokens"] and masked["is_corrected_frac"] > 0


def test_pack_micro_batches_respects_token_budget():
    lengths = [100, 50, 400, 90, 300, 10]
    batches = distributed.pack_micro_batches(lengths, 400)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert len(b) * max(lengths[i] for i in b) <= 400 or len(b) == 1


# ---------------------------------------------------------------------------------------------------------
# The step's batch: a group is informative when its kept G differ in reward (after RoC, not before)


def graded_traj(i, r):
    """A one-turn trajectory of problem p{i} with reward r (one tool call, answer tags): for batch selection."""
    t = scheduler.Trajectory(f"p{i}", [1, 2], [scheduler.Segment([3, 4], 1)], turns=1, tool_calls=1, answer_tags=1)
    t.reward = r
    return t


def test_a_group_that_roc_leaves_all_equal_is_dropped_and_more_problems_are_drawn(tmp_path, monkeypatch):
    """2G = 8 with one wrong rollout keeps floor(1/2) = 0 of it: the kept G = 4 are all right, zero advantage. Such
    a group must not count toward groups_per_step (dynamic sampling draws on) nor reach the loss."""
    rewards_of = {0: [1] * 7 + [0], 1: [1, 0] * 4, 2: [0] * 8, 3: [1, 1, 0, 0, 0, 0, 1, 0]}
    drawn = []

    def fake_groups(rt, cfg, problems, n, seed, **kw):
        indices = [int(p.id) for p in problems]
        drawn.extend(indices)
        return [[graded_traj(i, r) for r in rewards_of[i]] for i in indices]

    monkeypatch.setattr(R, "generate_groups", fake_groups)
    cfg = R.Config(groups_per_step=2, group_size=4, oversample=2, max_draw_rounds=3, draw_problems=0)
    kept, stats, cursor, _ = R.select_step_batch(None, cfg, lambda i: Toy(str(i), "?", "0"), 0, 0, random.Random(0))
    assert drawn == [0, 1, 2, 3]   # round 1: problems 0, 1 (one informative); round 2: 2 (none); round 3: 3
    assert stats["groups_kept"] == 2 and stats["groups_equal_after_roc"] == 1 and cursor == 4
    assert {t.problem_id for t, _ in kept} == {"p1", "p3"} and len(kept) == 8
    assert all(a != 0 for _, a in kept)


def test_a_problem_all_wrong_is_sampled_again_and_its_second_group_trains(monkeypatch):
    """retry_all_wrong = 1: a problem whose 2G rollouts are all wrong gets one more group of 2G, with its own seed;
    the group that trains is the second, and both count in the step's rollouts. Without it nothing is resampled."""
    calls = []

    def fake_groups(rt, cfg, problems, n, seed, retry_seeds=(), **kw):
        """As generate_groups with scheduler.Retry: an all-wrong group is sampled again with each retry seed."""
        def draw(ps, seed_):
            calls.append(([int(p.id) for p in ps], seed_))
            first = len(calls) == 1   # problem 0 mixed, 1 all wrong, 2 all right; the second try of 1 is mixed
            rewards = {0: [1, 0] * 4, 1: [0] * 8 if first else [1, 1, 0, 0, 0, 0, 0, 0], 2: [1] * 8}
            return [[graded_traj(int(p.id), r) for r in rewards[int(p.id)]] for p in ps]
        groups = draw(problems, seed)
        if not retry_seeds:
            return groups
        spent = []
        for k, p in enumerate(problems):
            for seed_ in retry_seeds:
                if not any(t.reward > 0 for t in groups[k]):
                    spent.append((p, groups[k]))
                    groups[k] = draw([p], seed_)[0]
        return groups, spent

    monkeypatch.setattr(R, "generate_groups", fake_groups)
    for retries, want_calls, want_kept in [(0, 1, {"p0"}), (1, 2, {"p0", "p1"})]:
        calls.clear()
        cfg = R.Config(groups_per_step=3, group_size=4, oversample=2, max_draw_rounds=1, draw_problems=3,
                       retry_all_wrong=retries)
        kept, stats, cursor, rollouts = R.select_step_batch(None, cfg, lambda i: Toy(str(i), "?", "0"), 0, 5,
                                                            random.Random(0))
        assert len(calls) == want_calls and calls[0][0] == [0, 1, 2] and cursor == 3
        assert {t.problem_id for t, _ in kept} == want_kept and stats["groups_kept"] == len(want_kept)
        assert len(rollouts) == 8 * (2 + want_calls) and stats["problems_drawn"] == 3
        if retries:
            assert calls[1][0] == [1] and calls[1][1] != calls[0][1]        # the same problem, other uniforms
            assert stats["problems_resampled"] == 1
            assert stats["reward"] == (4 + 0 + 8 + 2) / 32                   # every rollout generated counts
            assert [a > 0 for t, a in kept if t.problem_id == "p1"].count(True) >= 1


def test_stage3_resume_takes_the_hard_subset_from_the_checkpoint(monkeypatch):
    """A resumed stage 3 trains on the subset it started with; only a fresh stage 3 scans."""
    monkeypatch.setattr(curriculum, "hard_subset", lambda sample, cfg, problem_at: [3, 5, 8])
    cfg = R.Config()
    assert R.stage3_subset(None, cfg, None, None) == [3, 5, 8]                       # fresh: a scan
    assert R.stage3_subset(None, cfg, None, {"stage": "2", "step": 4}) == [3, 5, 8]   # from stage 2: a scan
    assert R.stage3_subset(None, cfg, None, {"stage": "3", "hard_subset": [1, 2]}) == [1, 2]   # resumed


def scan_world(monkeypatch):
    """A fake sampler for difficulty scans: a scan's rollouts (n = scan_samples = 4) are right at a rate fixed per
    family, which changes at step 2 as if the policy had learned (binomial goes from never to sometimes right);
    training rollouts (n = 2G = 6) are all right, so no step updates. Records every training problem."""
    rate = {"product": [1, 0, 0, 0], "modular_power": [1, 1, 1, 1], "gcd_lcm": [0, 1, 1, 0]}
    trained = []

    def fake_groups(rt, cfg, problems, n, seed, **kw):
        step = {R.rollout_seed("scan", cfg.seed, s, r): s for s in range(cfg.steps) for r in range(2)}.get(seed)
        groups = []
        for p in problems:
            if n == cfg.scan_samples:
                r = rate.get(p.family, [0] * 4) if p.family != "binomial" or step < 2 else [0, 0, 1, 0]
            else:
                trained.append(p)
                r = [1] * n
            groups.append([scheduler.Trajectory(p.id, [1], [scheduler.Segment([2], 1)], reward=float(x)) for x in r])
        return groups

    monkeypatch.setattr(R, "generate_groups", fake_groups)
    return trained


def scanning_stage(tokenizer, cfg, run_dir, start, log_file):
    """train_stage on a tiny model with no problem source (the stage scans), then run_dir/log_file's JSON lines."""
    import asyncio

    rt = R.Runtime(model=models.tiny_model(tokenizer), tokenizer=tokenizer, engines=[], pool=None,
                   loop=asyncio.new_event_loop())
    try:
        R.train_stage(rt, cfg, "1", run_dir, None, start=start)
    finally:
        rt.loop.close()
    return [json.loads(x) for x in (run_dir / log_file).read_text().splitlines()]


def test_a_scan_passes_again_over_the_cells_no_rollout_was_right_on(tmp_path, monkeypatch):
    """scan_rounds = 2: the cells with no right rollout in the first pass (2 problems x 4) get a second pass of
    new problems, the others are not sampled again; counts are (right, rollouts) as counted by hand. The choice
    keeps every cell ever right (product is right 8/8 and stays), and a rescan samples only the cells not found."""
    calls = []

    def fake_groups(rt, cfg, problems, n, seed, **kw):
        second = seed in {R.rollout_seed("scan", cfg.seed, s, 1) for s in range(4)}
        calls.append([p.id for p in problems])
        right = {"product": [1] * n, "gcd_lcm": [1] + [0] * (n - 1) if second else [0] * n}
        return [[scheduler.Trajectory(p.id, [1], [scheduler.Segment([2], 1)], reward=float(x))
                 for x in right.get(p.family, [0] * n)] for p in problems]

    monkeypatch.setattr(R, "generate_groups", fake_groups)
    cfg = R.Config(scan_problems=2, scan_samples=4, scan_rounds=2, levels=(1,))
    counts = curriculum.difficulty_scan(R.sampler(None, cfg), cfg, 0)
    assert len(counts) == 11 and counts[("product", 1)] == (8, 8)
    assert counts[("gcd_lcm", 1)] == (2, 16)                  # one right rollout of each second-pass problem
    assert all(v == (0, 16) for c, v in counts.items() if c[0] not in ("product", "gcd_lcm"))
    assert [len(c) for c in calls] == [22, 20]                # pass 2: every cell but product, 2 problems each
    assert not set(calls[0]) & set(calls[1])                  # new problems

    calls.clear()
    found, counts = curriculum.choose_cells(R.sampler(None, cfg), cfg, "1", 0, tmp_path, [])
    assert counts["gcd_lcm/L1"] == [2, 16] and counts["product/L1"] == [8, 8]
    assert found == [("product", 1), ("gcd_lcm", 1)]
    calls.clear()
    found, _ = curriculum.choose_cells(R.sampler(None, cfg), cfg, "1", 3, tmp_path, found)  # a rescan: the other 9 cells only
    assert found == [("product", 1), ("gcd_lcm", 1)] and [len(c) for c in calls] == [18, 18]
    scans = [json.loads(x) for x in (tmp_path / "scan.jsonl").read_text().splitlines()]
    assert scans[0]["rates"]["gcd_lcm/L1"] == 2 / 16 and scans[0]["rollouts"]["product/L1"] == 8
    assert len(scans[1]["rates"]) == 9 and scans[1]["cells"] == ["product/L1", "gcd_lcm/L1"]
    # nothing ever right: the stage trains on every cell (and says so), and the next scan looks at all of them
    monkeypatch.setattr(R, "generate_groups", lambda rt, cfg, problems, n, seed, **kw: [
        [scheduler.Trajectory(p.id, [1], [scheduler.Segment([2], 1)], reward=0.0)] * n for p in problems])
    assert curriculum.choose_cells(R.sampler(None, cfg), cfg, "1", 0, tmp_path, [])[0] == []
    assert len(json.loads((tmp_path / "scan.jsonl").read_text().splitlines()[-1])["cells"]) == 11


def test_a_steps_draw_deals_the_chosen_cells_in_turn():
    """Problem i of a scan's choice comes from cell i mod k: 9 draws over 3 cells hold each 3 times, in turn,
    from the train split, and the stream never repeats a problem index."""
    import tasks

    cells = [("product", 1), ("gcd_lcm", 1), ("binomial", 1)]
    source = R.load_problem_source(R.Config(seed=3, levels=(1,)), cells)
    drawn = [source(i) for i in range(9)]
    assert [p.family for p in drawn] == ["product", "gcd_lcm", "binomial"] * 3
    assert all(p.level == 1 for p in drawn)
    assert all(p == tasks.problem_at(i, seed=3, split="train", cells=[cells[i % 3]]) for i, p in enumerate(drawn))
    heldout = {p.question for p in tasks.heldout_problems(33, levels=(1,))}
    assert not heldout & {source(i).question for i in range(300)}


def test_the_chance_a_group_informs_the_update_counts_every_reward_pattern():
    """informative_chance(p, 2G, G) against a brute-force count: every right/wrong pattern of a group of 2G,
    weighted p^k (1 - p)^(2G - k), kept when dynamic sampling, grpo_roc's 2G -> G and dynamic sampling again
    leave it mixed (roc and topk keep the same numbers of each kind; none: every G-subset equally likely)."""
    import itertools

    import grpo_roc

    for G, oversample in [(2, 2), (4, 2), (3, 3)]:
        n = G * oversample
        for p in (0.0, 0.05, 0.3, 0.5, 0.9, 1.0):
            for mode in ("roc", "none"):
                total = 0.0
                for pattern in itertools.product([0.0, 1.0], repeat=n):
                    k = int(sum(pattern))
                    if mode == "roc":
                        idx = grpo_roc.roc_downsample(list(pattern), [0.0] * n, G, random.Random(0))
                        subsets = [idx]
                    else:
                        subsets = list(itertools.combinations(range(n), G))
                    mixed = sum(grpo_roc.drop_uninformative([[pattern[i] for i in s]])[0] for s in subsets)
                    total += p ** k * (1 - p) ** (n - k) * mixed / len(subsets)
                assert curriculum.informative_chance(p, n, G, mode) == pytest.approx(total, abs=1e-12), (G, p, mode)
    assert curriculum.informative_chance(1 / 16, 8, 4, "roc") == pytest.approx(1 - (15 / 16) ** 8 - (1 / 16) ** 8
                                                                       - 8 * (1 / 16) ** 7 * (15 / 16))


def test_a_learnability_deal_gives_each_cell_its_share_of_the_draw():
    """deal_cells: n draws by systematic sampling over the weights informative_chance(p) + CELL_FLOOR, with p the
    smoothed rate (right + 1/2) / (rollouts + 1): each cell floor(n s) or ceil(n s) times, s its share of the
    weights, and n s times on average over seeded deals; the deal is in the cells' order."""
    cells = [("product", 1), ("gcd_lcm", 1), ("fibonacci", 1), ("binomial", 1)]
    rates = {"product/L1": [16.0, 16.0], "gcd_lcm/L1": [4.0, 8.0], "fibonacci/L1": [1.0, 16.0]}  # binomial: none
    cfg = R.Config(group_size=4, oversample=2)

    def weight(right, n):
        return curriculum.informative_chance((right + 0.5) / (n + 1), 8, 4, "roc") + curriculum.CELL_FLOOR

    w = [weight(*rates["product/L1"]), weight(*rates["gcd_lcm/L1"]), weight(*rates["fibonacci/L1"]), weight(0, 0)]
    share = [x / sum(w) for x in w]
    n, deals = 8, 4000
    mean = [0.0] * 4
    for seed in range(deals):
        deal = curriculum.deal_cells(cells, rates, n, random.Random(seed), cfg)
        assert len(deal) == n and deal == sorted(deal, key=cells.index)
        for j, cell in enumerate(cells):
            count = deal.count(cell)
            assert math.floor(n * share[j]) <= count <= math.ceil(n * share[j])
            mean[j] += count / deals
    assert mean == pytest.approx([n * s for s in share], abs=0.05)


def test_cell_rates_decay_each_step_and_add_the_steps_rollouts():
    """update_cell_rates: every cell's counts times CELL_RATE_DECAY, plus this step's (right, rollouts)."""
    d = curriculum.CELL_RATE_DECAY
    rates = curriculum.update_cell_rates({"a/L1": [2.0, 8.0], "b/L1": [0.0, 8.0]}, {"a/L1": [3, 8], "c/L1": [1, 8]})
    assert rates == {"a/L1": [2 * d + 3, 8 * d + 8], "b/L1": [0.0, 8 * d], "c/L1": [1.0, 8.0]}


def test_the_heldout_report_gives_each_change_its_paired_standard_error():
    """The run's last lines, checked against statistics.stdev: per-problem pass@1 before and after, the change's
    noise the standard error of the per-problem differences; trained and other families split; the test set
    first, then the validation set with its families; a set the before-row lacks is left out."""
    import statistics

    import tasks

    problems = [tasks.Problem(f"p{i}", "q", "1", family=f) for i, f in enumerate(["a", "a", "b", "b"])]
    tests = [tasks.Problem(f"t{i}", "q", "1", family=f) for i, f in enumerate(["a", "b"])]
    before, after = [0.5, 0.0, 1.0, 0.5], [1.0, 0.5, 0.5, 0.5]
    sets = {"heldout": problems, "test": tests}
    rows_before = {"heldout_acc_by_problem": before, "test_acc_by_problem": [0.0, 1.0]}
    rows_after = {"heldout_acc_by_problem": after, "test_acc_by_problem": [1.0, 1.0]}
    lines = R.heldout_report("1", sets, rows_before, rows_after, {"a"}, 2, 0.6)

    def se(xs):
        return statistics.stdev(xs) / len(xs) ** 0.5

    d = [y - x for x, y in zip(before, after)]
    assert "2 samples a problem at T = 0.6" in lines[0]
    assert lines[1].split() == ["test:", "all", "2", "families", "(2", "problems)", "0.500", "±", "0.500", "->",
                                "1.000", "±", "0.000", "change", "+0.500", "±", "0.500"]
    assert lines[2].split()[:5] == ["test:", "trained", "on", "(1", "family)"] and "change +1.000" in lines[2]
    assert lines[4].split() == ["validation:", "all", "2", "families", "(4", "problems)", "0.500", "±",
                                f"{se(before):.3f}", "->", "0.625", "±", f"{se(after):.3f}", "change", "+0.125", "±",
                                f"{se(d):.3f}"]
    assert lines[5].split()[:5] == ["validation:", "trained", "on", "(1", "family)"]
    assert "change +0.500 ± 0.000" in lines[5]
    assert lines[6].split()[:5] == ["validation:", "the", "other", "1", "family"]
    assert "0.750" in lines[6] and "-0.250" in lines[6]
    assert lines[7].split()[:4] == ["validation:", "a", "(trained", "on)"] and lines[8].split()[1] == "b"
    assert "conditional on that choice" in lines[-1]
    older = R.heldout_report("1", sets, {"heldout_acc_by_problem": before}, rows_after, {"a"}, 1, 0.6)
    assert "1 sample a problem" in older[0] and not any("test:" in line for line in older)
    assert older[1].split()[:3] == ["validation:", "all", "2"]


def test_difficulty_scans_choose_the_cells_rescan_and_resume_without_a_new_scan(tmp_path, tokenizer, monkeypatch):
    """A stage without problem_at scans all eleven families at step 0, trains on the cells ever right (counted
    here from the fake sampler's rates: modular_power's 4/4 too), dealt in turn; every scan_every steps it scans
    the cells not yet found, and a run resumed between two scans takes its cells from the checkpoint: it trains
    on the same problems as the uninterrupted run and logs the same scans."""
    trained = scan_world(monkeypatch)
    cfg = R.Config(steps=4, scan_problems=2, scan_samples=4, scan_every=2, levels=(1,), groups_per_step=2,
                   group_size=3, oversample=2, draw_problems=2, max_draw_rounds=1, eval_problems=0, save_every=2,
                   samples_per_step=0, warmup_steps=1)

    def run(d, start=None, steps=4):
        return scanning_stage(tokenizer, dataclasses.replace(cfg, steps=steps), d, start, "scan.jsonl")

    a = tmp_path / "a"
    a.mkdir()
    scans = run(a)
    assert [s["step"] for s in scans] == [0, 2]
    assert len(scans[0]["rates"]) == 11 and scans[0]["rates"]["product/L1"] == 0.25
    assert scans[0]["cells"] == ["product/L1", "modular_power/L1", "gcd_lcm/L1"]   # ever right
    assert len(scans[1]["rates"]) == 8 and "product/L1" not in scans[1]["rates"]    # the cells not yet found
    assert scans[1]["cells"] == ["product/L1", "modular_power/L1", "binomial/L1", "gcd_lcm/L1"]  # binomial joined
    families = [p.family for p in trained]   # 2 problems a step, cell i mod k of the cursor i
    assert families == ["product", "modular_power", "gcd_lcm", "product",
                        "product", "modular_power", "binomial", "gcd_lcm"]
    rows = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    assert [r["cells_trained"] for r in rows] == [3, 3, 4, 4]
    ids_a = [p.id for p in trained]

    b = tmp_path / "b"
    b.mkdir()
    trained.clear()
    run(b, steps=3)
    state = torch.load(R.latest_checkpoint(b) / "trainer_state.pt", weights_only=False)
    assert state["step"] == 3 and state["scan_step"] == 2 and len(state["cells"]) == len(state["found"]) == 4
    scans_b = run(b, start=state, steps=4)
    assert len(scans_b) == 2 and all(dict(s, scan_time_s=0) == dict(t, scan_time_s=0) for s, t in zip(scans, scans_b))
    assert [p.id for p in trained] == ids_a      # steps 1-3, then step 4 after the resume: the same problems


def test_learnability_sampling_deals_by_the_scans_rates_logs_each_cell_and_resumes_exactly(tmp_path, tokenizer,
                                                                                             monkeypatch):
    """cell_sampling = learnability: step 1 draws deal_cells(found cells, the scan's counts, n, the trainer's
    seeded rng) (an oracle written out from the scan's own counts); each step logs every drawn cell's (right,
    rollouts) as the fake sampler made them; the rates go into the checkpoint, and a run resumed after step 2
    draws the same problems as the uninterrupted one."""
    import tasks

    trained = scan_world(monkeypatch)
    cfg = R.Config(steps=4, scan_problems=2, scan_samples=4, scan_every=0, levels=(1,), groups_per_step=2,
                   group_size=3, oversample=2, draw_problems=4, max_draw_rounds=1, eval_problems=0, save_every=2,
                   samples_per_step=0, warmup_steps=1, cell_sampling="learnability")

    def run(d, start=None, steps=4):
        return scanning_stage(tokenizer, dataclasses.replace(cfg, steps=steps), d, start, "metrics.jsonl")

    a = tmp_path / "a"
    a.mkdir()
    rows = run(a)
    cells = [("product", 1), ("modular_power", 1), ("gcd_lcm", 1)]
    scanned = {f"{f}/L1": [0, 8] for f in tasks.FAMILIES}   # scan_world's rates: 2 problems x 4, one pass
    scanned |= {"product/L1": [2, 8], "modular_power/L1": [8, 8], "gcd_lcm/L1": [4, 8]}
    deal = curriculum.deal_cells(cells, scanned, 4, random.Random(cfg.seed), cfg)
    assert [(p.family, p.level) for p in trained[:4]] == deal
    for r, first in zip(rows, range(0, 16, 4)):
        drawn = trained[first:first + 4]
        expect = {}
        for p in drawn:   # scan_world's training rollouts: 2G = 6, all right
            right, n = expect.get(f"{p.family}/L{p.level}", [0, 0])
            expect[f"{p.family}/L{p.level}"] = [right + 6, n + 6]
        assert r["rollouts_by_cell"] == expect
    ids_a = [p.id for p in trained]

    trained.clear()    # the same run, stopped after step 2, then resumed from its checkpoint
    (tmp_path / "b").mkdir()
    run(tmp_path / "b", steps=2)
    state = torch.load(R.latest_checkpoint(tmp_path / "b") / "trainer_state.pt", weights_only=False)
    rates = curriculum.update_cell_rates(curriculum.update_cell_rates(scanned, rows[0]["rollouts_by_cell"]), rows[1]["rollouts_by_cell"])
    assert state["cell_rates"].keys() == rates.keys()
    for k, v in rates.items():
        assert state["cell_rates"][k] == pytest.approx(v), k
    run(tmp_path / "b", start=state, steps=4)
    assert [p.id for p in trained] == ids_a


# ---------------------------------------------------------------------------------------------------------
# checkpoints: atomic pointer, the previous checkpoint survives a half-written one


def test_checkpoint_pointer_is_atomic(tmp_path, tokenizer):
    m = models.tiny_model(tokenizer, seed=2)
    R.save_checkpoint(tmp_path, m, tokenizer, {"step": 1, "cursor": 4})
    R.save_checkpoint(tmp_path, m, tokenizer, {"step": 2, "cursor": 8})
    assert R.latest_checkpoint(tmp_path).name == "step_000002"
    # a save killed half-way leaves a temporary directory and never moves the pointer
    (tmp_path / "checkpoints" / ".step_000003.tmp").mkdir()
    assert R.latest_checkpoint(tmp_path).name == "step_000002"
    state = torch.load(R.latest_checkpoint(tmp_path) / "trainer_state.pt", weights_only=False)
    assert state["cursor"] == 8
    R.save_checkpoint(tmp_path, m, tokenizer, {"step": 3, "cursor": 12})
    kept = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert kept == ["step_000002", "step_000003"]  # the last two are kept


def test_fused_adamw_takes_the_loop_adamws_steps_and_resumes_its_state(tokenizer):
    """models.adamw (fused) is a drop-in for torch's AdamW: the same weights after several steps with the same
    hyper-parameters, and it continues from an optimizer state saved by the loop form (older checkpoints)."""
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
    loop_m, fused_m = models.tiny_model(tokenizer, seed=3), models.tiny_model(tokenizer, seed=3)
    loop_opt = torch.optim.AdamW(loop_m.parameters(), **hyper)
    fused_opt = models.adamw(fused_m.parameters(), **hyper)
    assert fused_opt.defaults["fused"] and not loop_opt.defaults["fused"]
    gen = torch.Generator().manual_seed(0)

    def step(m, opt, grads):
        for p, g in zip(m.parameters(), grads):
            p.grad = g.clone()
        opt.step()

    start = [p.detach().clone() for p in loop_m.parameters()]
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in loop_m.parameters()]
        step(loop_m, loop_opt, grads)
        step(fused_m, fused_opt, grads)
    for a, b, s in zip(loop_m.parameters(), fused_m.parameters(), start):
        assert torch.allclose(a, b, atol=1e-6)
        assert (a - s).abs().max() > 1e-3  # the steps really moved the weights
    # resume: a fused optimizer loads the loop optimizer's state and both take the same next step
    resumed = models.adamw(fused_m.parameters(), **hyper)
    resumed.load_state_dict(copy.deepcopy(loop_opt.state_dict()))  # a copy, as a checkpoint on disk is
    fused_m.load_state_dict(loop_m.state_dict())
    grads = [torch.randn(p.shape, generator=gen) for p in loop_m.parameters()]
    step(loop_m, loop_opt, grads)
    step(fused_m, resumed, grads)
    for a, b in zip(loop_m.parameters(), fused_m.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# A full RL step on a tiny model that has learned to call the tool: real sandbox calls, RoC, update, resume


def teacher_force(m, prompt: list[int], responses: list[list[int]], steps: int, lr: float) -> float:
    """Train the tiny model to continue `prompt` with each response (loss on the response tokens only: logits over
    the 49K vocabulary for the ~450-token prompt would cost 8x more). Returns the final loss."""
    x = torch.tensor([prompt + r for r in responses])
    keep = len(responses[0]) + 1
    labels = x[:, -keep + 1:].reshape(-1)
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    for _ in range(steps):
        logits = m(input_ids=x, logits_to_keep=keep).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def teach_one_tool_call(m, tokenizer, steps=120, lr=1e-2):
    """Teacher-force one tool-call trajectory into the tiny model so its rollouts really call the sandbox."""
    text = ('<reason> I will compute it with Python. </reason>\n<tool_call>\n{"name": '
            '"execute_python_code_with_standard_io", "arguments": {"code": "print(6*7)", "input": ""}}\n</tool_call>')
    response = scheduler.encode(tokenizer, text) + scheduler.encode(tokenizer, scheduler.tool_response_text("42")) + \
        scheduler.encode(tokenizer, "<answer> \\boxed{42} </answer><|im_end|>")
    loss = teacher_force(m, scheduler.render_prompt(tokenizer, "What is 6*7?"), [response], steps, lr)
    assert loss < 0.05, loss


def Toy(id: str, question: str, answer: str) -> tasks.Problem:
    """A problem outside the generator (no family; level 1 by default), as a loaded data file gives."""
    return tasks.Problem(id, question, answer)


def tiny_config(tmp_path, **kw) -> R.Config:
    base = dict(out=str(tmp_path / "run"), steps=2, groups_per_step=2, group_size=2, oversample=2,
                max_draw_rounds=1, max_turns=3, max_response_tokens=96, lr=1e-3, warmup_steps=1, minibatches=2,
                micro_batch_tokens=4096, eval_problems=0, save_every=1, engine_batch=8, deterministic=True,
                drop_all_equal=False, tool_timeout_s=5.0, samples_per_step=1,
                precision=PRECISION)
    base.update(kw)
    return R.Config(**base)


def make_runtime(cfg, model_dir, reward_fn=None):
    rt = R.build_runtime(cfg, model_dir)
    rt.reward_fn = reward_fn
    return rt


def taught_model_dir(tmp_path_factory, tokenizer, name: str, seed: int, teach) -> Path:
    """A tiny model taught by `teach(model, tokenizer)`, saved as a Hugging Face directory the trainer can load."""
    m = models.tiny_model(tokenizer, seed=seed)
    teach(m, tokenizer)
    d = tmp_path_factory.mktemp(name)
    m.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory, tokenizer):
    return taught_model_dir(tmp_path_factory, tokenizer, "tool-model", 3, teach_one_tool_call)


def run_steps(cfg, model_dir, stage_dir, start=None, reward_fn=None):
    rt = make_runtime(cfg, model_dir, reward_fn)
    try:
        problems = [Toy(f"p{i}", "What is 6*7?", "42") for i in range(50)]
        return R.train_stage(rt, cfg, "1", stage_dir, lambda i: problems[i % len(problems)], start=start)
    finally:
        R.close_runtime(rt)


def coin(response, gold):
    """A toy reward that splits groups so every step updates (the real grader is tested in test_eval.py)."""
    return float(sum(map(ord, response)) % 2)


def test_full_rl_step_with_real_tool_calls_then_exact_resume(tmp_path, tool_model_dir):
    # uninterrupted: 2 steps
    # every kept trajectory goes to samples/: at temperature 1.3 a third of this model's rollouts call the tool,
    # so one sample (the first kept) need not hold a tool response. Dynamic sampling (up to 3 draw rounds) so that
    # each step has a group with mixed rewards after RoC whatever the sampling stream (one draw of 2 groups had
    # none: 7 of 8 coin rewards 1, RoC kept the right ones)
    steps_cfg = dict(max_response_tokens=192, temperature=1.3, samples_per_step=8, drop_all_equal=True,
                     max_draw_rounds=3)
    cfg = tiny_config(tmp_path / "a", steps=2, engine_trace=True, **steps_cfg)
    d_a = tmp_path / "a" / "stage1"
    d_a.mkdir(parents=True)
    last = run_steps(cfg, tool_model_dir, d_a, reward_fn=coin)
    rows_a = [json.loads(x) for x in (d_a / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_a] == [1, 2]
    # rollouts really called the sandbox, and the tool's output came back
    assert rows_a[0]["tool_calls_per_traj"] > 0
    # the rollout phase's occupancy: busy rows per decode iteration, at most the engine's slots
    assert all(0 < r["rollout_rows_mean"] <= r["engine_slots"] and r["rollout_iterations"] > 0 for r in rows_a)
    # ... and what it prefilled: the prompts past the shared prefix and the tool responses, in some iterations
    assert all(r["rollout_prefill_tokens"] > 0 and 0 < r["rollout_prefill_iterations"] < r["rollout_iterations"]
               and 0 < r["rollout_prefill_s"] <= r["rollout_time_s"] for r in rows_a)
    # engine_trace=True: every decode iteration of each phase in engine_trace.jsonl, the same counts as the metrics
    traces = [json.loads(x) for x in (d_a / "engine_trace.jsonl").read_text().splitlines()]
    assert [t["step"] for t in traces] == [1, 2]
    for r, t in zip(rows_a, traces):
        its = t["iterations"]
        assert len(its) == r["rollout_iterations"] and sum(i["prefill"] for i in its) == r["rollout_prefill_tokens"]
        assert sum(i["rows"] for i in its) / len(its) == pytest.approx(r["rollout_rows_mean"], abs=0.01)
    samples = [(d_a / "samples" / f"step_000{k}.md").read_text() for k in (1, 2)]
    assert any("<tool_response>" in sample for sample in samples)
    assert all(r["loss"] is not None and r["grad_norm"] > 0 for r in rows_a)  # both steps updated
    # the engine sampled with the trainer's weights in the same precision: their log-probs agree (fp32 rounding)
    assert all(r["logprob_diff_mean"] < 1e-4 and r["logprob_diff_max"] < 1e-3 for r in rows_a), rows_a
    assert (d_a / "curves.png").exists()
    assert R.latest_checkpoint(d_a).name == "step_000002"
    assert last["step"] == 2

    # interrupted after step 1, then resumed from its checkpoint: step 2 logs the same numbers
    cfg_b = tiny_config(tmp_path / "b", steps=1, **steps_cfg)
    d_b = tmp_path / "b" / "stage1"
    d_b.mkdir(parents=True)
    run_steps(cfg_b, tool_model_dir, d_b, reward_fn=coin)
    ckpt = R.latest_checkpoint(d_b)
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    assert state["step"] == 1
    run_steps(dataclasses.replace(cfg_b, steps=2), ckpt, d_b, start=state, reward_fn=coin)
    rows_b = [json.loads(x) for x in (d_b / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_b] == [1, 2]
    timing = {"step_time_s", "rollout_time_s", "gen_tokens_per_s", "train_tokens_per_s", "peak_mem_gb",
              # the engine's iterations depend on when tool results come back
              "rollout_iterations", "rollout_rows_mean", "rollout_columns_mean", "rollout_read_mean",
              "rollout_ms_per_iteration",
              "rollout_prefill_tokens", "rollout_prefill_iterations", "rollout_prefill_s", "rollout_copied_tokens"}
    for key in rows_a[1]:
        if key in timing:
            continue
        if isinstance(rows_a[1][key], float):
            assert rows_a[1][key] == pytest.approx(rows_b[1][key], rel=1e-5, abs=1e-7), key
        else:
            assert rows_a[1][key] == rows_b[1][key], key


def test_a_step_without_signal_updates_nothing_and_logs_no_loss(tmp_path, tiny_model_dir, capsys):
    """Every rollout wrong, all groups kept (drop_all_equal=False): every advantage is 0, so the weights stay as
    they were and the step line says "loss -" (a step with no update, not a numerical failure: "loss nan")."""
    cfg = tiny_config(tmp_path, steps=1, max_turns=1, max_response_tokens=8, save_every=1000)
    d = tmp_path / "stage1"
    d.mkdir()
    rt = make_runtime(cfg, tiny_model_dir, reward_fn=lambda response, gold: 0.0)
    before = [p.detach().clone() for p in rt.model.parameters()]
    try:
        R.train_stage(rt, cfg, "1", d, lambda i: Toy(f"p{i}", "What is 6*7?", "42"))
        after = list(rt.model.parameters())
    finally:
        R.close_runtime(rt)
    row = json.loads((d / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["groups_kept"] == 2 and row["loss"] is None
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("step    1 |"))
    assert "| loss - |" in line and "nan" not in line, line


# ---------------------------------------------------------------------------------------------------------
# Learning: with the real loss a tiny model raises its reward on a trivial task; with the sign flipped it does not.
# The task: "Pick 1 or 2", graded by the real grader against gold 1. The tiny model is first taught both answers
# equally often (so it starts near 50% reward); RL must then prefer 1, and the flipped sign must prefer 2.

COIN_QUESTION = "Pick 1 or 2."


def teach_two_answers(m, tokenizer, steps=80, lr=1e-2):
    answers = [scheduler.encode(tokenizer, f"<answer> \\boxed{{{k}}} </answer><|im_end|>") for k in (1, 2)]
    teacher_force(m, scheduler.render_prompt(tokenizer, COIN_QUESTION), answers, steps, lr)


@pytest.fixture(scope="module")
def coin_model_dir(tmp_path_factory, tokenizer):
    return taught_model_dir(tmp_path_factory, tokenizer, "coin-model", 4, teach_two_answers)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_learning_raises_reward_and_flipped_sign_does_not(tmp_path, coin_model_dir, sign):
    cfg = tiny_config(tmp_path, steps=24, groups_per_step=4, group_size=4, max_turns=1, max_response_tokens=24,
                      lr=1e-3, minibatches=1, save_every=1000, drop_all_equal=True, max_draw_rounds=2,
                      samples_per_step=0)
    d = tmp_path / "stage1"
    d.mkdir()
    rt = make_runtime(cfg, coin_model_dir)  # the real reward: eval.reward(response, "1")
    try:
        problems = [Toy(f"p{i}", COIN_QUESTION, "1") for i in range(1000)]
        R.train_stage(rt, cfg, "1", d, lambda i: problems[i], loss_sign=sign)
    finally:
        R.close_runtime(rt)
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    start = sum(r["reward"] for r in rows[:2]) / 2
    end = sum(r["reward"] for r in rows[-4:]) / 4
    assert 0.2 < start < 0.8, start  # the taught model starts undecided
    if sign > 0:
        assert end > start + 0.15, (start, end)
    else:
        assert end < start - 0.15, (start, end)


# ---------------------------------------------------------------------------------------------------------
# The command line: one clear message and a non-zero exit, no traceback


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, str(ROOT / "rstar2_mini.py"), *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, timeout=120)


def test_cli_unknown_stage():
    r = cli("--stage", "7")
    assert r.returncode == 2 and "unknown stage '7'" in r.stderr and "Traceback" not in r.stderr


def test_cli_missing_model(tmp_path):
    r = cli("--stage", "1", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_cli_unknown_option_override(tmp_path):
    r = cli("--set", "learning_rate=1", "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and "unknown option 'learning_rate'" in r.stderr


def test_cli_generator_families(tmp_path):
    cfg = R.parse_args(["--set", "families=product, modular_power", "--set", "levels=1,2"])
    assert cfg.families == ("product", "modular_power") and cfg.levels == (1, 2)
    preset = R.parse_args([])
    assert preset.families == () and preset.scan_problems > 0  # the CPU preset scans all eleven families
    assert R.parse_args(["--preset", "paper"]).families == ()                # the paper preset: all of them
    r = cli("--set", "families=product,bogus", "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and "unknown families ['bogus']" in r.stderr and "Traceback" not in r.stderr


def test_cli_malformed_data_line(tmp_path, tiny_model_dir):
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "oops"\n')
    sft = tmp_path / "run" / "sft" / "model"  # skip the SFT stage: pretend it ran
    sft.parent.mkdir(parents=True)
    import shutil
    shutil.copytree(tiny_model_dir, sft)
    r = cli("--stage", "1", "--model", str(tiny_model_dir), "--out", str(tmp_path / "run"), "--data", str(data))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "line 2" in r.stderr and "Traceback" not in r.stderr


def test_cli_refuses_a_directory_that_holds_another_run(tmp_path, tiny_model_dir):
    d = tmp_path / "run" / "stage1"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"stage": "1", "seed": 99}))
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
    r = cli("--stage", "1", "--model", str(tiny_model_dir), "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and "already holds a run" in r.stderr
    r = cli("--stage", "1", "--model", str(tiny_model_dir), "--out", str(tmp_path / "run"), "--resume")
    assert r.returncode == 2 and "holds another run" in r.stderr
    assert json.loads((d / "config.json").read_text()) == {"stage": "1", "seed": 99}  # nothing lost
    assert json.loads((d / "metrics.jsonl").read_text()) == {"step": 1, "reward": 0.5}



def test_a_run_saved_before_a_setting_existed_resumes_with_that_settings_default(tmp_path):
    """The config.json of a run started before a Config field was added lacks the field: the run held its default,
    so --resume with the default continues it, and another value is refused (sft_extra_chores came after runs)."""
    import run_files
    cfg = R.parse_args(["--out", str(tmp_path / "run"), "--resume"])
    d = run_files.stage_dir(cfg, "1")
    d.mkdir(parents=True)
    saved = dataclasses.asdict(cfg) | {"stage": "1"}
    del saved["sft_extra_chores"]
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    (d / "config.json").write_text(json.dumps(saved, default=str))
    other = R.parse_args(["--out", str(tmp_path / "run"), "--resume", "--set", "sft_extra_chores=dotted_sum"])
    with pytest.raises(R.UsageError, match="sft_extra_chores: '' -> 'dotted_sum'"):
        run_files.prepare_run_dir(other, "1")
    assert run_files.prepare_run_dir(cfg, "1") == d   # the default: the same run, continued

# ---------------------------------------------------------------------------------------------------------
# Several GPUs: the FSDP2 path, run here on 2 CPU ranks (gloo over 127.0.0.1) under torchrun


def torchrun(*args, timeout=600):
    import os
    import socket

    with socket.socket() as s:  # a free port on the loopback interface
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(port),
                           str(ROOT / "tests" / "fsdp_ranks.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_a_rank_leaves_with_its_exit_code_and_its_output_flushed():
    """distributed.exit_rank: a torchrun rank (world > 1) leaves by os._exit, which skips Python's flushing of
    its standard streams, so exit_rank flushes them; one process leaves by sys.exit. Output written without a
    newline into a pipe must arrive, and the exit status must be the one given."""
    code = ("import sys; sys.path.insert(0, {root!r}); import distributed as D; D.DIST.world = {world}; "
            "print('metrics written', end=''); sys.stderr.write('last words'); D.exit_rank(3)")
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}   # a pipe's usual block buffering
    for world in (2, 1):
        r = subprocess.run([sys.executable, "-c", code.format(root=str(ROOT), world=world)], capture_output=True,
                           text=True, timeout=120, env=env)
        assert (r.returncode, r.stdout, r.stderr) == (3, "metrics written", "last words"), world


def test_fsdp_update_on_two_ranks_equals_one_process(tmp_path, tiny_model_dir, tokenizer):
    sys.path.insert(0, str(ROOT / "tests"))
    import fsdp_ranks

    # one process: the reference
    m = models.load_model(tiny_model_dir)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    rt = R.Runtime(m, tokenizer, engines=[], pool=None, loop=None)
    cfg = fsdp_ranks.update_config()
    optimizer, schedule = R.make_optimizer(m, cfg)
    ref = R.policy_update(rt, cfg, optimizer, schedule, fsdp_ranks.fixed_batch(tokenizer), random.Random(0))
    # two ranks, each with half of every weight, gradient and AdamW state, and its share of each mini-batch
    torchrun("update", tiny_model_dir, tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    for key in ("loss", "clip_frac", "grad_norm"):  # the token-level mean over both ranks' tokens, the global norm
        assert got["numbers"][key] == pytest.approx(ref[key], rel=1e-4), key
    assert got["numbers"]["train_tokens"] == ref["train_tokens"]
    moved = 0
    for name, value in m.state_dict().items():
        # the weights move ~2e-3 (lr 1e-3, two AdamW steps); the ranks sum their gradients in another order, and
        # Adam's per-element scaling turns that rounding into up to ~3e-6 (0.2% of the step)
        assert torch.allclose(got["weights"][name], value, atol=1e-5), name
        moved += int((value != before[name]).sum())
    assert moved > 1000  # the update really changed the weights


def test_fsdp_sft_on_two_ranks_equals_one_process(tmp_path, tiny_model_dir, tokenizer):
    sys.path.insert(0, str(ROOT / "tests"))
    import fsdp_ranks
    import sft

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in fsdp_ranks.chat_rows()))
    m = models.load_model(tiny_model_dir)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    ref = sft.run_sft(m, tokenizer, fsdp_ranks.sft_config(str(chats)), None, log=lambda *_: None)
    torchrun("sft", tiny_model_dir, chats, tmp_path / "sft-model")
    got = models.load_model(tmp_path / "sft-model")
    assert ref["steps"] == 2
    moved = 0
    for name, value in m.state_dict().items():
        # the weights move ~2e-3 (lr 1e-3, two AdamW steps); the ranks sum their gradients in another order, and
        # Adam's per-element scaling turns that rounding into up to ~3e-6 on CPUs with AVX-512 kernels
        assert torch.allclose(got.state_dict()[name], value, atol=1e-5), name
        moved += int((value != before[name]).sum())
    assert moved > 1000


def test_fsdp_rl_steps_on_two_ranks_then_resume(tmp_path, tool_model_dir):
    run = tmp_path / "run"
    torchrun("stage", tool_model_dir, run, 1)  # rollouts on rank 0, the update sharded, a checkpoint
    torchrun("stage", tool_model_dir, run, 2)  # resumed from it by both ranks
    d = run / "stage1"
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # rank 0 alone writes: one line per step
    assert all(r["loss"] is not None and r["grad_norm"] > 0 for r in rows)
    assert R.latest_checkpoint(d).name == "step_000002"
    state = torch.load(R.latest_checkpoint(d) / "trainer_state.pt", weights_only=False)
    assert state["world"] == 2 and state["optimizer"]["state"]  # the full AdamW state, gathered
    models.load_model(R.latest_checkpoint(d))  # the full weights, loadable without torchrun
    with pytest.raises(R.UsageError, match="2 process"):  # a single process refuses the 2-rank checkpoint
        cfg = tiny_config(tmp_path / "single")
        rt = make_runtime(cfg, tool_model_dir)
        try:
            R.train_stage(rt, cfg, "1", tmp_path, lambda i: None, start=state)
        finally:
            R.close_runtime(rt)


def test_vllm_starts_without_torchruns_variables(monkeypatch):
    """vLLM's engine processes inherit the environment: torchrun's RANK/MASTER_PORT would make them join our group."""
    import os

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with distributed.without_torchrun_env():
        assert not {"RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} & set(os.environ)
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"  # not torchrun's: kept
    assert os.environ["RANK"] == "3" and os.environ["MASTER_PORT"] == "29500"  # restored for our own collectives


# ---------------------------------------------------------------------------------------------------------
# The sandbox fails closed: where unshare(2) is refused (Docker's default seccomp profile, simulated by a real
# seccomp filter) a run refuses to start, and `--sandbox-isolation none` runs it, warned and recorded.

def cli_refusing_unshare(*args):
    return subprocess.run([sys.executable, str(ROOT / "tests" / "refuse_unshare.py"), sys.executable,
                           str(ROOT / "rstar2_mini.py"), *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_cli_refuses_to_run_when_the_sandbox_cannot_isolate(tmp_path, tiny_model_dir):
    r = cli_refusing_unshare("--stage", "1", "--model", str(tiny_model_dir), "--out", str(tmp_path / "run"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "cannot isolate model-written code" in r.stderr and "--sandbox-isolation none" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_with_sandbox_isolation_none_warns_and_records_the_mode(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    shutil.copytree(tiny_model_dir, out / "sft" / "model")  # an SFT checkpoint: stage 1 starts from it
    sets = ["groups_per_step=1", "group_size=2", "max_turns=1", "max_response_tokens=16", "eval_problems=0",
            "draw_problems=1", "minibatches=1", "drop_all_equal=false", "engine_batch=4"]
    r = cli_refusing_unshare("--stage", "1", "--model", str(tiny_model_dir), "--out", str(out), "--steps", "1",
                             "--sandbox-isolation", "none", *[x for s in sets for x in ("--set", s)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "WARNING: sandbox isolation none: missing network namespace" in r.stdout
    assert "| WARNING sandbox isolation none" in r.stdout                          # on every step's line too
    assert json.loads((out / "stage1" / "config.json").read_text())["sandbox_isolation"] == "none"
    rows = [json.loads(x) for x in (out / "stage1" / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(row["sandbox_isolation"] == "none" for row in rows)
    assert R.parse_args(["--set", "sandbox_isolation=none"]).sandbox_isolation == "none"
    assert R.parse_args([]).sandbox_isolation == "auto"


# ---------------------------------------------------------------------------------------------------------
# Review fixes (issue 35): the CPU engine's KV cap, one sampling stream per use of rollouts, the logged lr


class NoSandbox:
    """Stands in for sandbox.SandboxPool where a test builds a runtime and runs no tool."""
    mode, isolation = "test", {"missing": []}

    def __init__(self, **kw):
        pass

    async def start(self):
        pass

    async def close(self):
        pass


@pytest.mark.parametrize("stage", ["1", "2", "3"])
def test_the_cpu_engine_admits_engine_batch_rollouts_at_their_whole_budget(stage, tokenizer, tiny_model_dir,
                                                                           monkeypatch):
    """The CPU engine admits a request while its need (context + every token it may still write, at most the
    prompt + max_response_tokens) fits in the free KV tokens of its cap. With the cpu preset's stage config, the
    engine build_runtime makes must hold engine_batch requests of the longest real prompt at their whole budget
    (the default cap of 65,536 tokens held ~51 of 64 in stages 2-3: 768-token budget). Longest prompt: the
    rendered train and held-out questions of the stage's generator levels, every family."""
    import sandbox
    import tasks

    monkeypatch.setattr(sandbox, "SandboxPool", NoSandbox)
    cfg = R.apply_stage(R.parse_args(["--stage", stage, "--set", "engine=transformers"]), stage)
    questions = [tasks.problem_at(i, seed=s, levels=cfg.levels).question for s in (0, 1) for i in range(500)]
    questions += [p.question for p in tasks.heldout_problems(cfg.eval_problems, levels=cfg.levels)]
    longest = max(len(scheduler.render_prompt(tokenizer, q)) for q in questions)
    rt = R.build_runtime(cfg, tiny_model_dir)
    try:
        engine = rt.engines[0]
        assert engine.max_batch == cfg.engine_batch == 64
        need = longest + cfg.max_response_tokens                                  # GenRequest.need at its largest
        assert cfg.engine_batch * need <= engine.free_tokens(), (engine.free_tokens() // need, cfg.engine_batch)
    finally:
        R.close_runtime(rt)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_fp32_cpu_engine_samples_from_the_trainers_own_weights(tiny_model_dir, monkeypatch, precision):
    """Where the CPU engine runs in the trainer's precision (fp32: precision=fp32, or auto without bf16 units) it
    holds the trainer's model itself, not a copy (the copy was 540 MB of a 135M model's peak): the weight sync then
    has nothing to copy, and the engine samples exactly what the trainer computes. A bf16 engine keeps its own
    bf16 copy, and the sync copies into it."""
    import sandbox

    monkeypatch.setattr(sandbox, "SandboxPool", NoSandbox)
    cfg = R.parse_args(["--set", "engine=transformers", "--set", f"precision={precision}"])
    rt = R.build_runtime(cfg, tiny_model_dir)
    try:
        engine = rt.engines[0]
        shared = engine.model is rt.model
        assert shared == (precision == "fp32")
        assert next(engine.model.parameters()).dtype == (torch.float32 if shared else torch.bfloat16)
        with torch.no_grad():
            next(rt.model.parameters()).add_(1.0)    # an update
        scheduler.sync_weights(rt.engines, R.unwrapped(rt))
        a, b = next(rt.model.parameters()), next(engine.model.parameters())
        assert torch.allclose(a.to(b.dtype).float(), b.float())
    finally:
        R.close_runtime(rt)


def test_each_use_of_rollouts_samples_its_own_stream(monkeypatch):
    """Every request's generator is seeded from (the seed its use hands run_rollouts, problem index, sample index,
    turn), so two uses that hand over one seed draw the same uniforms for their k-th problems (at seed 0 the
    step-0 difficulty scan and the step-0 training rollouts both had seed 0). The seeds that the call sites hand
    over - training (every step and draw round), scans (every step), stage 3's hard scan, for run seeds 0-3,
    steps 0-39, rounds 0-2; and the held-out evaluation - must all differ."""
    import tasks

    class Recorded(Exception):
        pass

    seen = {}   # seed -> the calls that used it

    def fake_groups(rt, cfg, problems, n, seed, **kw):
        seen.setdefault(seed, []).append(call)
        if call[0] != "train":
            raise Recorded
        return [[scheduler.Trajectory(p.id, [1], [scheduler.Segment([2], 1)], reward=0.0) for _ in range(n)]
                for p in problems]   # all equal: dropped, so every draw round runs

    monkeypatch.setattr(R, "generate_groups", fake_groups)
    problem = tasks.problem_at(0, seed=0, levels=(1,))
    for seed in range(4):
        cfg = R.Config(seed=seed, max_draw_rounds=3, draw_problems=1, groups_per_step=1, scan_problems=1,
                       families=("product",), levels=(1,), hard_scan=1)
        for step in range(40):
            call = ("train", seed, step)
            R.select_step_batch(None, cfg, lambda i: problem, 0, step, random.Random(0))
            call = ("scan", seed, step)
            with pytest.raises(Recorded):
                curriculum.difficulty_scan(R.sampler(None, cfg), cfg, step)
        call = ("hard", seed)
        with pytest.raises(Recorded):
            curriculum.hard_subset(R.sampler(None, cfg), cfg, lambda i: problem)
    for split in ("heldout", "test"):
        call = (split,)
        with pytest.raises(Recorded):
            R.heldout_accuracy(None, R.Config(), [problem], split)
    assert sum(len(c) for c in seen.values()) == 4 * 40 * (3 + 1) + 4 + 2
    shared = {seed: calls for seed, calls in seen.items() if len(calls) > 1}
    assert not shared, list(shared.items())[:3]


def test_the_logged_lr_is_the_rate_the_steps_optimizer_steps_used(tokenizer):
    """Warm-up lr_t = lr * min(1, (t + 1) / warmup) for optimizer step t. metrics.jsonl's lr is the rate of the
    step's first optimizer step: with warmup 4, lr/4 for step 0 (it was lr * 2/4, the next step's rate); with two
    mini-batches, RL step s starts at optimizer step 2s."""
    rng = random.Random(4)
    kept = [(t, a) for t, a in zip(random_trajectories(tokenizer, rng, 4), [1.0, -1.0, 0.5, -0.5])]
    for minibatches, expected in ((1, [1 / 4, 2 / 4, 3 / 4, 1, 1]), (2, [1 / 4, 3 / 4, 1, 1])):
        m = models.tiny_model(tokenizer, seed=5)
        cfg = R.Config(lr=1e-3, warmup_steps=4, minibatches=minibatches, precision=PRECISION)
        optimizer, schedule = R.make_optimizer(m, cfg)
        rt = R.Runtime(m, tokenizer, engines=[], pool=None, loop=None)
        logged = [R.policy_update(rt, cfg, optimizer, schedule, kept, random.Random(1))["lr"] for _ in expected]
        assert logged == pytest.approx([cfg.lr * f for f in expected], rel=1e-12), (minibatches, logged)


def test_tool_state_option_reaches_the_rollouts_and_refuses_what_cannot_run():
    """--set tool_state=... (sandbox.py's stateless | replay | persistent): the paper's stateless tool by default,
    carried into every rollout's config; a persistent session needs the sandbox's namespaces."""
    assert R.parse_args([]).tool_state == "stateless"
    cfg = R.parse_args(["--set", "tool_state=persistent"])
    assert cfg.tool_state == "persistent" and R.rollout_config(cfg).tool_state == "persistent"
    assert R.rollout_config(R.parse_args(["--set", "tool_state=replay"]), temperature=0.6).tool_state == "replay"
    with pytest.raises(R.UsageError, match="choose stateless, replay or persistent"):
        R.parse_args(["--set", "tool_state=sticky"])
    with pytest.raises(R.UsageError, match="namespaces"):
        R.parse_args(["--set", "tool_state=persistent", "--sandbox-isolation", "none"])
