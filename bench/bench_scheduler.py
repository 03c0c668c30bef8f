"""Benchmark the load-balanced rollout scheduler (paper section 3.2) against two baselines, in simulation.

One RL step's rollouts (problems x samples, multi-turn, with tool calls) run on 8 simulated inference engines with
finite KV caches (scheduler.SimulatedEngine, in virtual time, so a step of many engine-minutes runs in seconds).
The real scheduler code runs unchanged (scheduler.rollout_groups); only the model and the sandbox are simulated:

  * the "model" is a seeded script: per problem a heavy-tailed difficulty (lognormal), per trajectory a
    heavy-tailed number of tool calls, per turn a heavy-tailed number of tokens (lognormal), each turn ending in a
    real <tool_call> JSON (or, on the last, <answer>...<|im_end|>); the length budget cuts the longest;
  * the "sandbox" sleeps a heavy-tailed latency (lognormal, capped by the tool timeout) and returns a short output.

Three routers on the same seeded step:
  static          the paper's baseline: each engine gets a fixed contiguous share of the rollouts (all samples of
                  a problem on one engine), sent at once; the engine queues and preempts internally (like vLLM)
  least_requests  each turn goes to the engine holding the fewest requests (vLLM's data-parallel balancer, the
                  OpenRLHF dispatcher), sent at once, fits or not
  balanced        ours: the engine with the most free KV capacity, only when the request's context plus the
                  new tokens it may write fits; a continuation waits for the engine holding its prefix unless
                  that engine is overloaded; tool calls release capacity at once. A request may write at most
                  --chunk-tokens (default 512) new tokens, a longer turn continues in a next request
                  (RolloutConfig.chunk_tokens); the same router reserving each turn's whole remaining
                  budget is reported as balanced_whole_budget_s

Workload scale (defaults): 64 problems x 32 samples = 2048 rollouts on 8 engines, 256 per engine, as in the
paper's stage 1 (512 prompts x 32 rollouts over 64 GPUs, one engine per GPU); 8K length budget and 10 turns
(stages 1-2); tool latency median 0.3 s, lognormal sigma 1.2 (heavy tail, cut at the 10 s timeout). A KV cache of
160K tokens holds about 18 full-length (prompt + 8K) sequences (Qwen3-14B, 160 KB a token, on an 80 GB GPU at
0.8 memory utilization gives about 190K). With 256 rollouts sent to an engine at once, the static baseline
overflows its cache and preempts; each preempted sequence recomputes its whole context (prompt and every token so
far) when it is admitted again, charged at the prefill rate.

Each seed draws a new step (difficulties, lengths, latencies); the tail of a step (its few longest trajectories)
moves the ratios by several percent from seed to seed, so the last line gives the mean over --seeds (default
3) and each seed's value.

lower_bound_s is the work divided by the total throughput: every generated token plus the unavoidable prefill
(prompt and tool-response tokens, once each) over 8 engines at their full rate. `overflow_*` counts KV-cache
overflows (preemptions, each followed by recomputation of the preempted context).

    python bench/bench_scheduler.py                     # 8 engines, 64 problems x 32 samples
    python bench/bench_scheduler.py --problems 128 --saturation 32

The last line printed is one JSON object.
"""

import argparse
import asyncio
import json
import math
import re
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as models  # noqa: E402
import scheduler  # noqa: E402
from sandbox import ExecResult  # noqa: E402

# ---- arguments

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--engines", type=int, default=8)
parser.add_argument("--problems", type=int, default=64)
parser.add_argument("--samples", type=int, default=32, help="rollouts per problem (paper: 32, down-sampled to 16)")
parser.add_argument("--max-response-tokens", type=int, default=8192, help="paper stage 1: 8K")
parser.add_argument("--max-turns", type=int, default=10, help="paper stages 1-2: 10")
parser.add_argument("--kv-capacity", type=int, default=160_000, help="KV cache of one engine, tokens")
parser.add_argument("--tokens-per-s", type=float, default=2500.0, help="full decode rate of one engine")
parser.add_argument("--saturation", type=int, default=12,
                    help="concurrent sequences at which an engine reaches its full rate")
