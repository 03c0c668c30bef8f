"""GRPO-RoC: Resample-on-Correct rollout selection and the clipped token-level policy loss.

Implements rStar2-Agent (arXiv 2508.20722v1) section 2.2 (the RL objective) and section 2.2.3 (GRPO-RoC).

How it departs from vanilla GRPO (DeepSeekMath):
  1. Resample-on-Correct (2.2.3): roll out 2G trajectories per problem, then down-sample to G. Negatives
     (reward 0) are kept uniformly at random (half of them, no filtering, so the policy still sees every kind
     of failure); positives (reward 1) fill the remaining slots, sampled without replacement with probability
     inversely proportional to their penalty p_total = p_err + p_format (tool-call errors, repeated answers),
     so the positives it learns from are the clean ones.
  2. Advantages are normalized over the kept G only; groups whose rewards are all equal are dropped, before
     RoC and again after it (a group whose kept G all agree carries no signal either).
  3. Token-level loss (as DAPO): the mean over every model token in the batch, not a mean of per-sequence means.
     Tool responses and chat scaffolding are masked out.
  4. Clip-higher (as DAPO): ratio clipped to [1 - 0.2, 1 + 0.28]. No KL term (no reference model), no entropy bonus.

Data flow (one RL step, see DESIGN.md):
  per trajectory:  roc_penalty(tool calls, tool errors, <answer> tags, turns) -> p_total
  per group:       drop_uninformative -> roc_downsample(rewards, p_total, keep=G) -> drop_uninformative(kept)
                   -> group_advantages(kept rewards)
  per batch:       policy_loss(new log-probs, old log-probs, advantages, loss mask) -> backward
  (not in the paper) sampler_weights(old log-probs, the engine's sampling log-probs) -> policy_loss(weights=...):
                   the off-policy correction for the gap between the engine that sampled and the trainer

Where the released code (volcengine/verl, recipe/rstar2_agent/src/down_sample/roc.py) differs from the paper,
this file follows the paper; each difference is named in a comment marked "Released code:".
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

ROC_EPS = 1e-6   # weight_i = 1 / (p_total_i + ROC_EPS): a zero-penalty positive gets weight 1e6, i.e. in effect it
                 # is picked before any penalised one (the eps -> 0 limit of "inversely proportional").
ADV_EPS = 1e-6   # A_i = (r_i - mean) / (std + ADV_EPS), as in verl's GRPO estimator
ROC_MODES = ("roc", "topk", "none")
SAMPLER_CORRECTIONS = ("off", "tis", "mask_token", "mask_seq")   # sampler_weights ("auto" is rl_update's)


# ----------------------------------------------------------------------------------------------------------------
# RoC penalty (section 2.2.3)

def roc_penalty(tool_calls: int, tool_errors: int, answer_tags: int, turns: int) -> float:
    """Penalty of one trajectory, p_total = p_err + p_format, in [0, 2]. Lower is cleaner.

    tool_calls:  tool calls the model made (every <tool_call>, including malformed ones that got an error text).
    tool_errors: calls whose result was not ok: error, timeout, memory, crash, bad JSON ... (DESIGN.md).
    answer_tags: complete <answer> ... </answer> blocks in the model's text (scheduler.count_answer_blocks).
    turns:       assistant turns in the trajectory (the first one included).
    """
    for name, value in (("tool_calls", tool_calls), ("tool_errors", tool_errors),
                        ("answer_tags", answer_tags), ("turns", turns)):
        if value < 0:
            raise ValueError(f"roc_penalty: {name} must be >= 0, got {value}")
    if tool_errors > tool_calls:
        raise ValueError(f"roc_penalty: tool_errors ({tool_errors}) cannot exceed tool_calls ({tool_calls})")
    if answer_tags > 0 and turns == 0:
        raise ValueError(f"roc_penalty: {answer_tags} <answer> tags but 0 turns; an answer needs a turn")

    # p_err = 0.5 if no tool call, else errors / calls. A trajectory that never calls the tool is penalised
    # in the middle, between an all-clean and an all-error one.
    # Released code: an "error" is a <tool_response> whose text contains the substring "error" (so a timeout
    # message without that word is clean, and a program that prints "error" is not). Here: any result that is
    # not ok, timeouts included.
    p_err = 0.5 if tool_calls == 0 else tool_errors / tool_calls
    # p_format = 1 if no <answer>, else min(1, (answer_tags - 1) / turns): one answer is free, each extra costs.
    # Released code: turns are counted with a regex over the response text, whose first assistant header sits
    # in the prompt, so it counts one turn too few (and a one-turn answer gets p_format = 1); unbalanced
    # <answer>/</answer> tags also give 1. Here: the caller counts every assistant turn.
    p_format = 1.0 if answer_tags == 0 else min(1.0, (answer_tags - 1) / turns)
    return p_err + p_format   # p_total = p_err + p_format


# ----------------------------------------------------------------------------------------------------------------
# Asymmetric down-sampling 2G -> G (section 2.2.3)

def roc_downsample(rewards: Sequence[float], penalties: Sequence[float], keep: int,
                   rng: random.Random, mode: str = "roc") -> list[int]:
    """Indices (sorted ascending, exactly min(keep, len) of them) of the trajectories of one group to train on.

    mode "roc":  the paper. Negatives (reward <= 0): keep floor(n_neg * keep / n), i.e. floor(n_neg / 2) for
                 2G -> G, uniformly at random. Positives (reward > 0; the paper's rewards are 0/1): keep the
                 rest, drawn one by one without replacement with P(i) proportional to 1 / (p_total_i + ROC_EPS).
                 Zero-penalty positives therefore come first (uniformly among themselves), then the others.
    mode "topk": the released code's deterministic rule for positives: the lowest penalties (ties broken at
                 random). Negatives stay uniform, so only the positive rule differs from "roc".
    mode "none": no RoC ("GRPO with tool" in the paper's ablation): a uniform random subset of size keep,
                 the same as having sampled keep rollouts in the first place.
    If one side has too few trajectories the other fills the slots, so the count is always exact.
    """
    if mode not in ROC_MODES:
        raise ValueError(f"roc_downsample: unknown mode {mode!r}; allowed: {', '.join(ROC_MODES)}")
    if len(rewards) != len(penalties):
        raise ValueError(f"roc_downsample: {len(rewards)} rewards but {len(penalties)} penalties")
    if keep < 0:
        raise ValueError(f"roc_downsample: keep must be >= 0, got {keep}")
    for r in rewards:
        if not math.isfinite(r):
            raise ValueError(f"roc_downsample: rewards must be finite, got {r}")
    for p in penalties:
        if not (math.isfinite(p) and p >= 0):
            raise ValueError(f"roc_downsample: penalties must be finite and >= 0, got {p}")
    n = len(rewards)
    if keep >= n:
        # Released code: a group with fewer than down_sample_to_n trajectories is dropped entirely.
        return list(range(n))
    if mode == "none":
        return sorted(rng.sample(range(n), keep))

    neg = [i for i in range(n) if rewards[i] <= 0]
    pos = [i for i in range(n) if rewards[i] > 0]
    n_pos_keep, n_neg_keep = roc_kept_counts(len(pos), len(neg), keep)
    kept_neg = rng.sample(neg, n_neg_keep)   # uniform, no filtering: every kind of failure stays visible
    # Released code: negatives are also sorted by penalty and the lowest kept (deterministic), against the
    # paper's uniform sampling; it does the same for positives, which is our mode "topk".
    if mode == "topk":
        shuffled = rng.sample(pos, len(pos))   # random tie-break (the released code breaks ties by index,
        kept_pos = sorted(shuffled, key=lambda i: penalties[i])[:n_pos_keep]   # which may follow finish order)
    else:
        # Sampling without replacement with P(i) proportional to w_i = 1 / (p_total_i + eps), as a race of
        # exponential clocks: clock i rings at t_i ~ Exp(rate w_i); the first to ring is i with probability
        # w_i / sum(w), and by memorylessness the next among the rest likewise. The first n_pos_keep win.
        ring_times = {i: rng.expovariate(1.0 / (penalties[i] + ROC_EPS)) for i in pos}
        kept_pos = sorted(pos, key=ring_times.__getitem__)[:n_pos_keep]
    return sorted(kept_neg + kept_pos)


def roc_kept_counts(n_pos: int, n_neg: int, keep: int) -> tuple[int, int]:
    """(positives, negatives) that roc_downsample's modes roc and topk keep of a group with n_pos right and n_neg
    wrong trajectories (keep < n_pos + n_neg)."""
    n = n_pos + n_neg
    # Negatives are down-sampled at the group's rate: floor(n_neg * G / 2G) = floor(n_neg / 2).
    # Released code: round(n_neg * G / 2G) (Python's round, half to even), and at least 2 negatives and
    # 2 positives when the group has them (min_zero/min_non_zero_reward_trace_num = 2 in its example script).
    n_neg_target = (n_neg * keep) // n                # floor(n_neg * G / 2G) = floor(n_neg / 2)
    n_pos_keep = min(keep - n_neg_target, n_pos)      # positives take the rest ...
    n_neg_keep = keep - n_pos_keep                    # ... and negatives fill in when positives run short
    # (n_neg_target <= n_neg always, so negatives never run short: the remaining slots go to positives.)
    return n_pos_keep, n_neg_keep


def drop_uninformative(groups_rewards: list[list[float]]) -> list[bool]:
    """True = keep. A group whose rewards are all equal (all right or all wrong) has zero advantage for every
    trajectory and so no gradient; it is dropped, as in the paper and DAPO (released code: reject_equal_reward)."""
    return [len(group) > 0 and max(group) != min(group) for group in groups_rewards]


# ----------------------------------------------------------------------------------------------------------------
# Group-relative advantages (section 2.2)

def group_advantages(rewards: Sequence[float]) -> torch.Tensor:
    """A_i = (r_i - mean(r)) / (std(r) + eps) over the kept group; float32 tensor of shape [len(rewards)].

    std is the population std (divide by G). GRPO implementations commonly use torch.std, the sample std
    (divide by G - 1; verl and DeepSeekMath do). The two differ by a constant factor sqrt((G - 1) / G)
    (0.968 for G = 16), which Adam all but cancels; the population std is the one for which the advantages
    of a group have unit variance (up to eps), e.g. rewards [0, 1] -> advantages [-1, +1].
    Equal rewards (and a single reward) give exactly zero, never NaN.
    """
    r = torch.tensor([float(x) for x in rewards], dtype=torch.float64)
    if not torch.isfinite(r).all():
        raise ValueError(f"group_advantages: rewards must be finite, got {list(rewards)}")
    if len(r) == 0 or r.max() == r.min():
        return torch.zeros(len(r), dtype=torch.float32)   # std = 0: no signal (avoids (r - mean) ~ 1e-17 / eps)
    std = r.std(unbiased=False)                           # population std, sqrt(mean((r - mean)^2))
    return ((r - r.mean()) / (std + ADV_EPS)).float()     # A_i = (r_i - mean(r)) / (std(r) + eps)


# ----------------------------------------------------------------------------------------------------------------
# Off-policy correction for the sampler/trainer gap (not in the paper; TRL, verl, slime and SkyRL offer it)
#
# The tokens were drawn by the engine (vLLM in bf16, or the CPU engine's bf16 copy), pi_sampler, but the loss's
# ratio rho = pi_theta / pi_old uses the trainer's own pi_old: the batch is slightly off-policy. Importance
# sampling from pi_sampler to pi_old reweighs each token by r_t = pi_old(t) / pi_sampler(t); truncated, or
# turned into a keep/drop mask, it bounds the variance that a rare large r_t would bring.

def sampler_weights(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, mode: str,
                    cap: float = 2.0, low: float = 0.5, high: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights of the correction, (weights [B, T] float32, corrected [B, T] bool), no grad.

    old_logprobs [B, T]: log pi_old, the trainer's recomputation; sampler_logprobs [B, T]: the engine's log-probs
    of the same tokens; mask [B, T]: 1 = a model token. With r_t = pi_old(t) / pi_sampler(t):
      off:        w_t = 1
      tis:        w_t = min(r_t, cap)                          (truncated importance sampling; TRL's default)
      mask_token: w_t = 1 if low <= r_t <= high else 0
      mask_seq:   w_t = 1 if low <= g_i <= high else 0 for every token of sequence i, g_i = (prod_t r_t)^(1/n_i)
                  the geometric mean over its n_i model tokens (a plain product would vanish or explode with
                  length); the geometric mean moves far less than single ratios, so a tight band suits it.
    corrected: the model tokens whose weight the correction changed: truncated (tis, r_t > cap) or dropped
    (w_t = 0). Positions where mask is 0 get weight 0 and are never corrected.
    cap >= 1 and low <= 1 <= high, so that identical log-probs (r = 1) give w = 1 exactly: the paper's loss.
    """
    if mode not in SAMPLER_CORRECTIONS:
        raise ValueError(f"sampler_weights: unknown mode {mode!r}; allowed: {', '.join(SAMPLER_CORRECTIONS)}")
    if not cap >= 1.0:
        raise ValueError(f"sampler_weights: cap must be >= 1 (r = 1 must keep weight 1), got {cap}")
    if not low <= 1.0 <= high:
        raise ValueError(f"sampler_weights: the band [{low}, {high}] must contain 1 (r = 1 must keep its token)")
    if old_logprobs.shape != sampler_logprobs.shape or old_logprobs.shape != mask.shape or old_logprobs.dim() != 2:
        raise ValueError(f"sampler_weights: old {tuple(old_logprobs.shape)}, sampler "
                         f"{tuple(sampler_logprobs.shape)} and mask {tuple(mask.shape)} must all be the same [B, T]")
    m = mask.bool()
    with torch.no_grad():
        # float64: a geometric mean over thousands of tokens, and r = 1 exactly where the log-probs are equal
        log_r = torch.where(m, old_logprobs.double() - sampler_logprobs.double(), 0.0)   # log r_t
        r = torch.exp(log_r)                                                             # r_t = pi_old / pi_sampler
        if mode == "off":
            w = torch.ones_like(r)
            corrected = torch.zeros_like(m)
        elif mode == "tis":
            w = torch.clamp(r, max=cap)                        # w_t = min(r_t, C)
            corrected = r > cap
        elif mode == "mask_token":
            w = ((r >= low) & (r <= high)).double()            # w_t = 1[low <= r_t <= high]
            corrected = w == 0
        else:  # mask_seq
            n = m.sum(dim=-1, keepdim=True).clamp(min=1)
            geo = torch.exp(log_r.sum(dim=-1, keepdim=True) / n)   # g_i = exp(mean_t log r_t) = (prod_t r_t)^(1/n_i)
            w = ((geo >= low) & (geo <= high)).double().expand_as(r)   # every token of the sequence alike
            corrected = w == 0
        return torch.where(m, w, 0.0).float(), corrected & m


# ----------------------------------------------------------------------------------------------------------------
# Clipped token-level policy loss (section 2.2)

def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.28,
                num_tokens: int | None = None, return_stats: bool = False, weights: torch.Tensor | None = None):
    """L = -(1 / N) * sum over model tokens (i, t) of min(rho * A_i, clip(rho, 1 - clip_low, 1 + clip_high) * A_i),
    rho = exp(logprobs - old_logprobs). No KL, no entropy.

    logprobs [B, T] (with grad), old_logprobs [B, T] (the policy that sampled, no grad), advantages [B] or
    [B, T], mask [B, T] (1/True = a model token; 0 = prompt, tool response, scaffolding, padding).
    Positions where mask is 0 may hold anything, NaN and inf included: they are selected away with
    torch.where (a multiply would give 0 * NaN = NaN) and get exactly zero gradient.

    num_tokens: N, the token count to divide by. Default: the masked tokens of this call. With gradient
    accumulation over micro-batches pass the masked-token count of the whole mini-batch to every call, so the
    summed gradients equal the paper's single token-level mean over the batch (a mean of micro-batch means
    would weigh the tokens of short micro-batches more).
    return_stats: also return {"clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min",
    "ratio_max", "approx_kl", "num_tokens"}, computed over this call's masked tokens.
    weights: [B, T] (sampler_weights; not in the paper), or None: the paper's loss, by the very code of today.
    L = -(1 / N) * sum over model tokens of w_t * min(rho A, clip(rho) A), a constant weight (detached) per token.
    A token of weight 0 (dropped by mask_token / mask_seq) leaves the sum and the count N alike, as in verl and
    slime (TRL keeps it in N): the loss is the mean over the tokens kept, however many the band dropped. (Pass
    num_tokens counted the same way.) With every weight 1 the value and the gradient are bitwise the paper's.
    """
    if logprobs.dim() != 2 or logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(f"policy_loss: logprobs {tuple(logprobs.shape)}, old_logprobs "
                         f"{tuple(old_logprobs.shape)} and mask {tuple(mask.shape)} must all be the same [B, T]")
    if advantages.shape == logprobs.shape[:1]:
        advantages = advantages.unsqueeze(-1)          # [B] -> [B, 1]: one advantage for every token of a sequence
    elif advantages.shape != logprobs.shape:
        raise ValueError(f"policy_loss: advantages {tuple(advantages.shape)} must be [B] or [B, T] "
                         f"for logprobs {tuple(logprobs.shape)}")
    m = mask.bool()
    if weights is not None:
        if weights.shape != logprobs.shape:
            raise ValueError(f"policy_loss: weights {tuple(weights.shape)} must be [B, T] = {tuple(logprobs.shape)}")
        m = m & (weights.detach() > 0)                 # weight 0: the token leaves the mean (N counts the kept)
    count = int(m.sum())
    if num_tokens is None:
        num_tokens = max(count, 1)                     # an all-masked batch gives loss 0, not 0 / 0
    elif num_tokens <= 0:
        raise ValueError(f"policy_loss: num_tokens must be > 0, got {num_tokens}")

    # Log-ratios in float32 (bf16 log-probs would make exp() coarse); masked positions set to 0 before exp.
    log_ratio = torch.where(m, logprobs.float() - old_logprobs.detach().float(), 0.0)
    adv = torch.where(m, advantages.detach().float(), 0.0).expand_as(log_ratio)
    ratio = torch.exp(log_ratio)                                          # rho_t = pi_theta / pi_old
    unclipped = ratio * adv                                               # rho_t * A
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv  # clip(rho_t, 1-eps_low, 1+eps_high) * A
    per_token = -torch.minimum(unclipped, clipped)                        # -min(rho A, clip(rho) A)
    if weights is not None:
        per_token = per_token * torch.where(m, weights.detach().float(), 0.0)   # w_t * -min(rho A, clip(rho) A)
    # Released code: verl's actor loss, which the recipe runs, also applies dual-clip by default (for A < 0 the
    # loss is capped at -3 * A, clip_ratio_c = 3); the paper's objective has no such term and neither has this.
    loss = torch.where(m, per_token, 0.0).sum() / num_tokens             # (1 / N) * sum over model tokens
    if not return_stats:
        return loss

    with torch.no_grad():
        denom = max(count, 1)
        high = m & (adv > 0) & (ratio > 1.0 + clip_high)   # clipped above: this token gets no gradient
        low = m & (adv < 0) & (ratio < 1.0 - clip_low)     # clipped below: likewise
        stats = {
            "clip_frac": float((high | low).sum()) / denom,
            "clip_frac_low": float(low.sum()) / denom,
            "clip_frac_high": float(high.sum()) / denom,
            "ratio_mean": float(torch.where(m, ratio, 0.0).sum()) / denom if count else 1.0,
            "ratio_min": float(ratio[m].min()) if count else 1.0,
            "ratio_max": float(ratio[m].max()) if count else 1.0,
            # k3 estimator of KL(pi_old || pi_theta): mean of (rho - 1) - log rho, >= 0 per token
            "approx_kl": float(torch.where(m, (ratio - 1.0) - log_ratio, 0.0).sum()) / denom,
            "num_tokens": count,
        }
    return loss, stats
