"""rl_update.py - the policy update of one RL step (arXiv 2508.20722, section 2.2): old log-probs, then the
clipped token-level loss of GRPO-RoC over mini-batches, and the check that the engine and the trainer agree.

    kept trajectories [(trajectory, advantage)] from rstar2_mini.select_step_batch (after RoC, grpo_roc.py)
      -> token_logprobs: log pi(x_t | x_<t) of every model token, by absolute position in its trajectory
      -> pi_old: the first mini-batch's own forward, a no-grad pass for the later ones (engine_trainer_mismatch
         compares it with the engine's sampling log-probs)
      -> `minibatches` optimizer steps: micro-batches of log pi -> grpo_roc.policy_loss -> backward -> AdamW
      -> the numbers of the update for metrics.jsonl (rstar2_mini.log_step); new weights go to the engines

Log-probs do not depend on how the trajectories are packed into micro-batches: the shared system prompt is
forwarded once per pass (shared_prompt_kv; its gradient flows back once, backward_through_prompt) and always
ends before the first model token of every row. So with lr = 0 every importance ratio is exactly 1 and nothing
is clipped (tests/test_trainer.py checks it, and that the gradient equals the paper's loss written out on each
trajectory's own full forward). On CPUs with bf16 units the passes run under bf16 autocast (cfg.precision); the
pi_old pass then forwards the same micro-batches as the update, so bf16 rounds both alike and rho stays 1.
Under torchrun (distributed.py) every rank runs policy_update on the same batch and takes its share of it.
"""
from __future__ import annotations

import random

from config import Config, Runtime
from distributed import DIST, all_ranks_max, all_ranks_sum, clip_gradients, my_micro_batches, rank_shares
from model import backward_through_prompt, shared_prompt_kv


# ----------------------------------------------------------------------------------------------------------
# Log-probabilities of trajectories, with the shared system prompt computed once.
#
# Every trajectory starts with the same ~450-token system prompt (the paper's prompt + the tool schema), often
# longer than the response of a small model. The prompt is forwarded once (with gradient), its KV cache is
# expanded (a view, not a copy) to the micro-batch, and only the rest of each sequence is forwarded
# (model.next_token_logits). The result equals a full forward exactly: gradients flow into the prefix.
# policy_update goes one further: one forward of the prompt serves every micro-batch of a pass.


def shared_prefix_length(seqs: list[list[int]], masks: list[list[int]] | None = None) -> int:
    """P: how many leading tokens the rows share and that need no log-prob of their own, so that the shared part
    can run once (model.next_token_logits): the longest common prefix, capped at the first token whose log-prob is
    wanted in every row (its first model token, mask 1; without masks every token but the first) and at len - 1.
    Capping at the first model token is what keeps a rollout's own response out of the "prompt": two rollouts
    that both begin with "<reason>", or a micro-batch of one row, still get every model token's log-prob."""
    if masks is None:
        return 1
    n = min(len(s) for s in seqs) - 1
    for m in masks:
        n = min(n, m.index(1) if 1 in m else len(m))
    first = seqs[0]
    for s in seqs[1:]:
        k = 0
        while k < n and s[k] == first[k]:
            k += 1
        n = k
    return max(n, 1)


