"""Measure what memory_plan.py assumes, with the real code (rl_update.token_logprobs) on small Qwen3-shaped models.

The plan multiplies per-token figures by 14B-sized dimensions; this script measures those figures on this CPU, on
models of the same architecture made small (transformers' Qwen3Config: hidden 256-512, intermediate 3x hidden,
Qwen3's vocabulary of 151,936, 1-3 layers) in bf16, the dtype FSDP2's mixed-precision policy computes in:

    bytes kept for backward, per token    the live bytes the forward leaves behind (allocations minus frees while
                                          it ran, torch's profiler), with and without activation checkpointing;
                                          also what autograd's saved_tensors_hooks see (unique storages, weights
                                          left out: a checkpointed layer keeps its inputs outside those hooks)
    peak of forward + backward, per token the most bytes live at once above the start (weights' gradients
                                          allocated beforehand, so they are not counted)
    the log-prob chunk's peak             models.chunked_logprobs alone: bytes per token x vocabulary entry, for a
                                          chunk of C tokens and for no chunking

    python bench/measure_memory.py                 # ~30 min on 2 AVX2 cores (bf16 matmuls are emulated there);
                                                   # one JSON line per measurement, the last line all of them
    python bench/measure_memory.py --vocab 512     # the same activations in ~1 min; the peak is then the
                                                   # layers' (the vocabulary sizes the head and its logits only,
                                                   # measured apart at V = 151,936)

On a GPU the same functions would read torch.cuda.max_memory_allocated; here the CPU allocator is profiled.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def qwen3_like(hidden: int, layers: int, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
               vocab: int = 151936, tie: bool = False):
    """A random Qwen3 causal LM of the given shape in bf16 (the weights FSDP2 gathers for compute)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
                      tie_word_embeddings=tie, max_position_embeddings=4096, attn_implementation="sdpa")
    return Qwen3ForCausalLM(cfg).to(torch.bfloat16)


def allocated_bytes(fn):
    """(result of fn, peak, end): bytes allocated and not yet freed while fn ran, at their most and at its end
    (torch's profiler records every CPU allocation with the running total)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()

    def walk(events):
        for e in events:
            yield e
            yield from walk(e.children)

    allocs = sorted((e for e in walk(prof.profiler.kineto_results.experimental_event_tree())
                     if e.tag == _EventType.Allocation), key=lambda e: e.start_time_ns)
    if not allocs:
        return out, 0, 0
    # the running total is the process's since profiling first started: count from where this run began
    start = allocs[0].extra_fields.total_allocated - allocs[0].extra_fields.alloc_size
    totals = [e.extra_fields.total_allocated - start for e in allocs]
    return out, max(0, max(totals)), totals[-1]


def saved_activation_bytes(model, fn):
    """Unique storages autograd saves for backward while fn runs (saved_tensors_hooks), the weights left out."""
    import torch

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(n for ptr, n in seen.items() if ptr not in weights)


def measure_update(model, rows: int, length: int, checkpointing: bool, chunk: int) -> dict:
    """One micro-batch of `rows` x `length` tokens through rl_update.token_logprobs as FSDP's ranks run it (no
    shared prefix), every token but the first kept: bytes per token kept after the forward and at the peak."""
    import torch

    import rl_update

    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.config.vocab_size, (length,), generator=gen).tolist() for _ in range(rows)]
    masks = [[0] + [1] * (length - 1) for _ in range(rows)]

    def forward():
        return rl_update.token_logprobs(model, seqs, 0.7, share_prefix=False, masks=masks, chunk_tokens=chunk,
                                        checkpoint_layers=checkpointing)

    for p in model.parameters():   # the weights' gradients exist beforehand: the measured passes only add to them
        p.grad = torch.zeros_like(p)
    logp, _, kept = allocated_bytes(forward)
    _, saved = saved_activation_bytes(model, forward)
    _, peak, _ = allocated_bytes(lambda: forward().sum().backward())
    del logp
    tokens = rows * length
    return {"kept_per_token": kept / tokens, "saved_hooks_per_token": saved / tokens, "peak_per_token": peak / tokens}


def measure_logits(hidden: int, tokens: int, chunk: int, vocab: int = 151936) -> dict:
    """models.chunked_logprobs alone, forward and backward, on bf16 hidden states and a bf16 head: its peak above
    what existed before (the head's gradient allocated beforehand), and per token of one chunk and vocabulary entry
    once the head's gradient buffer (fp32, 4 x V x H: the chunks add into it) is taken out."""
    import torch

    import model as models

    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(vocab, hidden, generator=gen) * 0.02).to(torch.bfloat16).requires_grad_()
    h = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=gen)

    def run():
        models.chunked_logprobs(h, y, weight, None, 0.7, chunk).sum().backward()

    run()   # gradients allocated
    _, peak, _ = allocated_bytes(run)
    live = tokens if chunk <= 0 else min(chunk, tokens)
    buffer = 4 * vocab * hidden if chunk > 0 else 0
    return {"hidden": hidden, "tokens": tokens, "chunk": chunk, "peak_bytes": peak,
            "bytes_per_token_vocab": (peak - buffer - 2 * hidden * tokens) / (live * vocab)}


