"""The weight sync's gather on CPU ranks (gloo): rank 0's host peak and the time, fp32 full state vs bf16 stream.

    python bench/bench_weight_sync.py [--model PATH] [--bucket-mb 16] [--repeats 2]

Before each rollout phase the trainer's new weights go to the engines. The full fp32 state gathered on rank 0
(distributed.full_state, then cast to bf16 bucket by bucket) holds 4 bytes x P there: 59 GB of host memory at 14B.
distributed.gathered_weights casts each rank's shard to bf16 and all-gathers one tensor at a time while the
buckets go out (vllm_engine.VLLMEngine.load_weights), so rank 0 holds a bucket and one tensor. Both are timed and
rank 0's resident memory is sampled every 2 ms (above its level when the variant starts), interleaved
`--repeats` times on two CPU ranks under torchrun; what an engine does with a bucket is left out (dropped here).
Also the offload's round trip (distributed.move_trainer: shards and AdamW moments to host memory and back; on
CPU ranks a copy within host memory). The last line is JSON. The bucket is 16 MB by default: the 1 GiB of vllm_engine.SYNC_BUCKET_BYTES is to a 14B
model's 29.5 GB what 16 MB is to SmolLM2-135M's 270 MB in bf16, roughly.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rss_peak(fn) -> tuple[float, int]:
    """(seconds, peak resident bytes above the start) of fn(), sampled every 2 ms."""
    import psutil

    proc, peak, done = psutil.Process(), [0], threading.Event()
    base = proc.memory_info().rss

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss - base)
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    fn()
    s = time.perf_counter() - t0
    done.set()
    t.join()
    return s, peak[0]


def buckets(pairs, bucket_bytes: int) -> int:
    """Collect (name, tensor) pairs into buckets of bucket_bytes and drop each: the engine's side left out."""
    bucket, size, sent = [], 0, 0
    for _, t in pairs:
        bucket.append(t.contiguous())
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            bucket, size, sent = [], 0, sent + 1
    return sent + bool(bucket)


def ranks(model_path: str, bucket_mb: int, repeats: int) -> None:
    import torch

    import distributed as D
    import model as models

    D.init_distributed()
    policy = D.shard_policy(models.load_model(model_path), bf16=False)
    lead, bucket_bytes = D.DIST.rank == 0, bucket_mb << 20

    def fp32_full_state():
        weights, _ = D.full_state(policy)
        if lead:
            buckets(((k, v.to(torch.bfloat16)) for k, v in weights.items()), bucket_bytes)
        del weights

    def bf16_stream():
        buckets(D.gathered_weights(policy, torch.bfloat16), bucket_bytes)

    rows = []
    for _ in range(repeats):
        for name, fn in (("fp32_full_state", fp32_full_state), ("bf16_stream", bf16_stream)):
            models.release_freed_memory()
            D.barrier()
            s, peak = rss_peak(fn)
            rows.append({"variant": name, "s": round(s, 3), "rank0_host_peak_mb": round(peak / 2 ** 20, 1)})
    # the offload's round trip (phases.py): the shards and AdamW moments to host memory and back. On CPU ranks both
    # ends are host memory: a copy, which says nothing of a GPU's PCIe transfer
    import rstar2_mini as R

    optimizer, _ = R.make_optimizer(policy, R.Config())
    for p in policy.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()   # AdamW's moments exist from here on
    offload = []
    for _ in range(repeats):
        away, back = D.move_trainer(policy, optimizer, "host"), D.move_trainer(policy, optimizer, "device")
        offload.append({"bytes_per_rank": away["bytes"], "to_host_s": away["s"], "to_device_s": back["s"]})
    if lead:
        params = sum(p.numel() for p in policy.parameters())
        for r in offload:
            print(json.dumps({"variant": "offload_round_trip", **r}))
        best = {v: {"s": min(r["s"] for r in rows if r["variant"] == v),
                    "rank0_host_peak_mb": min(r["rank0_host_peak_mb"] for r in rows if r["variant"] == v)}
                for v in ("fp32_full_state", "bf16_stream")}
        for r in rows:
            print(json.dumps(r))
        print(json.dumps({"bench": "weight_sync", "params": params, "bucket_mb": bucket_mb, "ranks": D.DIST.world,
                          "host": "2-core AMD EPYC (AVX512-BF16), shared", **best,
                          "peak_ratio": round(best["bf16_stream"]["rank0_host_peak_mb"] /
                                              max(best["fp32_full_state"]["rank0_host_peak_mb"], 0.1), 3),
                          "time_ratio": round(best["bf16_stream"]["s"] / best["fp32_full_state"]["s"], 3),
                          "offload_mb_per_rank": round(offload[-1]["bytes_per_rank"] / 2 ** 20, 1),
                          "offload_to_host_s": min(r["to_host_s"] for r in offload),
                          "offload_to_device_s": min(r["to_device_s"] for r in offload)}))
    sys.stdout.flush()
    D.exit_rank(0)


def main() -> None:
    import model as models

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--bucket-mb", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    path = str(args.model or models.resolve_model(models.DEFAULT_MODEL))
    if args.rank:
        ranks(path, args.bucket_mb, args.repeats)
        return
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                    "127.0.0.1", "--master-port", "29517", __file__, "--rank", "--model", path, "--bucket-mb",
                    str(args.bucket_mb), "--repeats", str(args.repeats)], env=env, check=True)


if __name__ == "__main__":
    main()