def token_logprobs(model, seqs: list[list[int]], temperature: float = 1.0, share_prefix: bool = True,
                   masks: list[list[int]] | None = None, prefix_kv=None, chunk_tokens: int = 1024,
                   checkpoint_layers: bool = False):
    """log pi(x_t | x_<t) at temperature T, by absolute position: logprobs [B, L], logprobs[b, t] is the log-probability
    of seqs[b][t] given seqs[b][:t] (log_softmax(logits / temperature)), for every t >= 1 that is a real token;
    zero at t = 0 and on padding. masks (the loss masks, 1 = model token): only those tokens' logits are computed
    (the tool responses need no 49K-wide vocabulary projection), the rest are zero too.

    The values do not depend on how the rows are packed: the shared prefix (run once) ends before the first
    wanted token of every row (shared_prefix_length), so two passes over the same trajectory in different
    micro-batches give the same numbers to float rounding. share_prefix=False forwards the prefix with every row
    (one forward pass whatever the data: what FSDP's ranks need). prefix_kv: the KV of the rows' first tokens
    (shared_prompt_kv), computed once for several calls.

    Memory (memory_plan.py): the kept tokens' log-probs are computed chunk_tokens at a time (cfg.logprob_chunk_tokens;
    <= 0: all at once), so the vocabulary-wide logits exist for one chunk only, in forward and backward
    (models.chunked_logprobs); checkpoint_layers (cfg.activation_checkpointing) keeps one hidden state per decoder
    layer and token for backward instead of all its activations (models.layers_checkpointed). Neither changes a
    value or a gradient (tests/test_memory_plan.py)."""
    import torch

    import model as models

    device = next(model.parameters()).device
    P = shared_prefix_length(seqs, masks)
    B, L = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(B, L, dtype=torch.long, device=device)
    mask = torch.zeros(B, L, dtype=torch.long, device=device)
    keep = torch.zeros(B, L, dtype=torch.bool, device=device)   # the tokens whose log-prob is computed
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s, device=device)
        mask[b, :len(s)] = 1
        keep[b, 1:len(s)] = True if masks is None else torch.tensor(masks[b][1:], device=device) == 1
    keep[:, :P] = False   # (P never passes a wanted token: nothing is lost here)
    with models.layers_checkpointed(model, checkpoint_layers):   # log_softmax(logits / T)[x_t], [keep.sum()]
        kept = models.next_token_logits(model, ids, mask, P, share_prefix, keep=keep[:, P:], prefix_kv=prefix_kv,
                                         logprobs_of=(ids[keep], temperature, chunk_tokens))
    return torch.zeros(B, L, dtype=kept.dtype, device=device).masked_scatter(keep, kept)


# ----------------------------------------------------------------------------------------------------------
# The update


def bf16_option(cfg: Config) -> bool | None:
    """cfg.precision as models.bf16_autocast / models.engine_dtype take it: None = decide by the hardware."""
    return {"auto": None, "fp32": False, "bf16": True}[cfg.precision]


