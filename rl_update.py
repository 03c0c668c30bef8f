"""rl_update.py - the policy update of one RL step (arXiv 2508.20722, section 2.2): old log-probs, then the
clipped token-level loss of GRPO-RoC over mini-batches, and the check that the engine and the trainer agree.

    kept trajectories [(trajectory, advantage)] from rstar2_mini.select_step_batch (after RoC, grpo_roc.py)
      -> token_logprobs: log pi(x_t | x_<t) of every model token, by absolute position in its trajectory
      -> pi_old: one no-grad pass (engine_trainer_mismatch compares it with the engine's sampling log-probs)
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
                   masks: list[list[int]] | None = None, prefix_kv=None):
    """log pi(x_t | x_<t) at temperature T, by absolute position: logprobs [B, L], logprobs[b, t] is the log-probability
    of seqs[b][t] given seqs[b][:t] (log_softmax(logits / temperature)), for every t >= 1 that is a real token;
    zero at t = 0 and on padding. masks (the loss masks, 1 = model token): only those tokens' logits are computed
    (the tool responses need no 49K-wide vocabulary projection), the rest are zero too.

    The values do not depend on how the rows are packed: the shared prefix (run once) ends before the first
    wanted token of every row (shared_prefix_length), so two passes over the same trajectory in different
    micro-batches give the same numbers to float rounding. share_prefix=False forwards the prefix with every row
    (one forward pass whatever the data: what FSDP's ranks need). prefix_kv: the KV of the rows' first tokens
    (shared_prompt_kv), computed once for several calls."""
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
    logits = models.next_token_logits(model, ids, mask, P, share_prefix, keep=keep[:, P:],
                                      prefix_kv=prefix_kv).float()  # [keep.sum(), V]
    kept = torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids[keep].unsqueeze(-1)).squeeze(-1)
    return torch.zeros(B, L, dtype=kept.dtype, device=device).masked_scatter(keep, kept)


def shared_prompt_kv(model, prompt: list[int]):
    """The system prompt once for a whole pass over the trajectories, instead of once per micro-batch: the KV of
    the first p tokens that every trajectory shares (policy_update: p = shared_prefix_length - 1, so the last
    shared token still runs with each row). Returns (kv for the micro-batches, kv with the graph or None).

    With grad, the micro-batches attend to detached copies (leaves) of the prompt's KV: each backward adds dL/dKV
    into their .grad, and backward_through_prompt then runs the prompt's own backward once with the sum. By the
    chain rule that is the gradient of the loss through a full forward of every row (tests/test_trainer.py)."""
    import torch

    import model as models

    graph = models.prefix_cache(model, torch.tensor([prompt], device=next(model.parameters()).device))
    if not torch.is_grad_enabled():
        return graph, None
    return [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in graph], graph


def backward_through_prompt(leaves, graph) -> None:
    """The prompt's backward, once, with the gradients the micro-batches left on its KV (shared_prompt_kv)."""
    import torch

    pairs = [(g, leaf.grad) for gl, ll in zip(graph, leaves) for g, leaf in zip(gl, ll) if leaf.grad is not None]
    if pairs:
        torch.autograd.backward([g for g, _ in pairs], [d for _, d in pairs])


# ----------------------------------------------------------------------------------------------------------
# The update


def bf16_option(cfg: Config) -> bool | None:
    """cfg.precision as models.bf16_autocast / models.engine_dtype take it: None = decide by the hardware."""
    return {"auto": None, "fp32": False, "bf16": True}[cfg.precision]


def policy_update(rt: Runtime, cfg: Config, optimizer, scheduler_lr, kept, rng: random.Random,
                  loss_sign: float = 1.0) -> dict:
    """Old log-probs, then `minibatches` optimizer steps of the clipped token-level loss (paper eq. in grpo_roc).

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
        if mb is None:
            return token_logprobs(model, [seqs[0][:2]], cfg.temperature, share_prefix=world == 1)
        return token_logprobs(model, [seqs[i] for i in mb], cfg.temperature, share_prefix=world == 1,
                              masks=[masks[i] for i in mb], prefix_kv=prompt_kv)  # only model tokens enter the loss

    # One process: the system prompt runs once a pass (shared_prompt_kv), and micro-batches are packed by the
    # tokens they forward themselves. (FSDP ranks forward whole rows: one pass whatever the data.)
    p = shared_prefix_length(seqs, masks) - 1 if world == 1 and len(seqs) > 1 else 0
    p = p if p >= 16 else 0
    own = [n - p for n in lengths]

    order = list(range(len(seqs)))
    rng.shuffle(order)
    chunks = [order[k::cfg.minibatches] for k in range(cfg.minibatches)]
    shares = [rank_shares(chunk, lengths) for chunk in chunks]  # shares[chunk][rank]: that rank's items

    # Old log-probs pi_old, one per token position of each trajectory: recomputed by the trainer (not taken from
    # the engine) so that rho = 1 exactly at the first update whatever the engine's numerics. The pass forwards
    # the very micro-batches the update will (same rows, same padding): in fp32 any packing gives the same
    # numbers to rounding, but under bf16 autocast a row packed differently rounds differently (|rho - 1| up to
    # 5e-4 at lr = 0 on the tiny test model).
    old = [None] * len(seqs)
    model.eval()
    with torch.no_grad(), autocast():
        prompt_kv = shared_prompt_kv(model, seqs[0][:p])[0] if p else None
        for share in shares:
            for mb in my_micro_batches(share, own, cfg.micro_batch_tokens):
                logp = logprobs(mb, prompt_kv)   # (mb None: an empty pass, FSDP's collectives need it)
                for row, i in enumerate(mb or []):
                    old[i] = logp[row, : lengths[i]].clone()
    model.train()
    mismatch = engine_trainer_mismatch([t for t, _ in kept], old, masks)

    losses, clip_fracs, grad_norms, tokens, loss_tokens = [], [], [], 0, 0
    ratio_min, ratio_max = float("inf"), float("-inf")
    for chunk, share in zip(chunks, shares):
        if not chunk:
            continue
        # the token-level mean runs over every model token of the mini-batch, across micro-batches and ranks
        n_tokens = sum(sum(masks[i]) for i in chunk)
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
                old_lp[row, : lengths[i]] = old[i]
                mask[row, : lengths[i]] = torch.tensor(masks[i], dtype=logp.dtype)
            adv = torch.tensor([advs[i] for i in mb], dtype=logp.dtype, device=logp.device)
            loss, st = grpo_roc.policy_loss(logp, old_lp, adv, mask, cfg.clip_low, cfg.clip_high,
                                            num_tokens=n_tokens, return_stats=True)
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
        optimizer.step()
        scheduler_lr.step()
        losses.append(loss_total)
        clip_fracs.append(clipped / max(n_tokens, 1))
        grad_norms.append(grad_norm)
        tokens += sum(lengths[i] for i in chunk)
        loss_tokens += int(counted)
    ratio_min, ratio_max = -all_ranks_max([-ratio_min])[0], all_ranks_max([ratio_max])[0]
    return {"loss": sum(losses) / len(losses) if losses else None,
            "clip_frac": sum(clip_fracs) / len(clip_fracs) if clip_fracs else None,
            "grad_norm": max(grad_norms) if grad_norms else None,
            "ratio_min": ratio_min if losses else None, "ratio_max": ratio_max if losses else None,
            "train_tokens": tokens, "loss_tokens": loss_tokens, "lr": scheduler_lr.get_last_lr()[0], **mismatch}


def engine_trainer_mismatch(trajs, old, masks) -> dict:
    """|log pi_engine - log pi_old| over the model tokens of the trajectories this rank recomputed (as verl and TRL
    log it): the sampler's log-probs against the trainer's for the same tokens. The CPU engine runs the same
    weights in the same precision, so the mean must be ~0 there; a jump means the two disagree about the policy
    (a packing bug, a missed weight sync, a precision gap)."""
    import torch

    total, count, worst = 0.0, 0, 0.0
    for t, o, m in zip(trajs, old, masks):
        if o is None:   # another rank's trajectory
            continue
        engine = [lp for s in t.segments if s.loss_mask for lp in (s.logprobs or [])]
        trainer = o[torch.tensor(m, dtype=torch.bool, device=o.device)]
        if len(engine) != len(trainer):   # a trajectory not sampled by an engine (SFT data, a test batch)
            continue
        if not engine:
            continue
        diff = (torch.tensor(engine, dtype=torch.float64) - trainer.double().cpu()).abs()
        total, count, worst = total + float(diff.sum()), count + len(diff), max(worst, float(diff.max()))
    total, count = all_ranks_sum([total, count])
    worst = all_ranks_max([worst])[0]
    return {"logprob_diff_mean": total / count if count else None, "logprob_diff_max": worst if count else None}