parser.add_argument("--prefill-speedup", type=float, default=10.0, help="prefill tokens per decode token time")
parser.add_argument("--mean-turn-tokens", type=float, default=350.0, help="median tokens of a turn, average problem")
parser.add_argument("--mean-tool-s", type=float, default=0.3, help="median tool latency, seconds (paper: 0.3 s mean)")
parser.add_argument("--tool-timeout-s", type=float, default=10.0)
parser.add_argument("--chunk-tokens", type=int, default=512,
                    help="ours: reserve KV for at most this many new tokens per request (0: the whole budget)")
parser.add_argument("--max-requests", type=int, default=0, help="ours: requests held per engine at most (0: no cap)")
parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                    help="one simulated step per seed; the ratios are reported per seed and as their mean")
args = parser.parse_args()

# ---- the simulated model and sandbox

tokenizer = models.load_tokenizer(models.ensure_default_model())
FILLER = scheduler.encode(tokenizer, " the")          # one token, repeated: the turn's "reasoning"
ANSWER = scheduler.encode(tokenizer, "<answer>\\boxed{7}</answer>") + [tokenizer.eos_token_id]


def tool_call_ids(latency_s: float) -> list[int]:
    call = {"name": scheduler.TOOL_NAME, "arguments": {"code": f"sleep {latency_s:.3f}", "input": ""}}
    return scheduler.encode(tokenizer, f"<tool_call>{json.dumps(call)}</tool_call>")


def difficulty(problem: int) -> float:
    return random.Random(f"{SEED[0]}:difficulty:{problem}").lognormvariate(0.0, 0.6)


FIRST_TURN_AT: dict[str, float] = {}  # router -> virtual time of the last trajectory's first request
ROUTER = [""]
SEED = [0]  # the seed of the step being simulated


def script(req: scheduler.GenRequest):
    """What the simulated model writes in this turn: heavy-tailed, seeded by (problem, sample, turn)."""
    problem, sample, turn = req.key
    if turn == 0:
        FIRST_TURN_AT[ROUTER[0]] = asyncio.get_running_loop().time()
    d = difficulty(problem)
    calls = min(args.max_turns - 1, int(random.Random(f"{SEED[0]}:calls:{problem}:{sample}").expovariate(1 / (1.5 * d))))
    rng = random.Random(f"{SEED[0]}:turn:{problem}:{sample}:{turn}")
    tokens = FILLER * int(rng.lognormvariate(math.log(args.mean_turn_tokens * d), 0.9))
    if turn < calls:
        return tokens + tool_call_ids(rng.lognormvariate(math.log(args.mean_tool_s), 1.2)), "tool"
    return tokens + ANSWER, "eos"


class SimulatedTools:
    """Stands in for sandbox.SandboxPool: sleeps the latency written in the call, capped by the timeout."""

    async def run(self, code: str, stdin: str = "", timeout_s: float | None = None) -> ExecResult:
        latency = float(code.split()[1])
        if timeout_s is not None and latency > timeout_s:
            await asyncio.sleep(timeout_s)
            return ExecResult("timeout", "", "", None, timeout_s)
        await asyncio.sleep(latency)
        return ExecResult("ok", "42\n", "", 0, latency)


# ---- one simulated step per router


def tool_codes(traj) -> list[str]:
    """The simulated latencies written in a trajectory's tool calls ("sleep 0.412")."""
    return [c for c in re.findall(r'"code": "(sleep [0-9.]+)"', traj.response_text)]