def policy_update(rt: Runtime, cfg: Config, optimizer, scheduler_lr, kept, rng: random.Random,
                  loss_sign: float = 1.0) -> dict:
    """Old log-probs, then `minibatches` optimizer steps of the clipped token-level loss (paper eq. in grpo_roc).
    pi_old of the first mini-batch is its own forward before the step (one pass fewer; with one mini-batch, the
    paper's setting, the update forwards each token once).

    Log-probs live by absolute position in each trajectory (token_logprobs): with lr = 0 every ratio is 1 and
    nothing is clipped (a test checks, in fp32 and bf16).
    Under torchrun every rank runs this with the same `kept` and `rng` (broadcast by rank 0) and takes its share
    of each mini-batch (rank_shares); FSDP sums the gradients of all ranks into every shard."""
    import torch

    import grpo_roc
    import model as models

    model, world = rt.model, DIST.world  # world > 1 under torchrun (distributed.py)
    seqs = [t.input_ids for t, _ in kept]
    masks = [t.loss_mask for t, _ in kept]
    advs = [a for _, a in kept]
    lengths = [len(s) for s in seqs]
    backward = rt.accelerator.backward if rt.accelerator is not None else torch.Tensor.backward
    # CPU: the forward passes under bf16 autocast where cfg.precision says so (weights, loss and optimizer stay
    # fp32); GPU: accelerate (or FSDP's mixed-precision policy) autocasts already.
    bf16 = bf16_option(cfg) if rt.accelerator is None and world == 1 else False

    def autocast():
        return models.bf16_autocast(model, bf16)

    def logprobs(mb, prompt_kv=None):
        """log pi [rows, L] for a micro-batch; None is a rank's empty pass (distributed.my_micro_batches)."""
        memory = dict(chunk_tokens=cfg.logprob_chunk_tokens, checkpoint_layers=cfg.activation_checkpointing)
        if mb is None:
            return token_logprobs(model, [seqs[0][:2]], cfg.temperature, share_prefix=world == 1, **memory)
        return token_logprobs(model, [seqs[i] for i in mb], cfg.temperature, share_prefix=world == 1,
                              masks=[masks[i] for i in mb], prefix_kv=prompt_kv, **memory)  # only model tokens: loss

    # One process: the system prompt runs once a pass (shared_prompt_kv), and micro-batches are packed by the
    # tokens they forward themselves. (FSDP ranks forward whole rows: one pass whatever the data.)
    p = shared_prefix_length(seqs, masks) - 1 if world == 1 and len(seqs) > 1 else 0
    p = p if p >= 16 else 0
    own = [n - p for n in lengths]

    order = list(range(len(seqs)))
    rng.shuffle(order)
    chunks = [order[k::cfg.minibatches] for k in range(cfg.minibatches)]
    shares = [rank_shares(chunk, lengths) for chunk in chunks]  # shares[chunk][rank]: that rank's items

    # Off-policy correction for the sampler/trainer gap (not in the paper; grpo_roc.sampler_weights, docs/design.md):
    # each model token's weight w_t from r_t = pi_old / pi_sampler, pi_sampler the engine's log-prob stored in the
    # trajectory. Off, or a trajectory without engine log-probs (SFT data, a test batch): weight None, the paper's
    # loss by the very code of today. Every rank decides the mode alike (sampler_correction_mode).
    correction = sampler_correction_mode(cfg, next(model.parameters()).device.type)
    weights, corrected = [None] * len(seqs), [None] * len(seqs)

    def correct(i):
        """Row i's correction weights, from its pi_old and the engine's log-probs."""
        t = kept[i][0]
        engine = engine_logprobs_at(t, old[i], masks[i]) if correction != "off" and old[i] is not None else None
        if engine is not None:
            m_i = torch.tensor(masks[i], device=old[i].device)[None]
            w, c = grpo_roc.sampler_weights(old[i][None], engine.to(old[i].device)[None], m_i, correction,
                                            cfg.sampler_cap, cfg.sampler_mask_low, cfg.sampler_mask_high)
            weights[i], corrected[i] = w[0], c[0]

    # Old log-probs pi_old, one per token position of each trajectory: recomputed by the trainer (not taken from
    # the engine) so that rho = 1 exactly at the first update whatever the engine's numerics. Before the first
    # optimizer step the weights are pi_old's, so the first mini-batch's own forward is its rows' pi_old
    # (old = log pi.detach(): rho = 1 bitwise, and a forward pass saved); only the later mini-batches' rows get a
    # no-grad pass first. That pass forwards the very micro-batches the update will (same rows, same padding): in
    # fp32 any packing gives the same numbers to rounding, but under bf16 autocast a row packed differently rounds
    # differently (|rho - 1| up to 5e-4 at lr = 0 on the tiny test model). mask_token / mask_seq count the tokens
    # they keep over a whole mini-batch before its loss, so they take every row's pi_old from the pass.
    from_update = correction not in ("mask_token", "mask_seq")
    old = [None] * len(seqs)
    model.eval()
    with torch.no_grad(), autocast():
        passes = shares[1:] if from_update else shares
        prompt_kv = shared_prompt_kv(model, seqs[0][:p])[0] if p and any(passes) else None
        for share in passes:
            for mb in my_micro_batches(share, own, cfg.micro_batch_tokens):
                logp = logprobs(mb, prompt_kv)   # (mb None: an empty pass, FSDP's collectives need it)
                for row, i in enumerate(mb or []):
                    old[i] = logp[row, : lengths[i]].clone()
    model.train()
    for i in range(len(seqs)):
        correct(i)
    # N of the token-level mean, per trajectory: its model tokens; with mask_token / mask_seq only those kept (a
    # dropped token leaves the sum and N alike, as in verl and slime: grpo_roc.policy_loss). Each rank knows the
    # weights of its own rows only, so the counts are summed over ranks (0 from the ranks that lack the row).
    n_kept = [sum(m) for m in masks]
    if correction in ("mask_token", "mask_seq"):
        n_kept = [int(x) for x in all_ranks_sum([
            float((weights[i] > 0).sum()) if weights[i] is not None else float(n_kept[i]) if old[i] is not None
            else 0.0 for i in range(len(seqs))])]

    losses, clip_fracs, grad_norms, tokens, loss_tokens = [], [], [], 0, 0
    rates = []  # the learning rate each optimizer step takes (the schedule moves on after it)
    ratio_min, ratio_max = float("inf"), float("-inf")
    for chunk, share in zip(chunks, shares):
        if not chunk:
            continue
        # the token-level mean runs over every model token of the mini-batch, across micro-batches and ranks
        n_tokens = sum(n_kept[i] for i in chunk)
        optimizer.zero_grad(set_to_none=True)
        loss_total, clipped, counted = 0.0, 0.0, 0
        with autocast():
            leaves, graph = shared_prompt_kv(model, seqs[0][:p]) if p else (None, None)
        for mb in my_micro_batches(share, own, cfg.micro_batch_tokens):
            with autocast():
                logp = logprobs(mb, leaves)
            if mb is None:
                backward(logp.sum() * 0.0)  # no items left on this rank: a zero gradient, the collectives in step
                continue
            old_lp, mask = torch.zeros_like(logp), torch.zeros_like(logp)
            for row, i in enumerate(mb):   # the same absolute positions as the old pass
                if old[i] is None:         # the first mini-batch: pi_old is this forward, before any step
                    old[i] = logp[row, : lengths[i]].detach().clone()
                    correct(i)
                old_lp[row, : lengths[i]] = old[i]
                mask[row, : lengths[i]] = torch.tensor(masks[i], dtype=logp.dtype)
            adv = torch.tensor([advs[i] for i in mb], dtype=logp.dtype, device=logp.device)
            w_mb = None   # the correction's weights (rows without engine log-probs: 1); None = the paper's loss
            if correction != "off":
                w_mb = torch.ones_like(logp)
                for row, i in enumerate(mb):
                    if weights[i] is not None:
                        w_mb[row, : lengths[i]] = weights[i]
            loss, st = grpo_roc.policy_loss(logp, old_lp, adv, mask, cfg.clip_low, cfg.clip_high,
                                            num_tokens=max(n_tokens, 1), return_stats=True, weights=w_mb)
            loss = loss_sign * loss
            backward(loss * world)  # FSDP averages the ranks' gradients; the loss is their sum
            loss_total += loss.item()
            clipped += st["clip_frac"] * st["num_tokens"]
            counted += st["num_tokens"]
            ratio_min, ratio_max = min(ratio_min, st["ratio_min"]), max(ratio_max, st["ratio_max"])
        if p:
            backward_through_prompt(leaves, graph)
        loss_total, clipped, counted = all_ranks_sum([loss_total, clipped, counted])
        grad_norm = clip_gradients(model, cfg.grad_clip)
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler_lr.step()
        losses.append(loss_total)
        clip_fracs.append(clipped / max(n_tokens, 1))
        grad_norms.append(grad_norm)
        tokens += sum(lengths[i] for i in chunk)
        loss_tokens += int(counted)
    ratio_min, ratio_max = -all_ranks_max([-ratio_min])[0], all_ranks_max([ratio_max])[0]
    mismatch = engine_trainer_mismatch([t for t, _ in kept], old, masks, weights, corrected)
    return {"loss": sum(losses) / len(losses) if losses else None,
            "clip_frac": sum(clip_fracs) / len(clip_fracs) if clip_fracs else None,
            "grad_norm": max(grad_norms) if grad_norms else None,
            "ratio_min": ratio_min if losses else None, "ratio_max": ratio_max if losses else None,
            # lr: the rate of the update's first optimizer step (read after them, the schedule gave the next step's)
            "train_tokens": tokens, "loss_tokens": loss_tokens, "lr": rates[0] if rates else None,
            "sampler_correction": correction, **mismatch}


