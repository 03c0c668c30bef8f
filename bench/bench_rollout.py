"""Benchmark real rollouts on CPU: the transformers engine and our scheduler, with the real sandbox.

Two measurements, in one run, with the default SmolLM2-135M-Instruct model:

1. engine vs its baseline vs generate: one batch of prompts, sampled at temperature 1 with the same
   max_new_tokens, through TransformersEngine.decode_wave (per-request generators, rows leave the batch when
   they stop), through the same engine on a bf16 copy of the model (what precision=auto runs where the CPU
   has bf16 units; elsewhere bf16 is emulated and slower), through the TransformersEngine of a baseline
   revision (engines.py from git, --baseline, at its batch size, on its own copy of the model), and through
   plain model.generate(do_sample=True). Tokens/s counts the tokens each returns up to and including eos.
2. scheduler vs turn-synchronous loop: the same problems, samples and seed through run_rollouts twice:
     ours          requests go to the engine as soon as they are ready, tool calls overlap generation
     synchronous   RolloutConfig(deterministic=True): every turn waits until all trajectories have generated
                   and run their tools, as simple trainers do (generate all, run all tools, generate all)
   Tokens/s counts model tokens (loss mask 1) per second of wall time.

    python bench/bench_rollout.py                                    # 8 problems x 2 samples, 512 tokens, 3 turns
    python bench/bench_rollout.py --problems 16 --samples 4 --max-response-tokens 1024

The last line printed is one JSON object; with it the decode shape's fp32 and bf16 matmul rates on this CPU and
each engine's share of the rate of its dtype (bench/roofline.py).
"""

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as models  # noqa: E402
import git_baseline  # noqa: E402
import roofline  # noqa: E402
import scheduler  # noqa: E402
import tasks  # noqa: E402
from sandbox import SandboxPool  # noqa: E402

# ---- arguments

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default=models.DEFAULT_MODEL,
                    help="the bundled SmolLM2 (makes few tool calls before SFT) or an HF directory, e.g. an SFT checkpoint")
parser.add_argument("--problems", type=int, default=8)
parser.add_argument("--samples", type=int, default=2)
parser.add_argument("--max-response-tokens", type=int, default=512)
parser.add_argument("--max-turns", type=int, default=3)
parser.add_argument("--max-batch", type=int, default=64, help="rows of our engine (the CPU preset: 64)")
parser.add_argument("--engine-batch", type=int, default=64, help="prompts in the engine-vs-generate batch")
parser.add_argument("--engine-new-tokens", type=int, default=64)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--baseline", default="11474cd",
                    help="git revision whose engines.py is the baseline engine (before shared-prefix attention)")
parser.add_argument("--baseline-batch", type=int, default=32, help="the baseline's rows (its CPU preset: 32)")
args = parser.parse_args()


def baseline_engines():
    """engines.py of the baseline revision, imported as its own module (git_baseline.module_at)."""
    return git_baseline.module_at(args.baseline, "engines.py", "engines_baseline", own=("slot_engine",))

path = models.resolve_model(args.model)
tokenizer = models.load_tokenizer(path)
model = models.load_model(path)
problems = tasks.generate_problems(args.problems, seed=args.seed)
engine = scheduler.TransformersEngine(model, tokenizer, max_batch=args.max_batch,
                                      kv_capacity_tokens=args.max_batch * (1024 + args.max_response_tokens))

# ---- 1. one batch: our decode loop against the baseline's and model.generate

import torch  # noqa: E402

prompts = [scheduler.render_prompt(tokenizer, p.question) for p in tasks.generate_problems(args.engine_batch, seed=1)]
requests = [scheduler.GenRequest(p, args.engine_new_tokens, 1.0, 1.0, seed=i) for i, p in enumerate(prompts)]


def decode_all(eng):
    """(tokens, seconds) of decoding every request with `eng` (after a short warm-up)."""
    eng.decode_wave(requests[:2], lambda i, r: None)
    results = {}
    started = time.perf_counter()
    eng.decode_wave(requests, lambda i, r: results.__setitem__(i, r))
    return sum(len(r.token_ids) for r in results.values()), time.perf_counter() - started


old = baseline_engines()
baseline_engine = old.TransformersEngine(models.load_model(path), tokenizer, max_batch=args.baseline_batch,
                                         kv_capacity_tokens=10**7)
baseline_tokens, baseline_s = decode_all(baseline_engine)
del baseline_engine
engine_tokens, engine_s = decode_all(engine)
bf16_engine = scheduler.TransformersEngine(models.load_model(path, dtype=torch.bfloat16), tokenizer,
                                           max_batch=args.max_batch, kv_capacity_tokens=10**7)
