"""The matmul rate a decode step could reach on this CPU, for the engine benchmarks (bench_rollout.py,
bench_rl_step.py) to print beside the engine's tokens/s.

A decode step of R rows multiplies [R x hidden] activations by every weight matrix once: about 2 x the
parameters FLOPs a generated token (the tied output head counted once, as it runs once; attention's own scores,
the sampler and the copies are left out: they are what an engine spends beyond the roofline). The rate is that of
the MLP's up projection at the decode shape, [R x hidden] x [hidden x intermediate], timed here in fp32 and bf16
(bf16 is ~8x fp32 where the CPU has AVX512-BF16 or AMX units and emulated, slower than fp32, where it has not).

    share = tokens/s x flops_per_token / matmul rate of the dtype the engine runs in
"""
from __future__ import annotations

import time


def decode_matmul_gflops(rows: int, hidden: int, intermediate: int, dtype, seconds: float = 1.0) -> float:
    """GFLOPS of [rows x hidden] @ [hidden x intermediate] in `dtype`, the best of three timed rounds."""
    import torch

    x = torch.randn(rows, hidden).to(dtype)
    w = torch.randn(intermediate, hidden).to(dtype)
    for _ in range(3):
        torch.nn.functional.linear(x, w)
    best = 0.0
    for _ in range(3):
        n, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds / 3:
            torch.nn.functional.linear(x, w)
            n += 1
        best = max(best, 2 * rows * hidden * intermediate * n / (time.perf_counter() - started) / 1e9)
    return best


def flops_per_token(model) -> float:
    """2 x the parameters a decode step multiplies by (tied embeddings once: the head's matmul; the input
    embedding is a lookup)."""
    params = {id(p): p.numel() for p in model.parameters()}
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    if head is not embed:
        params.pop(id(embed), None)   # untied: the input embedding is a lookup, the head a matmul
    return 2.0 * sum(params.values())


def decode_rates(model, rows: int) -> dict:
    """The decode shape's fp32 and bf16 matmul GFLOPS for this model's sizes at `rows` rows."""
    import torch

    cfg = model.config
    return {str(dt).removeprefix("torch."): round(decode_matmul_gflops(rows, cfg.hidden_size,
                                                                       cfg.intermediate_size, dt), 1)
            for dt in (torch.float32, torch.bfloat16)}


def share_of_rate(tokens_per_s: float, model, gflops: float) -> float:
    """The engine's share of the matmul rate: tokens/s x FLOPs a token / the rate."""
    return tokens_per_s * flops_per_token(model) / (gflops * 1e9)