def sampler_correction_mode(cfg: Config, device: str) -> str:
    """cfg.sampler_correction, "auto" resolved: tis where the engine that samples differs from the trainer that
    recomputes pi_old in precision or code, off where both run the same fp32 code. From the configuration and the
    device alone (rank 0 holds the engines), so every rank decides alike:
      GPU: vLLM engines (or a bf16 engine copy) against a trainer under bf16 autocast -> tis
      CPU, engine=vllm: vLLM's own kernels, whatever the dtype -> tis
      CPU, our engine: a bf16 copy (models.engine_dtype: precision bf16, or auto with bf16 units) against fp32
      masters under bf16 autocast -> tis; an fp32 copy: the trainer runs fp32 too (cfg.precision decides both)
      -> off, and the loss is the paper's exactly."""
    import torch

    import grpo_roc
    import model as models

    mode = cfg.sampler_correction
    if mode not in ("auto", *grpo_roc.SAMPLER_CORRECTIONS):
        raise ValueError(f"sampler_correction={mode!r}: choose auto, {', '.join(grpo_roc.SAMPLER_CORRECTIONS)}")
    if mode != "auto":
        return mode
    if device != "cpu" or cfg.engine == "vllm":
        return "tis"
    return "tis" if models.engine_dtype(bf16_option(cfg), device) == torch.bfloat16 else "off"


