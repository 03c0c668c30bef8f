"""The sampler/trainer gap on this CPU, and what each off-policy correction makes of it (docs/design.md).

The rollouts are sampled by an engine copy of the policy; the update recomputes pi_old with the trainer's fp32
master weights (rl_update.policy_update). This measures the gap between the two for the pairs the CPU preset
can run, on real rollouts of held-out problems (real tool calls), with the functions the loop logs through:

    engine fp32  vs trainer fp32             precision=fp32 (and auto without bf16 units): rounding only
    engine bf16  vs trainer fp32             a bf16 engine copy with fp32 updates
    engine bf16  vs trainer bf16 autocast    precision=bf16 (and auto with bf16 units): what that run logs

For each pair: rl_update.engine_trainer_mismatch's figures (|log r| mean and max, the k3 estimate of
KL(pi_sampler || pi_old), the ESS of the plain ratios r = pi_old / pi_sampler) and, for each correction of
grpo_roc.sampler_weights, the share of model tokens it truncates or masks and the ESS of its weights.

    python bench/bench_mismatch.py                          # bundled SmolLM2-135M-Instruct, 8 problems x 4
    python bench/bench_mismatch.py --model runs/rstar2/sft/model --problems 16

Where the CPU has no bf16 units, bf16 is emulated: slower, the same numbers. The last line is one JSON object.
"""
import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_roc  # noqa: E402
import model as models  # noqa: E402
import rl_update  # noqa: E402
import scheduler  # noqa: E402
import tasks  # noqa: E402
from sandbox import SandboxPool  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", default=models.DEFAULT_MODEL, help="a model directory (default: the bundled SmolLM2-135M-Instruct)")
p.add_argument("--problems", type=int, default=8)
p.add_argument("--samples", type=int, default=4)
p.add_argument("--max-response-tokens", type=int, default=384)
p.add_argument("--temperature", type=float, default=1.0)
p.add_argument("--seed", type=int, default=0)
args = p.parse_args()

import torch  # noqa: E402

path = models.resolve_model(args.model)
tokenizer = models.load_tokenizer(path)
trainer = models.load_model(path, dtype=torch.float32)   # fp32 masters, as rl_update's
trainer.eval()
problems = tasks.heldout_problems(args.problems, levels=(1,))


async def sample(dtype) -> tuple[list, float]:
    """Rollouts of the held-out problems by an engine copy in `dtype` (the trainer's weights), and seconds."""
    engine = scheduler.TransformersEngine(models.load_model(path, dtype=dtype), tokenizer, max_batch=32)
    cfg = scheduler.RolloutConfig(max_turns=3, max_response_tokens=args.max_response_tokens,
                                  temperature=args.temperature)
    started = time.perf_counter()
    async with SandboxPool(workers=2) as pool:
        groups = await scheduler.rollout_groups([engine], pool, tokenizer, [(q.id, q.question) for q in problems],
                                                args.samples, cfg, seed=args.seed, progress=False)
    return [t for g in groups for t in g], time.perf_counter() - started


def trainer_logprobs(trajs, bf16: bool) -> list:
    """pi_old of every trajectory as the update computes it: each alone (no packing), no gradient."""
    out = []
    with torch.no_grad(), models.bf16_autocast(trainer, bf16):
        for t in trajs:
            out.append(rl_update.token_logprobs(trainer, [t.input_ids], args.temperature, masks=[t.loss_mask])[0])
    return out


def gap(trajs, old) -> dict:
    """The logged mismatch figures, then each correction's share of corrected tokens and the ESS of its weights."""
    masks = [t.loss_mask for t in trajs]
    row = {k: v for k, v in rl_update.engine_trainer_mismatch(trajs, old, masks).items() if v is not None}
    for mode in grpo_roc.SAMPLER_CORRECTIONS[1:]:
        weights, corrected = [], []
        for t, o, m in zip(trajs, old, masks):
            engine = rl_update.engine_logprobs_at(t, o, m)
            w, c = grpo_roc.sampler_weights(o[None], engine.to(o.dtype)[None], torch.tensor([m]), mode)
            weights.append(w[0])
            corrected.append(c[0])
        stats = rl_update.engine_trainer_mismatch(trajs, old, masks, weights, corrected)
        row[f"{mode}_corrected_frac"] = stats["is_corrected_frac"]
        row[f"{mode}_ess"] = stats["is_ess"]
    return {k: (float(f"{v:.3g}") if isinstance(v, float) else v) for k, v in row.items()}


results = {}
for engine_dtype in (torch.float32, torch.bfloat16):
    trajs, seconds = asyncio.run(sample(engine_dtype))
    trajs = [t for t in trajs if rl_update.engine_logprobs_at(t, torch.zeros(len(t.input_ids)), t.loss_mask)
             is not None]
    name = "bf16" if engine_dtype == torch.bfloat16 else "fp32"
    for trainer_bf16 in ((False,) if name == "fp32" else (False, True)):
        pair = f"engine_{name}_vs_trainer_{'bf16_autocast' if trainer_bf16 else 'fp32'}"
        results[pair] = {"rollouts": len(trajs), "model_tokens": sum(t.num_model_tokens for t in trajs),
                         "sample_s": round(seconds, 1), **gap(trajs, trainer_logprobs(trajs, trainer_bf16))}
        print(json.dumps({pair: results[pair]}), flush=True)

print(json.dumps({"model": str(path), "bf16_units": models.bf16_is_fast("cpu"), "problems": args.problems,
                  "samples": args.samples, "temperature": args.temperature, **results}))
