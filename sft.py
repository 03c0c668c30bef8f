"""sft.py - the non-reasoning SFT cold start of rStar2-Agent (arXiv 2508.20722, section 4.1).

Before RL the paper fine-tunes the base model on data that teaches *no* math reasoning: only how to call the
tool (165K function-call examples), how to follow instructions and the answer format (30K instruction-following
examples) and how to chat (27K). Reasoning is left for RL to discover. The data is built locally (nothing is
downloaded) and this module trains on it:

    chores.py (what the examples are about) -> sft_data.py (drafts, real sandbox runs, Trajectories; chat JSONL)
      -> length-bucketed batches -> cross-entropy on loss-mask-1 tokens only -> AdamW, warm-up + cosine
      -> early stop on a held-out SFT loss -> save_pretrained (atomically) for `--stage 1` (rstar2_mini.py)
    a checkpoint every save_every steps (checkpoints.py; the data is kept beside it): a killed SFT, run again
    with the same settings, continues where it was, to the same weights as an uninterrupted run
    hyperparameters: SFTConfig (sft_config.py)

Speed: every generated example starts with the same ~450-token system prompt. `accumulate_gradients` runs that
shared prefix once per batch (batch size 1, with gradient) and lets each example attend to its cached keys/values;
the loss and the gradients are exactly those of the plain padded batch (tests/test_sft.py checks this), at a
fraction of the cost on a CPU. The matmuls run under bf16 autocast over fp32 master weights where the
hardware has bf16 units (a GPU; a CPU with AVX512-BF16 or AMX: a step 1.7x faster, README). Memory: a batch of
8 runs in micro-batches of at most `micro_batch_tokens` padded response tokens whose gradients add up to the
batch's (activations and the 49K-wide logits grow with the micro-batch: whole batches in fp32 peaked at
14.6 GB). Under torchrun the ranks share each batch (distributed.py).

    python sft.py --out runs/sft-probe          # the CPU preset on the bundled SmolLM2-135M-Instruct
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

from checkpoints import latest_checkpoint, load_weights, rng_state, save_checkpoint, save_model, set_rng_state
from distributed import (DIST, all_ranks_sum, clip_gradients, from_rank0, full_state, is_sharded, load_optimizer_state,
                         load_trainer_state, load_weights_from_rank0, my_micro_batches, rank_shares, shard_policy)
from scheduler import Trajectory
from sft_config import SFTConfig
from sft_data import build_sft_examples, load_chat_jsonl

# OpenMP threads that wait for each other sleep instead of spinning. Beside any other busy process (sandbox workers,
# another program) spinning made CPU steps several times slower than their share of the cores (docs/contention.md,
# bench/bench_contention.py). libgomp reads this when torch loads it: nothing above imports torch. An explicit
# OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# ----------------------------------------------------------------------------------------------------------
# Batches and the loss: cross-entropy on model tokens only


def collate(examples: list[Trajectory], pad_id: int) -> dict:
    """Right-padded input_ids, attention_mask, and labels that are -100 wherever loss_mask is 0 (system, user,
    tool tokens) and on padding, so only the model's own tokens are trained on."""
    import torch

    length = max(len(t.input_ids) for t in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), length), dtype=torch.long)
    labels = torch.full((len(examples), length), -100, dtype=torch.long)
    for row, t in enumerate(examples):
        x, m = torch.tensor(t.input_ids), torch.tensor(t.loss_mask)
        ids[row, :len(x)], attn[row, :len(x)] = x, 1
        labels[row, :len(x)] = torch.where(m == 1, x, torch.full_like(x, -100))
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}


def shared_prefix_len(batch: dict) -> int:
    """How many leading tokens can be run once for the whole batch: the common prefix of all rows, kept short of
    the first labeled token (the logit that predicts it must come from the per-example part)."""
    ids, labels = batch["input_ids"], batch["labels"]
    same = (ids == ids[:1]).all(dim=0) & (batch["attention_mask"] == 1).all(dim=0)
    common = int(same.long().cumprod(0).sum())
    labeled = (labels != -100).any(dim=0).nonzero()
    first_label = int(labeled[0]) if len(labeled) else ids.shape[1]
    return max(0, min(common, first_label) - 1)


