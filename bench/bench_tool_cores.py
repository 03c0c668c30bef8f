"""Benchmark the CPU engine beside the sandbox: the decode giving its core to each long-running tool call
(RolloutConfig.tool_core_after_s, the default) against keeping all its threads (tool_core_after_s = -1), in one
process, the arms alternating: first in the case it is for, then in a real rollout phase.

Why it can matter (docs/contention.md): the engine decodes on an OpenMP team of one thread a core, and a tool
call's code runs on one core. The team member that shares its core with the call holds up the whole team at each
of an iteration's parallel regions; on two cores one decode iteration beside a busy core took 2.65x its time
alone on two threads and 1.26x on one. With the option the engine counts the sandbox's calls running longer than
tool_core_after_s before each iteration and decodes on that many threads fewer (engines.py, _threads_for).

1. Beside a spinning call: --spin-rows rows decode --spin-tokens tokens while the sandbox runs a call that spins
   on one core for 15 s (as a model's endless loop does until its timeout); and the same decode with no call
   (alone). Milliseconds per decode iteration, the median of each arm's iterations.
2. A real rollout phase, the CPU preset's (rstar2_mini.py --stage 1): --problems problems x --samples rollouts at
   T = 0.8, at most 4 turns and 512 tokens, the real sandbox, the engine at the preset's 64 rows in the dtype
   precision=auto gives it. Each round runs both arms on the same problems and seeds (the first arm alternates
   between rounds); fp32 logits are the same bits on one thread and two, so the arms' trajectories differ only
   where a tool's response text does (its execution time is printed) or a call's timing changes its result.

    python bench/bench_tool_cores.py --model runs/rstar2/sft/model                 # 3 rounds of each part
    python bench/bench_tool_cores.py --model M --phase-rounds 2 --problems 4 --after 0

The model must make tool calls (an SFT checkpoint: the bundled base model makes almost none). The last line
printed is one JSON object: beside the spinning call, ms per iteration per arm; per arm the phase's seconds
(median over rounds and each round's), model tokens/s, tool calls, decode iterations, ms per iteration and the
decode's mean threads; the ratio off / on of the medians; how many trajectories were token-identical across the
arms; the CPU kind and torch's threads.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rstar2_mini  # noqa: E402,I001  (first: it sets the main command's OpenMP waits before torch loads)
import model as models  # noqa: E402
import sandbox  # noqa: E402
import scheduler  # noqa: E402
import tasks  # noqa: E402
from config import PRESETS, Config  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", required=True, help="an SFT checkpoint directory (one that makes tool calls)")
parser.add_argument("--rounds", type=int, default=3, help="rounds beside a spinning call (all arms once each)")
parser.add_argument("--phase-rounds", type=int, default=3, help="rounds of real rollout phases (both arms once each)")
parser.add_argument("--problems", type=int, default=8, help="problems a phase (the preset's 8)")
parser.add_argument("--samples", type=int, default=8, help="rollouts of each problem (the preset's 8)")
parser.add_argument("--after", type=float, default=Config.tool_core_after_s,
                    help="tool_core_after_s of the arm that gives cores to tool calls")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--spin-rows", type=int, default=8, help="rows of the decode beside a spinning call")
parser.add_argument("--spin-tokens", type=int, default=24, help="tokens each of those rows decodes")

SPIN = "import time\nt = time.time()\nwhile time.time() - t < 15:\n    pass\nprint('spun')"


def beside_a_spinning_call(engine, pool, tokenizer, after: float | None, loop) -> list[float]:
    """ms of each decode iteration of --spin-rows rows while a sandbox call spins (after: the engine's
    tool_core_after_s, < 0 keeps its threads; None: no call, the decode alone)."""
    reqs = [scheduler.GenRequest(scheduler.render_prompt(tokenizer, f"Question {i}: what is {i} + {i}?"),
                                 args.spin_tokens, temperature=1.0, seed=i) for i in range(args.spin_rows)]
    engine.cores_taken = (lambda: pool.calls_running(after)) if after is not None and after >= 0 else None
    engine.trace = []

    async def go():
        call = None
        if after is not None:
            call = asyncio.ensure_future(pool.run(SPIN, timeout_s=30))
            while pool.calls_running(0.2) == 0:   # the call is running, past any threshold
                await asyncio.sleep(0.01)
        await asyncio.to_thread(engine.decode_wave, reqs, lambda i, r: None)
        if call is not None:
            running = pool.calls_running()
            result = await call
            assert result.stdout == "spun\n" and running == 1, f"the decode outlasted the spinning call: {result}"

    loop.run_until_complete(go())
    ms, engine.trace, engine.cores_taken = [t["ms"] for t in engine.trace], None, None
    return ms


def phase(engine, pool, tokenizer, problems, cfg, seed, loop) -> tuple[dict, list]:
    """One rollout phase: its wall time, tokens, tool calls and the engine's occupancy; and its trajectories."""
    scheduler.occupancy_stats([engine], reset=True)
    started = time.perf_counter()
    groups = scheduler.run_rollouts([engine], pool, tokenizer, problems, args.samples, cfg, seed=seed,
                                    progress=False, loop=loop)
    seconds = time.perf_counter() - started
    trajs = [t for g in groups for t in g]
    occ = scheduler.occupancy_stats([engine])
    tokens = sum(t.num_model_tokens for t in trajs)
    return {"seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1), "model_tokens": tokens,
            "tool_calls": sum(t.tool_calls for t in trajs), "tool_timeouts": sum(t.tool_statuses.get("timeout", 0)
                                                                              for t in trajs),
            "iterations": occ["rollout_iterations"], "ms_per_iteration": occ["rollout_ms_per_iteration"],
            "rows_mean": occ["rollout_rows_mean"], "threads_mean": occ["rollout_threads_mean"]}, trajs


