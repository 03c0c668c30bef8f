"""Regional torch.compile of the CPU engine's decoder layer against eager, at the decode shapes of a rollout phase.

One decode iteration of slot_engine.SlotDecoder runs, for each of the model's layers, the same block: RMSNorm, the
fused QKV GEMM, rope, attention of one query per row over [shared prefix | the row's own columns] (GQA heads
stacked), the output GEMM and residual, RMSNorm, the fused gate/up GEMM, SiLU, the down GEMM and residual. This
script times that block over all layers of the real model (its weights, the engine's dtype: bf16 where the CPU has
bf16 units) on B rows with W own columns, three ways, interleaved:

  eager        the engine's arithmetic (its operands: fused, oneDNN-prepacked in bf16 where that measured faster)
  eager-plain  the same with plain F.linear on the fused weights (what inductor can take: the prepacked op does
               not lower with dynamic shapes)
  compiled     eager-plain through torch.compile (inductor, default mode, dynamic shapes; the weights are graph
               inputs, never frozen, so that a weight sync would need no recompile)

and prints the compile time (the first call), the graphs compiled across the shapes (a recompile per new shape would
be paid in every rollout phase), whether an in-place weight update recompiles, and per shape the milliseconds per
iteration of each arm, and how far one compiled layer's output is from the engine's (the largest difference over the
largest value: fusion rounds differently). The KV write of the new token is left out of every arm (the same work).
Then what compiling would save in a run of the main command: (eager - compiled) ms x decode iterations, against the
compile time paid once per run.

    python bench/bench_compile.py                            # the bundled model; about 3 minutes on 2 cores
    python bench/bench_compile.py --model runs/n0/sft/model --iterations 700 --steps 40

The last line printed is one JSON object.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = ((8, 256), (20, 448), (40, 512), (64, 640))   # (busy rows, own columns): a rollout phase's range


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a model directory (default: the bundled SmolLM2-135M)")
    parser.add_argument("--reps", type=int, default=3, help="timed rounds of each arm per shape (the best counts)")
    parser.add_argument("--iterations", type=int, default=700, help="decode iterations a step (for the net)")
    parser.add_argument("--steps", type=int, default=40, help="RL steps a run (for the net)")
    return parser.parse_args()


def decode_layer(h, w, linear, keys, values, prefix, mask, cos, sin, shape):
    """One decoder layer for B decoding rows (slot_engine.SlotDecoder.forward, decode rows only): h [B, hidden];
    keys, values [B, kv heads, W, d]; prefix [2, kv heads, P, d]; mask [B, 1, 1, P + W]."""
    import torch

    from slot_engine import decode_attention, rms_norm

    H, kvh, d, eps = shape
    B = h.shape[0]
    x = rms_norm(h, w["norm1"], eps)
    qkv = linear(x, w["qkv"]).view(B, H + 2 * kvh, d)
    qk = qkv[:, :H + kvh]
    qk = qk * cos + torch.roll(qk, d // 2, -1) * sin
    out = decode_attention(qk[:, :H].reshape(B, kvh, H // kvh, d), keys, values, prefix, mask)
    h = h + linear(out.reshape(B, H * d), w["o"])
    x = rms_norm(h, w["norm2"], eps)
    gate, up = linear(x, w["gate_up"]).chunk(2, -1)
    return h + linear(torch.nn.functional.silu(gate) * up, w["down"])


def main():
    args = parse_args()
    import torch
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    import engines
    import model as models
    from slot_engine import SlotDecoder

    path = models.resolve_model(args.model or models.DEFAULT_MODEL)
    dtype = models.engine_dtype(None)
    model = models.load_model(path, dtype=dtype)
    decoder = SlotDecoder(model, 64, "cpu")
    decoder.refresh()   # the engine's operands (fused; prepacked in bf16)
    cfg = model.config
    shape = (decoder.heads, decoder.kv_heads, decoder.head_dim, decoder.eps)
    P = len(engines.shared_prompt_prefix(models.load_tokenizer(path)))
    ops = [{"norm1": L["norm1"], "norm2": L["norm2"], "qkv": L["qkv"], "o": L["o"], "gate_up": L["gate_up"],
            "down": L["down"]} for L in decoder.layers]

    def plain(m):   # the fused weights as plain tensors
        return torch.cat([x.weight for x in m]) if isinstance(m, list) else m.weight
    weights = []
    for layer in model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        weights.append({"norm1": layer.input_layernorm.weight, "norm2": layer.post_attention_layernorm.weight,
                        "qkv": plain([a.q_proj, a.k_proj, a.v_proj]), "o": plain(a.o_proj),
                        "gate_up": plain([mlp.gate_proj, mlp.up_proj]), "down": plain(mlp.down_proj)})
    hidden, kvh, d = cfg.hidden_size, decoder.kv_heads, decoder.head_dim
    gen = torch.Generator().manual_seed(0)

    def inputs(B, W):
        kv = [torch.randn((2, B, kvh, W, d), generator=gen).to(dtype) for _ in weights]
        pre = [torch.randn((2, kvh, P, d), generator=gen).to(dtype) for _ in weights]
        lens = torch.randint(W // 4, W, (B,), generator=gen)
        own = torch.cat([torch.ones((B, P), dtype=torch.bool), torch.arange(W)[None] < lens[:, None]], 1)
        mask = torch.zeros(own.shape).masked_fill_(~own, float("-inf")).view(B, 1, 1, -1)
        cos, sin = decoder.rope(lens)
        return torch.randn((B, hidden), generator=gen).to(dtype), kv, pre, mask, cos[:, None], sin[:, None]

    def iteration(layer_fn, layer_weights, linear, data):
        h, kv, pre, mask, cos, sin = data
        for w, k, p in zip(layer_weights, kv, pre):
            h = layer_fn(h, w, linear, k[0], k[1], p, mask, cos, sin, shape)
        return h

    def engine_linear(x, op):
        return op(x)

    compiled_layer = torch.compile(decode_layer, dynamic=True)
    arms = {"eager": (decode_layer, ops, engine_linear), "eager-plain": (decode_layer, weights, F.linear),
            "compiled": (compiled_layer, weights, F.linear)}
    report = {"host": models.cpu_kind(), "threads": torch.get_num_threads(), "dtype": str(dtype).removeprefix("torch."),
              "model": str(path), "prefix": P, "shapes": {}}
    with torch.inference_mode():
        for B, W in SHAPES:
            data = inputs(B, W)
            graphs = counters["stats"]["unique_graphs"]
            started = time.perf_counter()
            iteration(*arms["compiled"], data)                        # compiles at the first shape (or recompiles)
            first_s = time.perf_counter() - started
            if "compile_s" not in report:
                report["compile_s"] = round(first_s, 1)
            h, kv, pre, mask, cos, sin = data                         # one layer, compiled against eager
            one = [fn(h, w[0], lin, kv[0][0], kv[0][1], pre[0], mask, cos, sin, shape).float()
                   for fn, w, lin in (arms["compiled"], arms["eager"])]
            ms = {arm: [] for arm in arms}
            for _ in range(args.reps):
                for arm, spec in arms.items():
                    started = time.perf_counter()
                    iteration(*spec, data)
                    ms[arm].append(1000 * (time.perf_counter() - started))
            row = {arm: round(min(v), 2) for arm, v in ms.items()}
            row |= {"first_call_s": round(first_s, 2), "new_graphs": counters["stats"]["unique_graphs"] - graphs,
                    "one_layer_max_rel_diff": float((one[0] - one[1]).abs().max() / one[1].abs().max())}
            report["shapes"][f"{B}x{W}"] = row
            print(json.dumps({"rows": B, "columns": W, **row}), flush=True)
        # a weight sync writes into the same tensors: it must not recompile
        graphs = counters["stats"]["unique_graphs"]
        for w in weights:
            w["qkv"].mul_(1.0 + 2 ** -7)
        iteration(*arms["compiled"], inputs(*SHAPES[1]))
        report["weight_update_recompiled"] = counters["stats"]["unique_graphs"] > graphs
    rows = list(report["shapes"].values())
    saved_ms = sum(r["eager"] - r["compiled"] for r in rows) / len(rows)
    report |= {"mean_eager_ms": round(sum(r["eager"] for r in rows) / len(rows), 2),
               "mean_compiled_ms": round(sum(r["compiled"] for r in rows) / len(rows), 2),
               "compiled_over_eager": round(sum(r["eager"] for r in rows) / sum(r["compiled"] for r in rows), 3),
               "graphs": counters["stats"]["unique_graphs"],
               "run_net_s": round(saved_ms / 1000 * args.iterations * args.steps - report["compile_s"], 1),
               "iterations": args.iterations, "steps": args.steps}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