def batch_loss(model, batch: dict, share_prefix: bool = True, prompt_kv=None, chunk_tokens: int = 0):
    """Summed token cross-entropy over labeled tokens, and their count: logits at t predict the token at t+1.

        CE = sum over labeled t of -log softmax(logits_{t-1})[x_t]

    With share_prefix, the common prompt runs once (batch size 1, with gradient) into a KV cache shared by the
    batch (model.next_token_logits); the rest of each row attends to it. prompt_kv: that prompt's KV computed
    once by the caller for several micro-batches (accumulate_gradients). The log-probs are computed chunk_tokens
    tokens at a time (models.chunked_logprobs; <= 0: all at once), so the 49K-wide logits never exist for more.
    Same loss and gradients as the plain batch, far less work and memory."""
    import model as models

    device = next(model.parameters()).device
    ids, attn, labels = (batch[k].to(device) for k in ("input_ids", "attention_mask", "labels"))
    start = 1 + (shared_prefix_len(batch) if share_prefix else 0)   # logits predict ids[:, start:]
    targets = labels[:, start:]
    labeled = targets != -100   # assistant tokens: the only logits computed (~2/3 of the tokens after the prompt)
    logp = models.next_token_logits(model, ids, attn, start, share_prefix=share_prefix and start >= 16,
                                    keep=labeled, prefix_kv=prompt_kv,
                                    logprobs_of=(targets[labeled], 1.0, chunk_tokens))
    return -logp.sum(), int(labeled.sum())


def batch_prompt(examples: list[Trajectory], pad_id: int) -> list[int]:
    """The tokens every example of the batch starts with, short of the last one before its first labeled token
    (that one runs with each row, for the logit of the first label): what a pass over the batch's micro-batches
    forwards once (models.shared_prompt_kv). Empty when under 16 tokens are shared."""
    p = shared_prefix_len(collate(examples, pad_id)) if len(examples) > 1 else 0
    return examples[0].input_ids[:p] if p >= 16 else []


def my_micro_batches_of(examples: list[Trajectory], max_tokens: int, shared: bool = True) -> list:
    """The examples in micro-batches of at most max_tokens padded forwarded tokens (rows x the longest row among
    them: what activations and logits grow with). shared: the prompt runs once per batch (models.shared_prompt_kv),
    so a row forwards its part after the prompt; else (under torchrun) the whole row, prompt and response: packing
    by response tokens there forwarded 4.5-6K tokens for a batch of short answers (50-69 GiB of activations at
    14B, docs/memory.md). Under torchrun: this rank's token-balanced share, padded with None up to the busiest
    rank's count (an empty pass, distributed.py)."""
    lengths = [len(t.input_ids) - (len(t.prompt_ids) if shared else 0) for t in examples]
    shares = rank_shares(list(range(len(examples))), lengths)
    return [None if mb is None else [examples[i] for i in mb]
            for mb in my_micro_batches(shares, lengths, max_tokens)]


def autocast(model, cfg: SFTConfig):
    """bf16 autocast over the fp32 master weights where cfg.bf16 says so (models.bf16_autocast)."""
    import model as models

    return models.bf16_autocast(model, cfg.bf16)


def accumulate_gradients(model, examples: list[Trajectory], cfg: SFTConfig, pad_id: int) -> float:
    """Gradients of the token-level mean loss over the whole batch, in micro-batches of cfg.micro_batch_tokens:
    L = sum_mb sum_tokens CE / N, N = the batch's model tokens, so splitting changes memory, not the gradient.
    The shared prompt runs once for the batch: the micro-batches attend to its KV and leave their gradients on
    it, and its own backward runs once at the end (models.shared_prompt_kv, backward_through_prompt).
    Under torchrun the ranks split the batch and FSDP averages their gradients: each rank's loss is scaled by
    the number of ranks (every rank forwards whole rows: the same passes whatever its share)."""
    import model as models

    total = sum(sum(t.loss_mask) for t in examples)  # N: every labeled token (a prompt always precedes them)
    share = cfg.share_prefix and DIST.world == 1     # FSDP: the same number of forward passes on every rank
    prompt = batch_prompt(examples, pad_id) if share else []
    with autocast(model, cfg):
        leaves, graph = models.shared_prompt_kv(model, prompt) if prompt else (None, None)
    loss = 0.0
    for micro in my_micro_batches_of(examples, cfg.micro_batch_tokens, shared=share):
        with autocast(model, cfg), models.layers_checkpointed(model, cfg.activation_checkpointing):
            loss_sum, _ = batch_loss(model, collate(micro or examples[:1], pad_id), share, leaves,
                                     cfg.logprob_chunk_tokens)
        if micro is None:
            loss_sum = loss_sum * 0.0  # an empty pass: keeps this rank in step with the others
        (loss_sum * DIST.world / max(1, total)).backward()
        loss += loss_sum.item() / max(1, total)
    if leaves is not None:
        models.backward_through_prompt(leaves, graph)
    return all_ranks_sum([loss])[0]


