"""The matmul rate a decode step could reach on this CPU, for the engine benchmarks (bench_rollout.py,
bench_rl_step.py) to print beside the engine's tokens/s.

A decode step of R rows multiplies [R x hidden] activations by every weight matrix once: about 2 x the
parameters FLOPs a generated token (the tied output head counted once, as it runs once; attention's own scores,
the sampler and the copies are left out: they are what an engine spends beyond the roofline). The rate is that of
the MLP's up projection at the decode shape, [R x hidden] x [hidden x intermediate], timed here in fp32 and bf16
(bf16 is ~8x fp32 where the CPU has AVX512-BF16 or AMX units and emulated, slower than fp32, where it has not).

    share = tokens/s x flops_per_token / matmul rate of the dtype the engine runs in

Below: the floor of a real decode iteration (cold weights, memory bandwidth), and of a whole rollout phase (its
iterations plus the tokens it prefilled).
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


# ---- the floor of a real decode iteration: weights that are not in cache, and the memory bandwidth
#
# A decode iteration of B rows streams every weight once (~270 MB in bf16 for SmolLM2-135M: no cache holds it)
# and each row's own keys and values (layers x 2 x kv heads x head dim per column). Its floor is
#
#     floor = max(FLOPs / cold GEMM rate, bytes / bandwidth),
#     FLOPs = B x flops_per_token + 4 x B x (P + L) x layers x heads x head dim     (attention: scores and values)
#     bytes = weight bytes + B x L x kv bytes per column + P x kv bytes per column  (the prefix read once)


def layer_weights(model, dtype):
    """The model's 2-D weights in `dtype`, in the order a forward reads them (the head last)."""
    ws = [p.detach().to(dtype) for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name]
    head = model.get_output_embeddings().weight
    return ws + ([] if any(w.data_ptr() == head.data_ptr() for w in ws) else [head.detach().to(dtype)])


def cold_gemm_gflops(model, rows: int, dtype, prepack: bool = False, seconds: float = 2.0) -> float:
    """GFLOPS of one pass over every weight of the model ([rows x in] @ W^T each), cold: the pass reads more than
    any cache holds, as a decode iteration does. prepack: oneDNN-prepacked weights (what the engine runs where
    slot_engine.prepack_measures_faster says so)."""
    import torch
    import torch.nn.functional as F

    ws = layer_weights(model, dtype)
    if prepack:
        ws = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in ws]
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(dtype) for w in layer_weights(model, dtype)}
        shapes = [w.shape for w in layer_weights(model, dtype)]

        def run():
            for w, (_, k) in zip(ws, shapes):
                torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
    else:
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(dtype) for w in ws}

        def run():
            for w in ws:
                F.linear(xs[w.shape[1]], w)
    flops = 2 * rows * sum(w.numel() for w in layer_weights(model, dtype))
    run()
    best, started = float("inf"), time.perf_counter()
    while time.perf_counter() - started < seconds:
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return flops / best / 1e9


def stream_gbs(mb: int = 256, seconds: float = 2.0) -> float:
    """Memory bandwidth in GB/s, STREAM's triad a = b + s c on fp32 arrays of `mb` MB each (3 x mb moved a pass;
    on all the threads torch uses)."""
    import torch

    n = mb * (1 << 20) // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    torch.add(b, c, alpha=3.0, out=a)
    best, started = float("inf"), time.perf_counter()
    while time.perf_counter() - started < seconds:
        t = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best = min(best, time.perf_counter() - t)
    return 3 * n * 4 / best / 1e9


def iteration_floor_ms(model, rows: float, columns: float, prefix: int, gflops: float, gbs: float,
                       dtype_bytes: int) -> dict:
    """The floor of one decode iteration of `rows` rows with `columns` own columns each (see above), in ms, and
    which bound sets it."""
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_col = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * d * dtype_bytes
    flops = rows * flops_per_token(model) + 4 * rows * (prefix + columns) * cfg.num_hidden_layers \
        * cfg.num_attention_heads * d
    weight_bytes = sum(w.numel() for w in layer_weights(model, model.dtype)) * dtype_bytes
    moved = weight_bytes + (rows * columns + prefix) * kv_col
    compute_ms, memory_ms = 1e3 * flops / (gflops * 1e9), 1e3 * moved / (gbs * 1e9)
    return {"floor_ms": round(max(compute_ms, memory_ms), 2), "compute_ms": round(compute_ms, 2),
            "memory_ms": round(memory_ms, 2), "bound": "memory" if memory_ms > compute_ms else "compute"}


# ---- the floor of a rollout phase: its decode iterations, and the tokens it prefilled
#
# Besides one sampled token per busy row, a phase forwards the contexts of the rows it admits: each prompt past
# the shared prefix, and after every tool call the tool's response (engine.occupancy()'s prefill_tokens). A
# prefilled token runs every decoder layer but not the vocabulary head, and attends to its row's context:
#
#     phase floor = iterations x iteration floor (rows_mean, columns_mean)
#                   + prefill tokens x (layer FLOPs + 4 x (P + columns_mean) x layers x heads x head dim) / rate
#
# (an admitted row's last token is counted in both terms: under 2% of a real phase's tokens).


def phase_floor_s(model, iterations: int, rows: float, columns: float, prefix: int, prefill_tokens: int,
                  gflops: float, gbs: float, dtype_bytes: int) -> dict:
    """The floor of a rollout phase (see above), in seconds: its decode part and its prefill part."""
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    head = model.get_output_embeddings().weight
    layer_params = sum(p.numel() for name, p in model.named_parameters()
                       if p.dim() == 2 and "embed" not in name and p is not head)   # the decoder layers' matrices
    per_token = 2 * layer_params + 4 * (prefix + columns) * cfg.num_hidden_layers * cfg.num_attention_heads * d
    decode_s = iterations * iteration_floor_ms(model, rows, columns, prefix, gflops, gbs, dtype_bytes)["floor_ms"] / 1e3
    prefill_s = prefill_tokens * per_token / (gflops * 1e9)
    return {"floor_s": decode_s + prefill_s, "decode_floor_s": decode_s, "prefill_floor_s": prefill_s}
