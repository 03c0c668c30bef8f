"""Benchmark the SFT step (sft.py) on the bundled model: this step against the step before the shared prompt
ran once per batch and the logits a chunk at a time, in one run.

    baseline   the system prompt (~450 tokens) forwarded once per micro-batch, every labeled token's 49K-wide
               logits at once, micro-batches of 2304 padded response tokens (SFTConfig's former defaults)
    ours       sft.accumulate_gradients as it is: the prompt once per batch (models.shared_prompt_kv, its
               backward once), log-probs logprob_chunk_tokens at a time, SFTConfig's micro_batch_tokens

Both give the loss and gradients of the plain batch (tests/test_sft.py). Over the first K batches of the CPU
preset's data, with the steps exactly as sft.run_sft takes them (bf16 autocast where the CPU has bf16 units,
clip, AdamW):
  timing   one process runs both variants' forward and backward passes on every batch, in alternating order
           (a slow spell of a shared host hits both), then one optimizer step; the first batch is a warm-up
  memory   each variant alone in a child process of its own: its peak resident memory, and its losses

    python bench/bench_sft_step.py              # 6 batches of 8 examples (about 8 minutes on 2 AVX2 cores)
    python bench/bench_sft_step.py --steps 10

The last line printed is one JSON object: mean forward + backward seconds per batch of each variant, speed-up =
baseline / ours, peak resident memory of each, and the largest difference of the two variants' losses on the same
batches and weights (the timing process; the memory processes draw their data apiece).
"""
from __future__ import annotations

import argparse
import dataclasses
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
from distributed import all_ranks_sum  # noqa: E402


def baseline_gradients(model, examples, cfg, pad_id) -> float:
    """The baseline step: the prompt once per micro-batch, all of a micro-batch's logits at once."""
    cfg = dataclasses.replace(cfg, micro_batch_tokens=2304)
    total = sum(sum(t.loss_mask) for t in examples)
    loss = 0.0
    for micro in sft.my_micro_batches_of(examples, cfg.micro_batch_tokens):
        with sft.autocast(model, cfg):
            loss_sum, _ = sft.batch_loss(model, sft.collate(micro, pad_id), True, None, 0)
        (loss_sum / total).backward()
        loss += loss_sum.item() / total
    return all_ranks_sum([loss])[0]


STEPS = {"baseline": baseline_gradients, "ours": sft.accumulate_gradients}


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
    """One step's forward and backward passes with one variant; (loss, seconds)."""
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss = STEPS[variant](model, batch, cfg, pad_id)
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
    optimizer step from the gradients of the variant that ran second (the two are equal up to rounding)."""
    model, pad_id, cfg, batches, opt = setup(n_examples, steps)
    seconds, losses = {v: [] for v in STEPS}, {v: [] for v in STEPS}
    for k, batch in enumerate(batches):
        order = list(STEPS) if k % 2 == 0 else list(STEPS)[::-1]
        for variant in order:
            loss, s = gradients(model, batch, cfg, pad_id, variant)
            seconds[variant].append(s)
            losses[variant].append(loss)
        optimizer_step(model, opt, cfg)
        print(f"[timing] step {k + 1}: " + ", ".join(f"{v} {seconds[v][-1]:.1f}s" for v in STEPS), flush=True)
    return {**{v: sum(t[1:]) / (len(t) - 1) for v, t in seconds.items()},  # the first step is a warm-up
            "max_loss_diff": max(abs(a - b) for a, b in zip(*losses.values()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per variant (the first is not timed)")
    parser.add_argument("--n-examples", type=int, default=304, help="examples generated (the CPU preset's count)")
    parser.add_argument("--child", choices=["ours", "baseline", "timing"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is a warm-up)")
    if args.child:
        run = (lambda: timing_child(args.steps, args.n_examples)) if args.child == "timing" else \
            (lambda: memory_child(args.child, args.steps, args.n_examples))
        print(json.dumps(run()))
        return
    out = {}
    for child in ("timing", "baseline", "ours"):
        cmd = [sys.executable, __file__, "--child", child, "--steps", str(args.steps),
               "--n-examples", str(args.n_examples)]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            sys.exit(f"bench_sft_step: the {child} child failed (exit {done.returncode})")
        lines = done.stdout.strip().splitlines()
        print("\n".join(lines[:-1]), flush=True)
        out[child] = json.loads(lines[-1])
    time_s, base, ours = out["timing"], out["baseline"], out["ours"]
    cfg = sft.SFTConfig()
    result = {"steps": args.steps, "examples_per_step": cfg.batch_size, "host": models.cpu_kind(),
              "micro_batch_tokens": {"baseline": 2304, "ours": cfg.micro_batch_tokens},
              "logprob_chunk_tokens": cfg.logprob_chunk_tokens,
              "baseline_fwd_bwd_s": round(time_s["baseline"], 2), "ours_fwd_bwd_s": round(time_s["ours"], 2),
              "speedup": round(time_s["baseline"] / time_s["ours"], 3),
              "baseline_peak_gb": round(base["peak_rss_gb"], 2), "ours_peak_gb": round(ours["peak_rss_gb"], 2),
              "max_loss_diff_same_batches": time_s["max_loss_diff"]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
