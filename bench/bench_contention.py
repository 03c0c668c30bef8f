"""Benchmark a CPU training step and CPU decoding alone and beside another busy process, for OpenMP's wait policy
and torch's thread count: what keeps the run near its share of a shared machine.

torch runs its CPU kernels on an OpenMP team of one thread per core (libgomp here). At the end of each parallel
region a thread that is done waits for the others, and by default it waits by spinning (GOMP_SPINCOUNT) before it
sleeps. With another busy process on the cores, a team member that the kernel has descheduled holds the whole team
up, and the spinning members burn the time slices that member needs: the step slows far more than its share.
OMP_WAIT_POLICY=PASSIVE makes waiting threads sleep at once (with GOMP_SPINCOUNT=3000, as rstar2_mini.py sets
it, after about 30 us of spinning); torch.set_num_threads(1) has no team at all. Sandbox
workers running model-written code beside the engine's decoding are the same case (decoding runs many small
kernels: many waits).

Every variant runs in a fresh child process (OMP_WAIT_POLICY is read when torch loads libgomp), in rounds that
interleave the variants and the two conditions, so a slow spell of a shared host hits all of them alike:

  alone   nothing else started by this script (on a shared host other load may still be there: the load
          average is recorded beside every measurement)
  busy    one child process spinning in a Python loop for the whole measurement (one core's worth of load)

Each child times, on the bundled SmolLM2-135M (or --model tiny):
  train   forward + backward of a fixed batch (--batch x --tokens random token ids, cross-entropy on every token)
  decode  --decode-steps single-token steps of a batch of --decode-rows rows with a KV cache after a short prefill

    python bench/bench_contention.py              # 2 rounds of 3 variants x 2 conditions (docs/contention.md)
    python bench/bench_contention.py --rounds 4 --model tiny

On a shared 2-core machine the default command took 50 minutes, most of it in the default variant's children.

The last line printed is one JSON object: per variant and condition the seconds of a train step and of a decode
step (the median over rounds of each child's median), the slowdown busy / alone of each variant, and each
variant's time relative to the default variant in the same condition.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (environment for the child, torch threads: 0 = torch's default, one a core)
VARIANTS = {
    "default": ({}, 0),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, 0),
    "passive_spin3000": ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"}, 0),   # rstar2_mini's setting
    "one_thread": ({}, 1),
}


def child(args) -> dict:
    """One variant's timings in this (fresh) process: train steps, then decode steps."""
    sys.path.insert(0, str(ROOT))
    import torch

    import model as models

    if args.threads:
        torch.set_num_threads(args.threads)
    path = models.resolve_model(models.DEFAULT_MODEL)
    tokenizer = models.load_tokenizer(path)
    model = models.tiny_model(tokenizer, seed=0) if args.model == "tiny" else models.load_model(path)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    ids = torch.randint(0, vocab, (args.batch, args.tokens), generator=gen)
    model.train()
    train_s = []
    for k in range(args.reps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        model.zero_grad(set_to_none=True)
        if k:
            train_s.append(time.perf_counter() - t0)
        del logits, loss

    model.eval()
    prompt = torch.randint(0, vocab, (args.decode_rows, 64), generator=gen)
    decode_s = []
    with torch.no_grad():
        for k in range(2):  # the first is a warm-up
            out = model(input_ids=prompt, use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(args.decode_steps):
                out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            if k:
                decode_s.append((time.perf_counter() - t0) / args.decode_steps)
    return {"train_s": statistics.median(train_s), "train_all_s": train_s, "decode_s": decode_s[0],
            "threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "load_avg_1min": round(os.getloadavg()[0], 2)}


def spinner() -> subprocess.Popen:
    """A busy process: one core's worth of pure-Python work until it is killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def run_variant(name: str, busy: bool, args) -> dict:
    env_extra, threads = VARIANTS[name]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    env.update(env_extra)
    cmd = [sys.executable, __file__, "--child", "--threads", str(threads), "--model", args.model,
           "--batch", str(args.batch), "--tokens", str(args.tokens), "--reps", str(args.reps),
           "--decode-rows", str(args.decode_rows), "--decode-steps", str(args.decode_steps)]
    spin = spinner() if busy else None
    try:
        done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    finally:
        if spin is not None:
            spin.kill()
            spin.wait()
    if done.returncode != 0:
        sys.exit(f"bench_contention: the {name} child ({'busy' if busy else 'alone'}) failed "
                 f"(exit {done.returncode}); run it alone: {' '.join(cmd)}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs every variant alone and busy once")
    p.add_argument("--model", choices=["smollm2-135m", "tiny"], default="smollm2-135m")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=2, help="timed train steps per child (after one warm-up)")
    p.add_argument("--decode-rows", type=int, default=8)
    p.add_argument("--decode-steps", type=int, default=12)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    runs = [(name, busy) for name in VARIANTS for busy in (False, True)]
    results: dict = {(name, busy): [] for name, busy in runs}
    for r in range(args.rounds):
        shift = (r * 3) % len(runs)  # a different order every round
        for name, busy in runs[shift:] + runs[:shift]:
            res = run_variant(name, busy, args)
            results[(name, busy)].append(res)
            print(f"[round {r + 1}] {name:10s} {'busy ' if busy else 'alone'}: train {res['train_s']:.3f}s "
                  f"decode {res['decode_s'] * 1000:.1f}ms/step  threads {res['threads']}  "
                  f"load {res['load_avg_1min']}", flush=True)

    def median(name, busy, key):
        return statistics.median(x[key] for x in results[(name, busy)])

    summary = {"model": args.model, "cores": os.cpu_count(), "rounds": args.rounds,
               "train_batch": [args.batch, args.tokens], "decode_rows": args.decode_rows,
               "load_avg_1min_mean": round(statistics.mean(x["load_avg_1min"] for v in results.values() for x in v), 2)}
    for name in VARIANTS:
        for key in ("train_s", "decode_s"):
            alone, busy = median(name, False, key), median(name, True, key)
            summary[f"{name}_{key}_alone"] = round(alone, 4)
            summary[f"{name}_{key}_busy"] = round(busy, 4)
            summary[f"{name}_{key}_slowdown"] = round(busy / alone, 2)
            for cond, value in (("alone", alone), ("busy", busy)):
                summary[f"{name}_{key}_{cond}_vs_default"] = round(value / median("default", cond == "busy", key), 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