def shapes(quick: bool):
    """(hidden, layers, heads, kv_heads) measured."""
    if quick:
        return [(256, 2, 8, 1)]
    return [(256, 1, 4, 2), (256, 2, 4, 2), (256, 3, 4, 2), (512, 2, 8, 2), (256, 2, 8, 1)]


def compare(model, rows: int, length: int, checkpointing: bool, chunk: int) -> dict:
    """Measured bytes per token against memory_plan's, for one micro-batch of rows x length on this model (bf16
    weights: FSDP2's compute dtype; on a CPU transformers' sdpa passes k and v unrepeated, no padding mask)."""
    import memory_plan as MP

    d = MP.ModelDims.from_hf_config(model.config)
    got = measure_update(model, rows, length, checkpointing, chunk)
    act = MP.activation_bytes_per_token(d, checkpointing, "bf16", kv_repeated=False)
    tokens = rows * length
    # no FSDP here: the backward's peak is the layer run again, or the head's chunks with its gradient buffer
    peak = act["kept"] + max(act["backward"], (MP.logits_bytes(d, chunk, tokens) + 2 * d.vocab * d.hidden) / tokens)
    return {"hidden": d.hidden, "layers": d.layers, "heads": d.heads, "kv_heads": d.kv_heads, "vocab": d.vocab,
            "checkpointing": checkpointing, "chunk": chunk, "tokens": tokens,
            **{k: round(v) for k, v in got.items()}, "plan_kept_per_token": act["kept"], "plan_peak_per_token":
            round(peak), "kept_ratio": round(got["kept_per_token"] / act["kept"], 3),
            "peak_ratio": round(got["peak_per_token"] / peak, 3)}


def main(argv=None) -> dict:
    import torch

    import memory_plan as MP

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one shape only")
    p.add_argument("--vocab", type=int, default=151936, help="the models' vocabulary (151,936: Qwen's)")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--chunk", type=int, default=64, help="logprob_chunk_tokens of the measured update")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    activations = []
    for hidden, layers, heads, kv in shapes(args.quick):
        model = qwen3_like(hidden, layers, heads, kv, vocab=args.vocab)
        for ckpt in (False, True):
            activations.append(compare(model, args.rows, args.length, ckpt, args.chunk))
            print(json.dumps(activations[-1]), flush=True)
    logits = [measure_logits(64, 128, 0), measure_logits(64, 128, 32), measure_logits(128, 256, 32)]
    for row in logits:
        print(json.dumps(row), flush=True)
    summary = {"activations": activations, "logits": logits,
               "plan_logits_bytes_per_token_vocab": MP.LOGITS_BYTES_PER_TOKEN_VOCAB}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
