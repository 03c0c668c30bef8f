"""Measure what the non-reasoning SFT (sft.py, paper section 4.1) does to the bundled model, on held-out generated
math problems (tasks.heldout_problems), with the real rollouts of RL: scheduler.run_rollouts on a
TransformersEngine with the SandboxPool, graded by eval.py.

    python bench/measure_sft.py                          # before (8 x 4) -> CPU-preset SFT -> after (16 x 8)
    python bench/measure_sft.py --sft-dir runs/sft/model # measure an existing SFT checkpoint (no training)

Reported for each model:
  tool_call_ok       share of trajectories with a valid tool call: it parses, names the right function and runs
                     with status ok
  answer_format_ok   share whose model text holds exactly one well-formed <answer> with a \\boxed{} (eval.py)
  accuracy           mean outcome reward (the RL reward; SFT teaches no math, so this is where RL starts)
  mixed_groups       share of problems whose samples disagree in outcome (some right, some wrong): the groups
                     GRPO can learn from (target >= 30% after SFT; the one-template probe had about 6%)
  distinct_programs  mean number of distinct first programs (code + input) among a problem's samples
The last line printed is one JSON object with everything.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import eval as grader  # noqa: E402
import model as models  # noqa: E402
import scheduler  # noqa: E402
import sft  # noqa: E402
import tasks  # noqa: E402
from sandbox import SandboxPool  # noqa: E402


def measure(model, tokenizer, pool, loop, problems, samples: int, args) -> dict:
    engine = scheduler.TransformersEngine(model, tokenizer, max_batch=args.engine_batch,
                                          kv_capacity_tokens=args.engine_batch * 2048)
    cfg = scheduler.RolloutConfig(max_turns=args.max_turns, max_response_tokens=args.max_response_tokens,
                                  temperature=args.temperature)
    t0 = time.time()
    groups = scheduler.run_rollouts([engine], pool, tokenizer, [(p.id, p.question) for p in problems], samples,
                                    cfg, seed=args.seed, loop=loop)
    seconds = time.time() - t0
    trajs = [t for g in groups for t in g]
    rewards = [[grader.reward(t.model_text, p.answer) for t in g] for p, g in zip(problems, groups)]
    calls = sum(t.tool_calls for t in trajs)
    ok_calls = sum(t.tool_statuses.get("ok", 0) for t in trajs)
    return {
        "problems": len(problems), "samples": samples, "trajectories": len(trajs),
        "tool_call_ok": sum(t.tool_statuses.get("ok", 0) > 0 for t in trajs) / len(trajs),
        "answer_format_ok": sum(grader.answer_format_ok(t.model_text) for t in trajs) / len(trajs),
        "accuracy": sum(map(sum, rewards)) / len(trajs),
        "mixed_groups": sum(0 < sum(r) < len(r) for r in rewards) / len(rewards),
        "distinct_programs": grader.distinct_programs_per_problem(groups),
        "calls_per_traj": calls / len(trajs), "ok_call_share": ok_calls / max(1, calls),
        "finish": {k: sum(t.finish_reason == k for t in trajs) for k in sorted({t.finish_reason for t in trajs})},
        "mean_response_tokens": sum(t.num_response_tokens for t in trajs) / len(trajs),
        "rollout_s": round(seconds, 1),
        "example": trajs[0].model_text[:1500],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL, help="base model (bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--sft-dir", default=None, help="an existing SFT checkpoint to measure instead of training")
    ap.add_argument("--out", default="runs/measure_sft/model", help="where the new SFT checkpoint is saved")
    ap.add_argument("--problems", type=int, default=16, help="held-out problems after SFT")
    ap.add_argument("--samples", type=int, default=8, help="samples per problem after SFT (temperature 1)")
    ap.add_argument("--before-problems", type=int, default=8, help="held-out problems for the base model (0: skip)")
    ap.add_argument("--before-samples", type=int, default=4, help="samples per problem for the base model")
    ap.add_argument("--max-response-tokens", type=int, default=512, help="rollout budget (SFT responses ~200)")
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--engine-batch", type=int, default=16)
    ap.add_argument("--n-examples", type=int, default=sft.SFTConfig.n_examples)
    ap.add_argument("--lr", type=float, default=sft.SFTConfig.lr)
    ap.add_argument("--epochs", type=int, default=sft.SFTConfig.epochs)
    ap.add_argument("--batch-size", type=int, default=sft.SFTConfig.batch_size)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    base = models.resolve_model(args.model)
    tokenizer = models.load_tokenizer(base)
    problems = tasks.heldout_problems(max(args.problems, args.before_problems), seed=1234)
    loop = asyncio.new_event_loop()
    pool = SandboxPool()
    loop.run_until_complete(pool.start())
    report: dict = {"model": str(base), "temperature": args.temperature,
                    "max_response_tokens": args.max_response_tokens}
    try:
        if args.before_problems:
            report["before"] = measure(models.load_model(base), tokenizer, pool, loop,
                                       problems[:args.before_problems], args.before_samples, args)
            print("[before] " + json.dumps(report["before"]), flush=True)   # kept if a later phase dies
        if args.sft_dir:
            policy = models.load_model(args.sft_dir)
            metrics_file = Path(args.sft_dir) / "sft_metrics.json"
            report["sft"] = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
        else:
            policy = models.load_model(base)
            cfg = sft.SFTConfig(n_examples=args.n_examples, seed=args.seed, lr=args.lr, epochs=args.epochs,
                                batch_size=args.batch_size)
            report["sft"] = sft.run_sft(policy, tokenizer, cfg, Path(args.out), pool)
            policy = models.load_model(args.out)   # a fresh copy: the trainer's memory goes back to the allocator
        report["sft"] = {k: v for k, v in report["sft"].items() if k not in ("losses", "config")}
        report["after"] = measure(policy, tokenizer, pool, loop, problems[:args.problems], args.samples, args)
    finally:
        loop.run_until_complete(pool.close())
        loop.close()

    keys = ["tool_call_ok", "answer_format_ok", "accuracy", "mixed_groups", "distinct_programs", "calls_per_traj",
            "mean_response_tokens", "rollout_s"]
    print("\n| metric | " + " | ".join(k for k in ("before", "after") if k in report) + " |")
    print("|---|" + "---|" * sum(k in report for k in ("before", "after")))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{report[s][k]:.3g}" for s in ("before", "after") if s in report) + " |")
    for s in ("before", "after"):
        if s in report:
            print(f"\n--- first {s} trajectory (model text) ---\n{report[s]['example']}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