def engine_logprobs_at(traj, old, mask):
    """The engine's sampling log-probs of a trajectory's model tokens at their absolute positions (float64, zero
    elsewhere, shaped like its pi_old `old`), or None when the engine did not give one for every model token (SFT
    data, a test batch)."""
    import torch

    engine = [lp for s in traj.segments if s.loss_mask for lp in (s.logprobs or [])]
    keep = torch.tensor(mask, dtype=torch.bool)
    if not engine or len(engine) != int(keep.sum()):
        return None
    out = torch.zeros(old.shape, dtype=torch.float64)
    out[keep] = torch.tensor(engine, dtype=torch.float64)
    return out


def engine_trainer_mismatch(trajs, old, masks, weights=None, corrected=None) -> dict:
    """The gap between the sampler and the trainer over the model tokens of the trajectories this rank recomputed,
    with r_t = pi_old(t) / pi_sampler(t), the trainer's recomputation against the engine's sampling log-prob:
      logprob_diff_mean, logprob_diff_max: |log r_t| (as verl and TRL log it)
      mismatch_k3: mean of r_t - 1 - log r_t (>= 0 per token). The tokens were drawn from pi_sampler, so this
                   estimates KL(pi_sampler || pi_old): E_sampler[r] = 1 (r is a likelihood ratio under the
                   sampler), so E_sampler[r - 1 - log r] = E_sampler[log pi_sampler - log pi_old]. The other
                   direction would need samples of pi_old, which the batch does not hold.
      mismatch_ess: (sum r)^2 / (N sum r^2), the normalized effective sample size of the plain ratios: 1 = on
                   policy; what the batch is worth as samples of pi_old.
      is_ess, is_corrected_frac (None with the correction off): the same ESS of the weights w_t the loss used
                   (weights, from grpo_roc.sampler_weights), and the share of the tokens it truncated or masked
                   (corrected), both over the tokens before masking (a masked token counts, with w = 0).
    Our CPU engine in fp32 runs the trainer's weights and code, so the gap must be ~0 there; a jump means the two
    disagree about the policy (a packing bug, a missed weight sync, a precision gap)."""
    import torch

    total, count, worst, k3, sum_r, sum_r2, sum_w, sum_w2, n_w, n_corr = 0.0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0
    for i, (t, o, m) in enumerate(zip(trajs, old, masks)):
        if o is None:   # another rank's trajectory
            continue
        engine = engine_logprobs_at(t, o, m)
        if engine is None:   # a trajectory not sampled by an engine (SFT data, a test batch)
            continue
        keep = torch.tensor(m, dtype=torch.bool)
        log_r = o.detach().double().cpu()[keep] - engine[keep]   # log r_t = log pi_old - log pi_sampler
        r = torch.exp(log_r)
        diff = log_r.abs()
        total, count, worst = total + float(diff.sum()), count + len(diff), max(worst, float(diff.max()))
        k3 += float((r - 1.0 - log_r).sum())                      # k3_t = r_t - 1 - log r_t
        sum_r, sum_r2 = sum_r + float(r.sum()), sum_r2 + float((r * r).sum())
        if weights is not None and weights[i] is not None:
            w = weights[i].detach().double().cpu()[keep]
            sum_w, sum_w2, n_w = sum_w + float(w.sum()), sum_w2 + float((w * w).sum()), n_w + len(w)
            n_corr += int(corrected[i].cpu()[keep].sum())
    total, count, k3, sum_r, sum_r2, sum_w, sum_w2, n_w, n_corr = all_ranks_sum(
        [total, count, k3, sum_r, sum_r2, sum_w, sum_w2, n_w, n_corr])
    worst = all_ranks_max([worst])[0]

    def ess(s, s2, n):   # (sum w)^2 / (N sum w^2), in (0, 1]; 0 when every weight is 0
        return s * s / (n * s2) if s2 > 0 else 0.0

    return {"logprob_diff_mean": total / count if count else None, "logprob_diff_max": worst if count else None,
            "mismatch_k3": k3 / count if count else None,
            "mismatch_ess": ess(sum_r, sum_r2, count) if count else None,
            "is_ess": ess(sum_w, sum_w2, n_w) if n_w else None,
            "is_corrected_frac": n_corr / n_w if n_w else None}