bf16_tokens, bf16_s = decode_all(bf16_engine)
del bf16_engine

tokenizer.padding_side = "left"
batch = tokenizer([tokenizer.decode(p) for p in prompts], return_tensors="pt", padding=True, add_special_tokens=False)
torch.manual_seed(0)
with torch.inference_mode():
    started = time.perf_counter()
    out = model.generate(**batch, max_new_tokens=args.engine_new_tokens, do_sample=True, temperature=1.0,
                         top_p=1.0, top_k=0, pad_token_id=tokenizer.pad_token_id)
    generate_s = time.perf_counter() - started
eos = scheduler.eos_token_ids(tokenizer, model)
generate_tokens = 0
for row in out[:, batch.input_ids.shape[1]:].tolist():
    ends = [i for i, t in enumerate(row) if t in eos]
    generate_tokens += ends[0] + 1 if ends else len(row)
print(json.dumps({"engine_tokens": engine_tokens, "engine_s": round(engine_s, 2),
                  "engine_bf16_tokens": bf16_tokens, "engine_bf16_s": round(bf16_s, 2),
                  "baseline_tokens": baseline_tokens, "baseline_s": round(baseline_s, 2),
                  "generate_tokens": generate_tokens, "generate_s": round(generate_s, 2)}), flush=True)

# ---- 2. rollouts: our scheduler against the turn-synchronous loop


async def rollouts(pool, deterministic: bool):
    cfg = scheduler.RolloutConfig(max_turns=args.max_turns, max_response_tokens=args.max_response_tokens,
                                  deterministic=deterministic)
    started = time.perf_counter()
    groups = await scheduler.rollout_groups([engine], pool, tokenizer, [(p.id, p.question) for p in problems],
                                            args.samples, cfg, seed=args.seed, progress=False)
    wall = time.perf_counter() - started
    trajs = [t for g in groups for t in g]
    return {"mode": "synchronous" if deterministic else "scheduler", "wall_s": round(wall, 1),
            "model_tokens": sum(t.num_model_tokens for t in trajs), "waves": engine.waves,
            "tool_calls": sum(t.tool_calls for t in trajs), "tool_errors": sum(t.tool_errors for t in trajs),
            "finish": {r: sum(t.finish_reason == r for t in trajs) for r in ("answer", "length", "turns", "error")}}


async def main():
    async with SandboxPool(workers=2) as pool:
        out = {}
        for deterministic in (False, True):
            engine.waves = 0
            out[deterministic] = await rollouts(pool, deterministic)
            print(json.dumps(out[deterministic]), flush=True)
        return out[False], out[True]


ours, sync = asyncio.run(main())
rates = roofline.decode_rates(model, args.max_batch)   # GFLOPS of the decode shape, fp32 and bf16, on this CPU
ours_tps, sync_tps = ours["model_tokens"] / ours["wall_s"], sync["model_tokens"] / sync["wall_s"]
print(json.dumps({
    "engine_tok_s": round(engine_tokens / engine_s, 1), "generate_tok_s": round(generate_tokens / generate_s, 1),
    "baseline_engine_tok_s": round(baseline_tokens / baseline_s, 1),
    "engine_over_baseline": round((engine_tokens / engine_s) / (baseline_tokens / baseline_s), 3),
    "engine_over_generate": round((engine_tokens / engine_s) / (generate_tokens / generate_s), 3),
    "engine_bf16_tok_s": round(bf16_tokens / bf16_s, 1), "bf16_units": models.bf16_is_fast("cpu"),
    "host": models.cpu_kind(), "decode_matmul_gflops": rates,
    "engine_share_of_fp32_rate": round(roofline.share_of_rate(engine_tokens / engine_s, model, rates["float32"]), 3),
    "engine_bf16_share_of_bf16_rate": round(roofline.share_of_rate(bf16_tokens / bf16_s, model, rates["bfloat16"]), 3),
    "engine_bf16_over_fp32": round((bf16_tokens / bf16_s) / (engine_tokens / engine_s), 3),
    "engine_bf16_over_baseline": round((bf16_tokens / bf16_s) / (baseline_tokens / baseline_s), 3),
    "engine_batch": args.max_batch, "baseline_batch": args.baseline_batch, "baseline": args.baseline,
    "scheduler_tok_s": round(ours_tps, 1), "synchronous_tok_s": round(sync_tps, 1),
    "scheduler_over_synchronous": round(ours_tps / sync_tps, 3),
    "rollouts": args.problems * args.samples, "max_response_tokens": args.max_response_tokens,
    "max_turns": args.max_turns, "tool_calls": [ours["tool_calls"], sync["tool_calls"]],
}))