def run(routing: str, chunk_tokens: int = 0) -> dict:
    ROUTER[0] = routing
    loop = scheduler.virtual_time_loop()
    engines = [scheduler.SimulatedEngine(script, args.kv_capacity, args.tokens_per_s, args.saturation,
                                         args.prefill_speedup) for _ in range(args.engines)]
    cfg = scheduler.RolloutConfig(max_turns=args.max_turns, max_response_tokens=args.max_response_tokens,
                                  tool_timeout_s=args.tool_timeout_s, routing=routing,
                                  chunk_tokens=chunk_tokens,
                                  max_requests_per_engine=args.max_requests if routing == "kv" else 0)
    problems = [(f"p{i}", f"Problem number {i}: what is {i} + 7?") for i in range(args.problems)]
    started = time.time()
    groups = scheduler.run_rollouts(engines, SimulatedTools(), tokenizer, problems, args.samples, cfg,
                                    seed=SEED[0], progress=False, loop=loop)
    trajs = [t for g in groups for t in g]
    loop.close()
    # the longest trajectory alone: its tokens at one sequence's speed plus its tool time (a bound on the tail)
    single = args.tokens_per_s / args.saturation
    critical = max(t.num_model_tokens / single + sum(float(c.split()[1]) for c in tool_codes(t)) for t in trajs)
    tokens = [e.tokens_generated for e in engines]
    return {"routing": routing, "chunk_tokens": chunk_tokens, "step_s": loop.time(), "real_s": time.time() - started,
            "last_start_s": FIRST_TURN_AT[routing], "critical_path_s": critical,
            "imbalance": max(tokens) / (sum(tokens) / len(tokens)),
            "overflow": sum(e.preemptions for e in engines),
            "engine_tokens": [e.tokens_generated for e in engines],
            "engine_busy_s": [round(e.busy_s, 1) for e in engines],
            "model_tokens": sum(t.num_model_tokens for t in trajs),
            "inserted_tokens": sum(len(t.prompt_ids) + t.num_response_tokens - t.num_model_tokens for t in trajs),
            "finish": {r: sum(t.finish_reason == r for t in trajs) for r in ("answer", "length", "turns", "error")},
            "tool_calls": sum(t.tool_calls for t in trajs)}


def one_seed(seed: int) -> dict:
    SEED[0] = seed
    results = {"kv": run("kv", args.chunk_tokens), "kv_whole_budget": run("kv", 0),
               "least_requests": run("least_requests"), "static": run("static")}
    for r in results.values():
        print(json.dumps({"seed": seed} | {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}))
    ours, static, least = results["kv"], results["static"], results["least_requests"]
    work = ours["model_tokens"] + ours["inserted_tokens"] / args.prefill_speedup
    lower_bound = work / (args.engines * args.tokens_per_s)
    return {"balanced_s": ours["step_s"], "static_s": static["step_s"], "least_requests_s": least["step_s"],
            "lower_bound_s": lower_bound, "balanced_whole_budget_s": results["kv_whole_budget"]["step_s"],
            "static_over_balanced": static["step_s"] / ours["step_s"],
            "least_requests_over_balanced": least["step_s"] / ours["step_s"],
            "balanced_over_bound": ours["step_s"] / lower_bound,
            "critical_path_s": ours["critical_path_s"], "last_start_balanced_s": ours["last_start_s"],
            "imbalance_static": static["imbalance"], "imbalance_least_requests": least["imbalance"],
            "imbalance_balanced": ours["imbalance"],
            "overflow_static": static["overflow"], "overflow_least_requests": least["overflow"],
            "overflow_balanced": ours["overflow"]}


per_seed = [one_seed(seed) for seed in args.seeds]
summary = {"engines": args.engines, "rollouts": args.problems * args.samples, "chunk_tokens": args.chunk_tokens,
           "seeds": args.seeds}
for k in per_seed[0]:  # the mean over seeds (overflows: the total), then each seed's value
    values = [r[k] for r in per_seed]
    summary[k] = sum(values) if k.startswith("overflow") else round(sum(values) / len(values), 3)
    if k in ("static_over_balanced", "balanced_over_bound", "balanced_s", "lower_bound_s"):
        summary[k + "_per_seed"] = [round(v, 3) for v in values]
print(json.dumps(summary))
