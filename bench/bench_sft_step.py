"""Benchmark the SFT step (sft.py) on the bundled model: the vocabulary projection restricted to labeled tokens
against the plain one that projects every position, in one run.

SmolLM2's output projection maps each hidden state to 49,152 logits: about a fifth of the model's forward
FLOPs per token, and the largest tensors of a step (the logits, their fp32 copy for the loss, their gradient).
sft.batch_loss asks model.next_token_logits for the logits of labeled (assistant) tokens only; the baseline here
is the same loss computed from every position's logits, as before (the answer is the same: test_sft checks it).

Each variant runs in its own child process (so each has its own peak memory) over the same batches of the CPU
preset's data: K optimizer steps exactly as sft.run_sft takes them (micro-batches, bf16 autocast where the CPU
has bf16 units, clip, AdamW). The first step is a warm-up and is not timed.

    python bench/bench_sft_step.py              # 6 steps of 8 examples per variant (about 4 minutes on 2 cores)
    python bench/bench_sft_step.py --steps 10

The last line printed is one JSON object: mean step seconds (steps 2..K), peak resident memory per variant, the
largest loss difference between them (bf16 rounding), and speed-up = baseline time / labeled-only time.
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


def child(variant: str, steps: int, n_examples: int) -> dict:
    """K SFT steps of one variant; returns its step times, losses and peak resident memory."""
    import torch

    if variant == "every_position":
        sft.batch_loss = every_position_loss  # accumulate_gradients calls it through the module
    path = models.resolve_model(models.DEFAULT_MODEL)
    model, tokenizer = models.load_model(path), models.load_tokenizer(path)
    cfg = sft.SFTConfig(n_examples=n_examples)
    examples = sft.build_sft_examples(tokenizer, n_examples, cfg.seed, None, cfg)  # a private sandbox pool
    batches = sft.length_batches(examples, cfg.batch_size, random.Random(cfg.seed))[:steps]
    pad_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas)
    model.train()
    times, losses = [], []
    for batch in batches:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        losses.append(sft.accumulate_gradients(model, batch, cfg, pad_id))
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        models.release_freed_memory()
        times.append(time.perf_counter() - t0)
        print(f"[{variant}] step {len(times)}: {times[-1]:.1f}s loss {losses[-1]:.4f}", flush=True)
    return {"step_s": times, "timed_s": sum(times[1:]), "losses": losses,
            "tokens": sum(len(t.input_ids) for b in batches for t in b),
            "labeled_tokens": sum(t.num_model_tokens for b in batches for t in b),
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per variant (the first is not timed)")
    parser.add_argument("--n-examples", type=int, default=304, help="examples generated (the CPU preset's count)")
    parser.add_argument("--child", choices=["labeled_only", "every_position"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is a warm-up)")
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.n_examples)))
        return
    out = {}
    for variant in ("every_position", "labeled_only"):
        cmd = [sys.executable, __file__, "--child", variant, "--steps", str(args.steps),
               "--n-examples", str(args.n_examples)]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            sys.exit(f"bench_sft_step: the {variant} child failed (exit {done.returncode})")
        lines = done.stdout.strip().splitlines()
        print("\n".join(lines[:-1]), flush=True)
        out[variant] = json.loads(lines[-1])
    base, ours = out["every_position"], out["labeled_only"]
    result = {"steps": args.steps, "examples_per_step": sft.SFTConfig().batch_size,
              "labeled_token_share": round(ours["labeled_tokens"] / ours["tokens"], 3),
              "every_position_step_s": round(base["timed_s"] / (args.steps - 1), 2),
              "labeled_only_step_s": round(ours["timed_s"] / (args.steps - 1), 2),
              "speedup": round(base["timed_s"] / ours["timed_s"], 3),
              "every_position_peak_gb": round(base["peak_rss_gb"], 2),
              "labeled_only_peak_gb": round(ours["peak_rss_gb"], 2),
              "max_loss_diff": max(abs(a - b) for a, b in zip(base["losses"], ours["losses"]))}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