def length_batches(examples: list, batch_size: int, rng: random.Random) -> list[list]:
    """Batches of similar length (less padding): shuffle, sort within windows of 8 batches, shuffle the batches."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    batches = []
    window = batch_size * 8
    for start in range(0, len(order), window):
        chunk = sorted(order[start:start + window], key=lambda i: len(examples[i].input_ids))
        batches += [[examples[i] for i in chunk[k:k + batch_size]] for k in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def lr_at(step: int, total: int, cfg: SFTConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to cfg.lr * cfg.min_lr_ratio."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def heldout_loss(model, examples: list[Trajectory], cfg: SFTConfig, pad_id: int) -> float:
    """Mean token loss on held-out SFT examples (no gradient)."""
    import torch

    import model as models

    model.eval()
    total, count = 0.0, 0
    share = cfg.share_prefix and DIST.world == 1
    prompt = batch_prompt(examples, pad_id) if share else []
    with torch.no_grad(), autocast(model, cfg):
        prompt_kv = models.shared_prompt_kv(model, prompt)[0] if prompt else None
        for batch in my_micro_batches_of(examples, cfg.micro_batch_tokens, shared=share):
            s, c = batch_loss(model, collate(batch or examples[:1], pad_id), share, prompt_kv, cfg.logprob_chunk_tokens)
            if batch is not None:
                total, count = total + float(s), count + c
    model.train()
    total, count = all_ranks_sum([total, count])
    return total / max(1, count)


# ----------------------------------------------------------------------------------------------------------
# Training


class ResumeMismatch(ValueError):
    """The run directory holds an interrupted SFT with other settings: continuing it would mix two runs."""


def settings_diff(theirs: dict, mine: dict) -> str:
    """The settings that differ between two SFTConfigs, as "name: old -> new" (save_every changes nothing)."""
    def saved(k):   # a setting newer than the saved run: it ran with the setting's default
        return theirs[k] if k in theirs else getattr(SFTConfig.__dataclass_fields__.get(k), "default", None)

    return ", ".join(f"{k}: {saved(k)!r} -> {v!r}" for k, v in sorted(mine.items())
                     if k != "save_every" and json.dumps(saved(k)) != json.dumps(v))


def interrupted_sft(run_dir: Path | None, cfg: SFTConfig) -> tuple[Path | None, dict | None]:
    """The latest checkpoint of an SFT killed in run_dir and its trainer state, or (None, None). Refuses one
    written with other settings or by another number of processes (ResumeMismatch)."""
    ckpt = latest_checkpoint(run_dir) if run_dir is not None else None
    if ckpt is None:
        return None, None
    state = load_trainer_state(ckpt / "trainer_state.pt")   # rank 0 reads it; the optimizer state stays there
    diff = settings_diff(state["config"], asdict(cfg))
    if diff or state["world"] != DIST.world:
        why = diff or f"{state['world']} process(es) -> {DIST.world}"
        raise ResumeMismatch(f"{run_dir} holds an SFT interrupted at step {state['step']} with other settings "
                             f"({why}): run it with those to continue it, or delete {run_dir / 'checkpoints'} "
                             f"to start again")
    return ckpt, state


def sft_data(tokenizer, cfg: SFTConfig, pool, run_dir: Path | None, log) -> tuple[list, list, int]:
    """(train, held-out, number dropped as too long): built on rank 0 (real sandbox runs) and shared with every
    rank. Kept in run_dir/sft_data.pt until the SFT ends, so a continued run trains on exactly the same tokens
    (a second build would differ: the tool responses report measured execution times)."""
    import torch

    lead, saved = DIST.rank == 0, None
    path = run_dir / "sft_data.pt" if run_dir is not None else None
    if lead and path is not None and path.exists():
        saved = torch.load(path, weights_only=False)
        if settings_diff(saved["config"], asdict(cfg)):
            saved = None   # data of other settings (nothing trained on it yet): build anew
        else:
            log(f"[sft] the data built earlier: {path}")
    if lead and saved is None:
        def build(n, seed):
            return build_sft_examples(tokenizer, n, seed, pool, cfg) if n > 0 else []
        train = build(cfg.n_examples, cfg.seed)
        if cfg.data_jsonl:
            train += load_chat_jsonl(cfg.data_jsonl, tokenizer)
        heldout = build(cfg.heldout_examples, cfg.seed + 1_000_003)
        saved = {"config": asdict(cfg), "too_long": sum(len(t.input_ids) > cfg.max_tokens for t in train),
                 "train": [t for t in train if len(t.input_ids) <= cfg.max_tokens],
                 "heldout": [t for t in heldout if len(t.input_ids) <= cfg.max_tokens]}
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(saved, path.with_name(path.name + ".tmp"))
            os.replace(path.with_name(path.name + ".tmp"), path)
    train, heldout, too_long = from_rank0((saved["train"], saved["heldout"], saved["too_long"]) if lead else None)
    return train, heldout, too_long


def run_sft(model, tokenizer, cfg: SFTConfig, out_dir: Path | None, pool=None, log=print,
            run_dir: Path | None = None) -> dict:
    """Non-reasoning SFT in place on `model`; saves model + tokenizer to out_dir (None: no save). Returns metrics
    (JSON-serializable): loss curve, held-out losses, example and token counts, steps, time.

    run_dir (None: nothing is kept on the way): every save_every optimizer steps a checkpoint goes to
    run_dir/checkpoints (checkpoints.py: weights, AdamW state, step, loss history, RNG state), next to the data
    (sft_data.pt). When run_dir holds one, the SFT continues from it: its weights replace the model's, and the
    steps, learning rates and batches are those the interrupted run would have taken. Both are deleted once the
    model is saved to out_dir."""
    import torch
    from tqdm import tqdm

    import model as models

    t0 = time.time()
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    lead = DIST.rank == 0  # under torchrun (distributed.py): rank 0 builds the data, logs and saves
    if not lead:
        log = lambda *_: None  # noqa: E731
    # an interrupted SFT: rank 0 reads its trainer state (the AdamW state stays there, and load_optimizer_state
    # sends each rank its shard) and, for a policy already sharded (sharded_policy_from_rank0), its weights
    ckpt, start = interrupted_sft(run_dir, cfg)
    sharded = DIST.world > 1 and is_sharded(model)
    if ckpt is not None:
        (load_weights_from_rank0 if sharded else load_weights)(model, ckpt)
    if DIST.world > 1 and not sharded:
        model = shard_policy(model, bf16=next(model.parameters()).is_cuda)

    # ---- data: generated chores (real sandbox outputs) + direct answers, optional JSONL chats, held-out set
    train, heldout, too_long = sft_data(tokenizer, cfg, pool, run_dir, log)
    if not train:
        raise ValueError("no SFT examples to train on (n_examples=0 and no data_jsonl, or all over max_tokens)")
    model_tokens = sum(t.num_model_tokens for t in train)
    log(f"[sft] {len(train)} examples ({too_long} over {cfg.max_tokens} tokens dropped), "
        f"{sum(len(t.input_ids) for t in train)} tokens of which {model_tokens} trained on; "
        f"{len(heldout)} held-out; data ready in {time.time() - t0:.0f}s")

    # ---- optimization: AdamW, warm-up + cosine, clip 1.0, early stop on the held-out loss
    batches = [b for _ in range(cfg.epochs) for b in length_batches(train, cfg.batch_size, rng)]
    if cfg.max_steps is not None:
        batches = batches[:cfg.max_steps]
    save_every = cfg.save_every or max(1, math.ceil(len(batches) / 8))
    opt = models.adamw(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    model.train()
    first, losses, evals, earlier_s = 0, [], [], 0.0
    best, bad_evals, stopped_early = float("inf"), 0, False
    if start is not None:  # the interrupted run's counters and randomness; lr_at(step) is the schedule's state
        if start["planned_steps"] != len(batches):
            raise ResumeMismatch(f"{ckpt} planned {start['planned_steps']} steps and this data gives "
                                 f"{len(batches)}: delete {run_dir / 'checkpoints'} to start again")
        load_optimizer_state(model, opt, start["optimizer"])
        first, losses, evals = start["step"], start["losses"], start["heldout_losses"]
        best, bad_evals, earlier_s = start["best"], start["bad_evals"], start["time_s"]
        set_rng_state(start["rng"])
        log(f"[sft] continuing from step {first} of {len(batches)} ({ckpt})")
    elif heldout:
        evals.append((0, heldout_loss(model, heldout, cfg, pad_id)))
        best = evals[-1][1]
    bar = tqdm(total=len(batches), initial=first, desc="sft", unit="step", dynamic_ncols=True, disable=not lead)
    for step in range(first, len(batches)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, len(batches), cfg)
        opt.zero_grad(set_to_none=True)
        loss = accumulate_gradients(model, batches[step], cfg, pad_id)
        grad_norm = clip_gradients(model, cfg.grad_clip)
        opt.step()
        models.release_freed_memory()  # the step's logits and activations, before they fragment the heap
        losses.append(loss)
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", gnorm=f"{grad_norm:.2f}", lr=f"{group['lr']:.1e}")
        if heldout and ((step + 1) % cfg.eval_every == 0 or step + 1 == len(batches)):
            evals.append((step + 1, heldout_loss(model, heldout, cfg, pad_id)))
            log(f"[sft] step {step + 1}/{len(batches)} train loss {losses[-1]:.3f} held-out loss {evals[-1][1]:.3f}")
            if evals[-1][1] < best * (1 - cfg.min_delta):
                best, bad_evals = evals[-1][1], 0
            else:
                bad_evals += 1
                if bad_evals >= cfg.patience and step + 1 < len(batches):
                    stopped_early = True
                    log(f"[sft] early stop: held-out loss has not improved for {cfg.patience} evaluations")
                    break
        if run_dir is not None and (step + 1) % save_every == 0 and step + 1 < len(batches):
            weights, opt_state = full_state(model, opt)  # FSDP: gathered on rank 0 (a collective)
            if lead:
                state = {"step": step + 1, "stage": "sft", "planned_steps": len(batches), "optimizer": opt_state,
                         "losses": losses, "heldout_losses": evals, "best": best, "bad_evals": bad_evals,
                         "rng": rng_state(), "time_s": earlier_s + time.time() - t0, "world": DIST.world,
                         "config": asdict(cfg)}
                save_checkpoint(run_dir, model, tokenizer, state, weights=weights)
            del weights, opt_state
    bar.close()
    model.eval()

    metrics = {"examples": len(train), "heldout_examples": len(heldout), "dropped_too_long": too_long,
               "tokens": sum(len(t.input_ids) for t in train), "model_tokens": model_tokens,
               "steps": len(losses), "planned_steps": len(batches), "stopped_early": stopped_early,
               "losses": losses, "heldout_losses": evals, "final_loss": losses[-1] if losses else None,
               "final_heldout_loss": evals[-1][1] if evals else None,
               "time_s": round(earlier_s + time.time() - t0, 1), "resumed_at_step": first if start else None,
               "config": asdict(cfg)}
    if out_dir is not None:
        weights, _ = full_state(model)  # FSDP: the full weights, gathered on rank 0
        if lead:
            save_model(Path(out_dir), model, tokenizer, weights, json_files={"sft_metrics.json": metrics})
            if run_dir is not None:  # the model is saved: what a continued run would need is not
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
                (run_dir / "sft_data.pt").unlink(missing_ok=True)
        metrics["out_dir"] = str(out_dir)
        log(f"[sft] saved to {out_dir} after {metrics['time_s']:.0f}s")
    return metrics


# ----------------------------------------------------------------------------------------------------------
# Command line: python sft.py --out DIR [--model PATH] [--n-examples N] [--show K]


def main() -> None:
    import model as models
    from sandbox import SandboxUnavailable

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL, help="bundled smollm2-135m or a HF model directory")
    ap.add_argument("--out", default="runs/sft/model", help="where the SFT checkpoint is saved (a killed run's "
                    "checkpoints go to its parent folder, and the same command continues from them)")
    ap.add_argument("--show", type=int, default=0, help="only print K generated examples and exit")
    for f in SFTConfig.__dataclass_fields__.values():
        if f.type in ("int", "float", "str", "str | None", "int | None", "float | None"):
            kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(f.type, str)
            ap.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default, help=f"default {f.default}")
    args = ap.parse_args()
    try:
        cfg = SFTConfig(**{k: v for k, v in vars(args).items() if k in SFTConfig.__dataclass_fields__})
    except ValueError as e:
        ap.error(str(e))   # usage, the message, exit 2
    out = Path(args.out)  # checkpoints of a run in progress: next to it, in out/../checkpoints
    try:
        path = models.resolve_model(args.model)
        tokenizer = models.load_tokenizer(path)
        if args.show:
            for t in build_sft_examples(tokenizer, args.show, cfg.seed, cfg=cfg):
                print(f"===== {t.problem_id} ({len(t.input_ids)} tokens)\n{t.response_text}\n")
            return
        metrics = run_sft(models.load_model(path), tokenizer, cfg, out, run_dir=out.parent)
    except (ResumeMismatch, models.ModelUnavailable, SandboxUnavailable) as e:  # what a person can act on
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"interrupted: the same command continues from the latest checkpoint in {out.parent / 'checkpoints'}",
              file=sys.stderr)
        sys.exit(130)
    print(json.dumps({k: v for k, v in metrics.items() if k not in ("losses", "config")}))


if __name__ == "__main__":
    main()
