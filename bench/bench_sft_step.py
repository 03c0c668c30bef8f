"""Benchmark the SFT step (sft.py) on the bundled model: the vocabulary projection restricted to labeled tokens
against the plain one that projects every position, in one run.

SmolLM2's output projection maps each hidden state to 49,152 logits: about a fifth of the model's forward
FLOPs per token, and the largest tensors of a step (the logits, their fp32 copy for the loss, their gradient).
sft.batch_loss asks model.next_token_logits for the logits of labeled (assistant) tokens only; the baseline here
is the same loss computed from every position's logits, as before (the answer is the same: test_sft checks it).

Over the first K batches of the CPU preset's data, with the steps exactly as sft.run_sft takes them
(micro-batches, bf16 autocast where the CPU has bf16 units, clip, AdamW):
  timing   one process runs both variants' forward and backward passes on every batch, in alternating order
           (a slow spell of a shared host hits both), then one optimizer step; the first batch is a warm-up
  memory   each variant alone in a child process of its own: its peak resident memory, and its losses

    python bench/bench_sft_step.py              # 6 batches of 8 examples (about 7 minutes on 2 cores)
    python bench/bench_sft_step.py --steps 10

The last line printed is one JSON object: mean forward + backward seconds per batch of each variant, speed-up =
baseline / labeled-only, peak resident memory of each, and the largest loss difference (bf16 rounding).
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import model as models  # noqa: E402
import sft  # noqa: E402


def every_position_loss(model, batch: dict, share_prefix: bool = True):
    """The baseline: sft.batch_loss as it was, projecting every position after the shared prefix."""
    import torch.nn.functional as F

    ids, attn, labels = (batch[k] for k in ("input_ids", "attention_mask", "labels"))
    start = 1 + (sft.shared_prefix_len(batch) if share_prefix else 0)
    logits = models.next_token_logits(model, ids, attn, start, share_prefix=share_prefix and start >= 16)
    targets = labels[:, start:]
    loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
    return loss_sum, int((targets != -100).sum())


def setup(n_examples: int, steps: int):
    """The bundled model, the CPU preset's config, its first `steps` batches, and AdamW."""
    import torch

    path = models.resolve_model(models.DEFAULT_MODEL)
    model, tokenizer = models.load_model(path), models.load_tokenizer(path)
    cfg = sft.SFTConfig(n_examples=n_examples)
    examples = sft.build_sft_examples(tokenizer, n_examples, cfg.seed, None, cfg)  # a private sandbox pool
    batches = sft.length_batches(examples, cfg.batch_size, random.Random(cfg.seed))[:steps]
    torch.manual_seed(0)
    model.train()
    return model, tokenizer.pad_token_id, cfg, batches, torch.optim.AdamW(model.parameters(), lr=cfg.lr,
                                                                          betas=cfg.betas)


def gradients(model, batch, cfg, pad_id, variant: str) -> tuple[float, float]:
    """One step's forward and backward passes (sft.accumulate_gradients) with one loss; (loss, seconds)."""
    sft.batch_loss = LOSSES[variant]  # accumulate_gradients calls it through the module
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss = sft.accumulate_gradients(model, batch, cfg, pad_id)
    return loss, time.perf_counter() - t0


def optimizer_step(model, opt, cfg) -> None:
    import torch

    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    models.release_freed_memory()


def memory_child(variant: str, steps: int, n_examples: int) -> dict:
    """K SFT steps with one variant only, in a process of its own: its peak resident memory and losses."""
    model, pad_id, cfg, batches, opt = setup(n_examples, steps)
    losses = []
    for batch in batches:
        losses.append(gradients(model, batch, cfg, pad_id, variant)[0])
        optimizer_step(model, opt, cfg)
        print(f"[memory, {variant}] step {len(losses)}: loss {losses[-1]:.4f}", flush=True)
    return {"losses": losses, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "tokens": sum(len(t.input_ids) for b in batches for t in b),
            "labeled_tokens": sum(t.num_model_tokens for b in batches for t in b)}


def timing_child(steps: int, n_examples: int) -> dict:
    """Both variants on every batch, in alternating order (so a slow spell of a shared host hits both), then one
    optimizer step from the gradients of the variant that ran second (the two are equal up to bf16 rounding)."""
    model, pad_id, cfg, batches, opt = setup(n_examples, steps)
    seconds = {v: [] for v in LOSSES}
    for k, batch in enumerate(batches):
        order = list(LOSSES) if k % 2 == 0 else list(LOSSES)[::-1]
        for variant in order:
            seconds[variant].append(gradients(model, batch, cfg, pad_id, variant)[1])
        optimizer_step(model, opt, cfg)
        print(f"[timing] step {k + 1}: " + ", ".join(f"{v} {seconds[v][-1]:.1f}s" for v in LOSSES), flush=True)
    return {v: sum(t[1:]) / (len(t) - 1) for v, t in seconds.items()}  # the first step is a warm-up


LOSSES = {"every_position": every_position_loss, "labeled_only": sft.batch_loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per variant (the first is not timed)")
    parser.add_argument("--n-examples", type=int, default=304, help="examples generated (the CPU preset's count)")
    parser.add_argument("--child", choices=["labeled_only", "every_position", "timing"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is a warm-up)")
    if args.child:
        run = (lambda: timing_child(args.steps, args.n_examples)) if args.child == "timing" else \
            (lambda: memory_child(args.child, args.steps, args.n_examples))
        print(json.dumps(run()))
        return
    out = {}
    for child in ("timing", "every_position", "labeled_only"):
        cmd = [sys.executable, __file__, "--child", child, "--steps", str(args.steps),
               "--n-examples", str(args.n_examples)]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            sys.exit(f"bench_sft_step: the {child} child failed (exit {done.returncode})")
        lines = done.stdout.strip().splitlines()
        print("\n".join(lines[:-1]), flush=True)
        out[child] = json.loads(lines[-1])
    time_s, base, ours = out["timing"], out["every_position"], out["labeled_only"]
    result = {"steps": args.steps, "examples_per_step": sft.SFTConfig().batch_size,
              "labeled_token_share": round(ours["labeled_tokens"] / ours["tokens"], 3),
              "every_position_fwd_bwd_s": round(time_s["every_position"], 2),
              "labeled_only_fwd_bwd_s": round(time_s["labeled_only"], 2),
              "speedup": round(time_s["every_position"] / time_s["labeled_only"], 3),
              "every_position_peak_gb": round(base["peak_rss_gb"], 2),
              "labeled_only_peak_gb": round(ours["peak_rss_gb"], 2),
              "max_loss_diff": max(abs(a - b) for a, b in zip(base["losses"], ours["losses"]))}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
