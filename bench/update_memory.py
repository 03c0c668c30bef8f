"""Resident memory of the policy update over several updates, under each oneDNN primitive-cache capacity.

oneDNN keeps a compiled kernel ("primitive") for each GEMM shape it has run (ONEDNN_PRIMITIVE_CACHE_CAPACITY, 1,024
by default; rstar2_mini.py sets 128), and torch's bridge to it (ideep) a cache of matmul descriptors that hold their
primitives (LRU_CACHE_CAPACITY, 1,024 by default; rstar2_mini.py sets 128, --ideep-capacity here). The update's
micro-batches have token counts that vary from one to the next, so most of them add kernels. Each capacity runs in
its own process (oneDNN reads the variable once), one after another: the SFT model (or any), AdamW as the main
command makes it, then updates (rl_update.policy_update, the CPU preset's settings) on batches shaped like the main
command's: a warm-up of 12 trajectories, then --updates of 24, each trajectory the system prompt, a question and 1-3
model turns with tool responses between (random tokens; the memory does not depend on their values). The same seeds
in every process, so every capacity sees the same batches. Resident size (RSS) is read every 20 ms.

    python bench/update_memory.py --model runs/rstar2/sft/model                  # capacities 1024 and 128
    python bench/update_memory.py --model runs/rstar2/sft/model --capacities 1024,128,64 --updates 3
    python bench/update_memory.py --model runs/rstar2/sft/model --profile        # and live tensors by kind
    python bench/update_memory.py --model M --capacities 128 --set micro_batch_tokens=512   # another update setting
    python bench/update_memory.py --model M --capacities 128 --ideep-capacity 1024   # torch's own cache at its default

Per capacity and update: seconds, the live tensors (distinct storages the garbage collector sees) and RSS before it
(after models.free_between_phases), its RSS peak; both after the last. --profile: the last update of each process
runs under torch's memory profiler and prints the live tensor bytes at their peak by kind (parameters, optimizer
state, activations, gradients...), against which the RSS peak shows what the allocator holds beyond live tensors
(the profiler's own records raise RSS: read RSS from a run without --profile). The last line printed is one JSON
object.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rss_gb() -> float:
    """Resident size in kB / 10^6, as RESULTS.md reads /usr/bin/time's kB."""
    return psutil.Process().memory_info().rss / 1024 / 1e6


def live_tensor_gb() -> float:
    """Bytes of the distinct tensor storages the garbage collector can see (weights, AdamW moments, gradients...)."""
    import gc

    import torch

    seen = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()) / 1e9


def shaped_batch(tokenizer, questions, seed: int, rows: int) -> list:
    """(trajectory, advantage) pairs: the system prompt and a question, then 1-3 model turns of 20-200 tokens each
    followed by a tool response of 10-150, and a last model turn of 10-100."""
    import scheduler

    rng, kept = random.Random(seed), []
    words = lambda lo, hi: [rng.randrange(100, 20000) for _ in range(rng.randrange(lo, hi))]  # noqa: E731
    for i in range(rows):
        segments = []
        for _ in range(rng.randrange(1, 4)):
            segments += [scheduler.Segment(words(20, 200), 1), scheduler.Segment(words(10, 150), 0)]
        segments.append(scheduler.Segment(words(10, 100), 1))
        prompt = scheduler.render_prompt(tokenizer, questions[i % len(questions)])
        kept.append((scheduler.Trajectory(f"q{i // 4}", prompt, segments), rng.choice([-1.0, -0.5, 0.5, 1.0])))
    return kept


def live_tensor_peak(prof) -> dict:
    """The most tensor bytes live at once during the profiled update, by the memory profiler's categories (GB)."""
    import numpy as np
    import torch
    from torch.profiler._memory_profiler import _CATEGORY_TO_COLORS, MemoryProfileTimeline

    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    sizes = np.array(sizes)
    at = int(sizes.sum(1).argmax())
    names = ["none"] + [str(c).split(".")[-1].lower() for c in _CATEGORY_TO_COLORS]   # column 0: unused
    parts = {names[j]: round(float(sizes[at, j]) / 1e9, 3) for j in range(sizes.shape[1]) if sizes[at, j]}
    return {"live_peak_gb": round(float(sizes[at].sum()) / 1e9, 3), "by_kind_gb": parts}