if __name__ == "__main__":
    args = parser.parse_args()
    import torch

    cfg = Config(**PRESETS["cpu"])
    tokenizer = models.load_tokenizer(args.model)
    dtype = models.engine_dtype(None, "cpu")   # precision=auto: bf16 where the CPU has bf16 units
    engine = scheduler.TransformersEngine(models.load_model(args.model, dtype=dtype), tokenizer,
                                          max_batch=cfg.engine_batch,
                                          kv_capacity_tokens=rstar2_mini.engine_kv_tokens(cfg, tokenizer))
    problems = [(p.id, p.question) for p in (tasks.problem_at(i, seed=args.seed, levels=cfg.levels)
                                             for i in range(args.problems))]
    arms = {"cores_to_tools": args.after, "keep_threads": -1.0}
    results: dict[str, list[dict]] = {a: [] for a in arms}
    same = total = 0
    loop = asyncio.new_event_loop()
    pool = sandbox.SandboxPool(timeout_s=cfg.tool_timeout_s, isolation=cfg.sandbox_isolation)
    loop.run_until_complete(pool.start())
    spin_ms: dict[str, list[float]] = {"alone": [], **{a: [] for a in arms}}
    try:
        beside_a_spinning_call(engine, pool, tokenizer, None, loop)   # warm-up: the decoder's operands are built
        for r in range(args.rounds):   # 1. beside a spinning call
            for arm in (["alone"] + list(arms)) if r % 2 == 0 else list(arms)[::-1] + ["alone"]:
                spin_ms[arm] += beside_a_spinning_call(engine, pool, tokenizer, arms.get(arm), loop)
            print(f"round {r} beside a spinning call: " + json.dumps({a: round(statistics.median(v), 1)
                                                                     for a, v in spin_ms.items()}), flush=True)
        for r in range(args.phase_rounds):   # 2. a real rollout phase
            order = list(arms) if r % 2 == 0 else list(arms)[::-1]
            seen = {}
            for arm in order:
                rc = dataclasses.replace(rstar2_mini.rollout_config(cfg), tool_core_after_s=arms[arm])
                row, trajs = phase(engine, pool, tokenizer, problems, rc, args.seed + r, loop)
                results[arm].append(row)
                seen[arm] = [t.response_ids for t in trajs]
                print(f"round {r} {arm}: {json.dumps(row)}", flush=True)
            a, b = seen.values()
            same += sum(x == y for x, y in zip(a, b))
            total += len(a)
    finally:
        scheduler.stop_rollouts([engine], loop)
        loop.run_until_complete(pool.close())
        loop.close()

    def median(arm: str, key: str) -> float | None:
        return round(statistics.median(x[key] for x in results[arm]), 2) if results[arm] else None

    summary = {"spin_ms_per_iteration": {a: round(statistics.median(v), 1) for a, v in spin_ms.items() if v},
               "spin_iterations": {a: len(v) for a, v in spin_ms.items()}}
    summary |= {arm: {k: median(arm, k) for k in ("seconds", "tokens_per_s", "tool_calls", "iterations",
                                                  "ms_per_iteration", "threads_mean")}
               | {"seconds_each": [x["seconds"] for x in results[arm]]} for arm in arms}
    summary["keep_threads_over_cores_to_tools_seconds"] = round(
        median("keep_threads", "seconds") / median("cores_to_tools", "seconds"), 3) if args.phase_rounds else None
    summary |= {"trajectories_identical": f"{same}/{total}", "cpu": models.cpu_kind(),
                "torch_threads": torch.get_num_threads(), "after_s": args.after, "rounds": args.rounds,
                "phase_rounds": args.phase_rounds,
                "problems": args.problems, "samples": args.samples, "engine_dtype": str(dtype)}
    print(json.dumps(summary))
