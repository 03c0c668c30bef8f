"""Benchmark the CPU engine alone against the engine of a baseline revision, in one process, interleaved, and
against the floor of its decode iterations (bench/roofline.py).

The same 64 prompts (tasks' questions, the real system prompt), sampled at temperature 1 with the same seeds and
max_new_tokens, through TransformersEngine.decode_wave of this tree and of the baseline revision (engines.py from
git, --baseline, imported as its own module on its own copy of the model), each on the engine's dtype (bf16 where
the CPU has bf16 units, as precision=auto), in rounds baseline, current, baseline, current: a disturbance of the
machine hits both. Tokens/s counts the tokens each returns (up to and including eos). Then:

  * the floor: this CPU's cold-weight GEMM rate (every weight of the model in one pass, as a decode iteration
    reads them; plain and oneDNN-prepacked), its STREAM triad bandwidth, and the per-iteration floor
    max(FLOPs / rate, bytes / bandwidth) at the current engine's mean rows and own columns per iteration (its trace);
    the engine's share of it = floor ms / measured ms per iteration;
  * exactness: in fp32, the tokens of both engines for the same requests (the sampler draws the same uniforms).

    python bench/bench_engine.py                                   # 64 rows x 128 new tokens
    python bench/bench_engine.py --rows 64 --new-tokens 256 --rounds 3

The last line printed is one JSON object.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engines as engines_now  # noqa: E402
import model as models  # noqa: E402
import git_baseline  # noqa: E402
import roofline  # noqa: E402
import scheduler  # noqa: E402
import tasks  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", default=models.DEFAULT_MODEL)
parser.add_argument("--rows", type=int, default=64, help="prompts, and rows of both engines (the CPU preset: 64)")
parser.add_argument("--new-tokens", type=int, default=128)
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--baseline", default="050bc57", help="git revision whose engines.py is the baseline engine")
parser.add_argument("--exact-rows", type=int, default=8, help="requests of the fp32 token comparison")
args = parser.parse_args()


def baseline_engines():
    """engines.py of the baseline revision, imported as its own module (git_baseline.module_at)."""
    return git_baseline.module_at(args.baseline, "engines.py", "engines_baseline")


import torch  # noqa: E402

path = models.resolve_model(args.model)
tokenizer = models.load_tokenizer(path)
dtype = models.engine_dtype(None)
old = baseline_engines()
prompts = [scheduler.render_prompt(tokenizer, p.question) for p in tasks.generate_problems(args.rows, seed=1)]
requests = [scheduler.GenRequest(p, args.new_tokens, 1.0, 1.0, seed=i) for i, p in enumerate(prompts)]


def decode(engine, reqs):
    results = {}
    engine.decode_wave(reqs, lambda i, r: results.__setitem__(i, r))
    return [results[i] for i in range(len(reqs))]


def timed(engine, trace: bool = False):
    """(tokens, seconds) of decoding every request (after a short warm-up); trace: record its iterations."""
    decode(engine, requests[:2])
    if trace:
        engine.trace = []
    started = time.perf_counter()
    out = decode(engine, requests)
    return sum(len(r.token_ids) for r in out), time.perf_counter() - started


engines = {"baseline": old.TransformersEngine(models.load_model(path, dtype=dtype), tokenizer, max_batch=args.rows,
                                              kv_capacity_tokens=10**7),
           "current": scheduler.TransformersEngine(models.load_model(path, dtype=dtype), tokenizer,
                                                   max_batch=args.rows, kv_capacity_tokens=10**7)}
rates = {"baseline": [], "current": []}
trace = None
for r in range(args.rounds):
    for arm in ("baseline", "current"):
        tokens, seconds = timed(engines[arm], trace=arm == "current")
        rates[arm].append(tokens / seconds)
        if arm == "current":
            trace = engines[arm].trace
        print(json.dumps({"arm": arm, "round": r, "tokens": tokens, "seconds": round(seconds, 2),
                          "tok_s": round(tokens / seconds, 1)}), flush=True)
del engines

# the floor at the current engine's iterations (decode iterations: one token a row)
model = models.load_model(path, dtype=dtype)
decode_its = [t for t in trace if t["tokens"] == t["rows"]]
rows_mean = statistics.mean(t["rows"] for t in decode_its)
cols_mean = statistics.mean(t["columns"] for t in decode_its)
ms_mean = statistics.mean(t["ms"] for t in decode_its)
P = len(engines_now.shared_prompt_prefix(tokenizer))
gemm = {"plain": roofline.cold_gemm_gflops(model, args.rows, dtype)}
if dtype == torch.bfloat16:
    gemm["prepacked"] = roofline.cold_gemm_gflops(model, args.rows, dtype, prepack=True)
gbs = roofline.stream_gbs()
floor = roofline.iteration_floor_ms(model, rows_mean, cols_mean, P, max(gemm.values()), gbs,
                                    torch.finfo(dtype).bits // 8)
print(json.dumps({"cold_gemm_gflops": {k: round(v, 1) for k, v in gemm.items()}, "stream_gbs": round(gbs, 1),
                  "rows_mean": round(rows_mean, 1), "columns_mean": round(cols_mean, 1), "ms_per_iteration":
                  round(ms_mean, 2), **floor}), flush=True)
del model

# exactness in fp32: the same tokens from both engines
fp32 = [old.TransformersEngine(models.load_model(path), tokenizer, max_batch=args.exact_rows),
        scheduler.TransformersEngine(models.load_model(path), tokenizer, max_batch=args.exact_rows)]
few = [scheduler.GenRequest(p, 48, 1.0, 1.0, seed=100 + i) for i, p in enumerate(prompts[:args.exact_rows])]
outs = [decode(e, few) for e in fp32]
same = sum(a.token_ids == b.token_ids for a, b in zip(*outs))
lp_diff = max(max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) for a, b in zip(*outs))

base, cur = statistics.mean(rates["baseline"]), statistics.mean(rates["current"])
print(json.dumps({
    "current_tok_s": round(cur, 1), "baseline_tok_s": round(base, 1), "current_over_baseline": round(cur / base, 3),
    "rows": args.rows, "new_tokens": args.new_tokens, "rounds": args.rounds, "dtype": str(dtype).removeprefix("torch."),
    "host": models.cpu_kind(), "threads": torch.get_num_threads(), "baseline": args.baseline,
    "ms_per_iteration": round(ms_mean, 2), "floor_ms": floor["floor_ms"], "bound": floor["bound"],
    "share_of_floor": round(floor["floor_ms"] / ms_mean, 3),
    "cold_gemm_gflops": {k: round(v, 1) for k, v in gemm.items()},
    "stream_gbs": round(gbs, 1), "fp32_same_tokens": f"{same}/{len(few)}", "fp32_max_logprob_diff": round(lp_diff, 6),
}))