def one_process(args) -> dict:
    """The updates of one capacity, in this process (the parent set ONEDNN_PRIMITIVE_CACHE_CAPACITY)."""
    import model as models
    import rl_update
    import rstar2_mini as R
    import tasks
    import torch

    path = models.resolve_model(args.model)
    tokenizer = models.load_tokenizer(path)
    # the main command's update settings, and --set's overrides
    cfg = R.parse_args(["--stage", "1", *[a for item in args.set for a in ("--set", item)]])
    model = models.load_model(path, dtype=torch.float32)
    optimizer, schedule = R.make_optimizer(model, cfg)
    rt = R.Runtime(model, tokenizer, engines=[], pool=None, loop=None)
    questions = [q.question for q in tasks.heldout_problems(8, levels=(1,))]
    peak = [0.0]

    def sample():
        while True:
            peak[0] = max(peak[0], rss_gb())
            time.sleep(0.02)

    threading.Thread(target=sample, daemon=True).start()
    out = {"capacity": os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"],
           "ideep_capacity": os.environ["LRU_CACHE_CAPACITY"], "threads": torch.get_num_threads(), "updates": []}
    plan = [(1, 12)] + [(3 + k, 24) for k in range(args.updates)]   # (seed, trajectories): a warm-up first
    for k, (seed, rows) in enumerate(plan):
        kept = shaped_batch(tokenizer, questions, seed, rows)
        models.free_between_phases()
        live = live_tensor_gb()
        before = peak[0] = rss_gb()
        profiled = args.profile and k == len(plan) - 1
        started = time.perf_counter()
        with (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                     record_shapes=True, with_stack=True) if profiled
              else contextlib.nullcontext()) as prof:
            rl_update.policy_update(rt, cfg, optimizer, schedule, kept, random.Random(seed))
        row = {"trajectories": rows, "tokens": sum(len(t.input_ids) for t, _ in kept),
               "s": round(time.perf_counter() - started, 1), "live_tensors_before_gb": round(live, 3),
               "rss_before_gb": round(before, 3),
               "rss_peak_gb": round(peak[0], 3)}
        if profiled:
            row |= live_tensor_peak(prof)
        out["updates"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    models.free_between_phases()
    out["live_tensors_after_gb"], out["rss_after_gb"] = round(live_tensor_gb(), 3), round(rss_gb(), 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model directory (default: the bundled model)")
    p.add_argument("--capacities", default="1024,128", help="oneDNN primitive-cache capacities, one process each")
    p.add_argument("--ideep-capacity", default="128", help="LRU_CACHE_CAPACITY, torch's own cache of matmul "
                   "descriptors (ideep), in every process: rstar2_mini.py sets 128; torch's default is 1024")
    p.add_argument("--updates", type=int, default=2, help="updates of 24 trajectories after the warm-up")
    p.add_argument("--profile", action="store_true", help="live tensors by kind at the last update's peak")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a Config override for the update, as rstar2_mini.py takes it (e.g. micro_batch_tokens=512)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(one_process(args)))
        return
    import model as models
    args.model = args.model or str(models.resolve_model(models.DEFAULT_MODEL))
    results = []
    for capacity in args.capacities.split(","):
        env = os.environ | {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": capacity.strip(),
                            "LRU_CACHE_CAPACITY": args.ideep_capacity}
        cmd = [sys.executable, __file__, "--child", "--model", args.model, "--updates", str(args.updates),
               *[a for item in args.set for a in ("--set", item)]]
        done = subprocess.run(cmd + (["--profile"] if args.profile else []), env=env, stdout=subprocess.PIPE,
                              text=True, cwd=str(ROOT))
        if done.returncode != 0:
            sys.exit(f"the run at capacity {capacity} failed (exit {done.returncode})")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"capacity {capacity}: " + ", ".join(
            f"update {k} ({u['trajectories']} traj., {u['tokens']} tokens) {u['s']} s, RSS {u['rss_before_gb']} -> "
            f"peak {u['rss_peak_gb']} GB" for k, u in enumerate(results[-1]["updates"]))
            + f"; after {results[-1]['rss_after_gb']} GB", flush=True)
    print(json.dumps({"bf16_units": models.bf16_is_fast("cpu"), "overrides": args.set, "runs": results}))


if __name__ == "__main__":
    main()
