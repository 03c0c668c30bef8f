"""Benchmark the optimizer step of the SFT and RL updates: torch's AdamW as a Python loop over the parameters
(torch's default on CPU) against the fused kernel that model.adamw uses, on the bundled 135M model, in one run.

An AdamW step reads and writes every parameter, its gradient and two moment buffers (135M x 4 tensors x 4 bytes:
about 2 GB of memory traffic) whatever the batch, so on a 2-core CPU it is a fixed cost per optimizer step: it
decides what smaller batches (more steps for the same examples) cost. The loop form runs several small ops per
tensor for SmolLM2's 272 tensors; the fused form one kernel over all of them.

Both optimizers start from the same weights and take the same steps with the same gradients (random, of the
size a real SFT step has: the time does not depend on their values), alternating which goes first (a slow spell
of a shared host hits both); the first step of each is a warm-up. At the end the two sets of weights are compared.

    python bench/bench_optimizer.py              # 12 steps each (about a minute on 2 cores)
    python bench/bench_optimizer.py --steps 30

The last line printed is one JSON object: mean seconds per step of each, speed-up = loop / fused, and the
largest weight difference between the two after all steps next to the largest weight change (rounding only).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import model as models  # noqa: E402
import sft  # noqa: E402


def timed_step(params, grads, opt) -> float:
    """Install the step's gradients, take one optimizer step; its seconds."""
    for p, g in zip(params, grads):
        p.grad = g.clone()
    t0 = time.perf_counter()
    opt.step()
    return time.perf_counter() - t0


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per variant (the first is not timed)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is a warm-up)")

    cfg = sft.SFTConfig()  # the SFT's hyper-parameters: lr, betas, weight decay
    hyper = dict(lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    loop_model = models.load_model(models.resolve_model(models.DEFAULT_MODEL))
    fused_model = copy.deepcopy(loop_model)  # the same weights, its own tensors
    start = {k: v.clone() for k, v in loop_model.state_dict().items()}
    loop_params, fused_params = list(loop_model.parameters()), list(fused_model.parameters())
    variants = {"loop": (loop_params, torch.optim.AdamW(loop_params, **hyper)),
                "fused": (fused_params, models.adamw(fused_params, **hyper))}
    assert not variants["loop"][1].defaults.get("fused") and variants["fused"][1].defaults["fused"]

    torch.manual_seed(0)
    seconds = {v: [] for v in variants}
    for k in range(args.steps):
        grads = [torch.randn_like(p) * 1e-3 for p in loop_params]  # |g| ~ a clipped SFT step's (norm ~ 1-10)
        order = list(variants) if k % 2 == 0 else list(variants)[::-1]
        for v in order:
            params, opt = variants[v]
            seconds[v].append(timed_step(params, grads, opt))
        print(f"[optimizer] step {k + 1}: " + ", ".join(f"{v} {seconds[v][-1]:.3f}s" for v in variants), flush=True)

    mean = {v: sum(t[1:]) / (len(t) - 1) for v, t in seconds.items()}
    after_loop, after_fused = loop_model.state_dict(), fused_model.state_dict()
    result = {"steps": args.steps, "parameters": sum(p.numel() for p in loop_params), "tensors": len(loop_params),
              "threads": torch.get_num_threads(),
              "loop_step_s": round(mean["loop"], 4), "fused_step_s": round(mean["fused"], 4),
              "speedup": round(mean["loop"] / mean["fused"], 2),
              "max_weight_diff": max(float((after_loop[k] - after_fused[k]).abs().max()) for k in start),
              "max_weight_change": max(float((after_loop[k] - start[k]).abs().max()) for k in start)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
