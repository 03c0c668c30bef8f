"""One decode iteration of the CPU engine by its parts, at rollout shapes, and the sampler's inverse CDF against
the whole-row running sum it replaced.

A rollout phase is a few hundred decode iterations (engines.TransformersEngine.decode_loop), each one
slot_engine.SlotDecoder.forward over the busy rows plus engines.sample_rows. With the real model's operands (bf16
where the CPU has bf16 units, else fp32: the engine's fused GEMMs, oneDNN-prepacked on x86) and B rows of random
KV over [shared prompt | own columns], this script times, per shape:

  iteration   SlotDecoder.forward of B decoding rows (one token each) and sample_rows at T = 0.8
  gemms       every layer's fused QKV, output, gate/up and down GEMMs and the vocabulary projection, at B rows
  attention   slot_engine.decode_attention of every layer over the same KV and prompt
  sampler     sample_rows alone on [B, vocabulary] logits
  norms       the 2 x layers + 1 RMSNorms

(the rest of an iteration: rope, residuals, SiLU, the KV write, the embedding, Python), the GEMMs' rate
(GFLOPS: 2 x B x their parameters) and weight streaming (GB/s), and decode attention's read rate of the KV (GB/s).
Then two A/Bs, each interleaved: the GEMMs as the engine runs them (`gemms_engine`: oneDNN-prepacked where
slot_engine.prepack_measures_faster says so) against plain operands on the same fused weights (`gemms_plain`:
F.linear, and W h^T for the vocabulary, as an fp32 engine ran them before it prepacked); and the sampler's inverse
CDF on the same logits and uniforms: `blocks` (engines.inverse_cdf, the blocks' float64 sums, then a running sum
inside one block) against `whole-row` (one float64 running sum over each row, the sampler's arithmetic before);
the tokens of the two are compared.

    python bench/bench_decode_parts.py --model runs/rstar2/sft/model      # about a minute on 2 cores

Times are medians of --reps rounds. The last line printed is one JSON object.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = ((4, 300), (20, 400), (48, 450))   # (busy rows, longest own context): the tail, a phase's mean, its bulk


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a model directory (default: the bundled SmolLM2-135M)")
    parser.add_argument("--reps", type=int, default=15, help="timed rounds of each part per shape (the median counts)")
    return parser.parse_args()


def median_ms(fn, reps: int) -> float:
    fn()                                             # warm: oneDNN builds its kernels for the shape
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def interleaved(arms: dict, reps: int) -> dict:
    """Median milliseconds of each arm, the arms alternating within every round (a slow spell hits all)."""
    for fn in arms.values():
        fn()
    ms = {arm: [] for arm in arms}
    for _ in range(reps):
        for arm, fn in arms.items():
            started = time.perf_counter()
            fn()
            ms[arm].append(1000 * (time.perf_counter() - started))
    return {arm: round(statistics.median(v), 2) for arm, v in ms.items()}


def whole_row_inverse_cdf(probs, u):
    """The sampler's inverse CDF before engines.inverse_cdf: one float64 running sum over each whole row."""
    import torch

    cdf = torch.cumsum(probs, -1, dtype=torch.float64)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=cdf.shape[1] - 1)


def main():
    args = parse_args()
    import torch

    import engines
    import model as models
    import roofline
    from slot_engine import SlotDecoder, decode_attention, rms_norm

    path = models.resolve_model(args.model or models.DEFAULT_MODEL)
    dtype = models.engine_dtype(None)
    model = models.load_model(path, dtype=dtype)
    prefix_ids = engines.shared_prompt_prefix(models.load_tokenizer(path))
    decoder = SlotDecoder(model, 64, "cpu")
    plain = SlotDecoder(model, 64, "cpu")    # the same fused weights as plain operands (the A/B below)
    plain.prepack = False
    cfg = model.config
    hidden, inter, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kvh, d, g = decoder.kv_heads, decoder.head_dim, decoder.heads // decoder.kv_heads
    params = roofline.flops_per_token(model) / 2    # the weights a decode step multiplies by (head included)
    gen = torch.Generator().manual_seed(0)
    report = {"host": models.cpu_kind(), "threads": torch.get_num_threads(), "dtype": str(dtype).removeprefix("torch."),
              "model": str(path), "prefix": len(prefix_ids), "shapes": {}}
    with torch.inference_mode():
        decoder.refresh()
        plain.refresh()
        prefix = decoder.prefix_kv(prefix_ids)
        P = len(prefix_ids)
        for B, W in SHAPES:
            decoder.cache = decoder.new_cache(W)
            for layer in decoder.cache.kv:
                layer.normal_(generator=gen)
            lens = torch.randint(W // 4, W, (B,), generator=gen).tolist()
            gens = [torch.Generator().manual_seed(b) for b in range(B)]

            def iteration():
                decoder.cache.lens[:B] = lens
                logits = decoder.forward(list(range(100, 100 + B)), [P + n for n in lens], [(1, True)] * B, prefix)
                return engines.sample_rows(logits, [0.8] * B, [1.0] * B, gens)

            x = torch.randn(B, hidden).to(dtype)
            x_att = torch.randn(B, decoder.heads * d).to(dtype)
            x_mlp = torch.randn(B, inter).to(dtype)

            def gemms(dec=decoder):
                for w in dec.layers:
                    w["qkv"](x), w["o"](x_att), w["gate_up"](x), w["down"](x_mlp)
                if dec.head is not None:
                    dec.head(x)
                else:
                    torch.mm(model.get_output_embeddings().weight, x.T)

            plan = decoder._decode_plan(lens, [True] * B, prefix)
            q = torch.randn(B, kvh, g, d).to(dtype)

            def attention():
                for li, kv in enumerate(decoder.cache.kv):
                    decode_attention(q, kv[0, :B, :, :plan["width"]], kv[1, :B, :, :plan["width"]], prefix[li],
                                     plan["mask"])

            logits = torch.randn(B, V, generator=gen) * 3

            def sampler():
                engines.sample_rows(logits, [0.8] * B, [1.0] * B, gens)

            norm = decoder.layers[0]["norm1"]

            def norms():
                for _ in range(2 * len(decoder.layers) + 1):
                    rms_norm(x, norm, decoder.eps)

            row = {part: round(median_ms(fn, args.reps), 2) for part, fn in
                   (("iteration", iteration), ("gemms", gemms), ("attention", attention), ("sampler", sampler),
                    ("norms", norms))}
            row["rest"] = round(row["iteration"] - sum(row[k] for k in ("gemms", "attention", "sampler", "norms")), 2)
            kv_bytes = (len(decoder.cache.kv) * (2 * B * kvh * plan["width"] * d + 2 * kvh * P * d)
                        * decoder.cache.kv[0].element_size())
            row |= {"gemm_gflops": round(2 * B * params / row["gemms"] / 1e6, 1),
                    "gemm_weight_gb_s": round(params * x.element_size() / row["gemms"] / 1e6, 1),
                    "attention_kv_gb_s": round(kv_bytes / row["attention"] / 1e6, 1)}
            # the engine's GEMM operands against plain ones, interleaved
            ms = interleaved({"gemms_engine": gemms, "gemms_plain": lambda: gemms(plain)}, args.reps)
            row |= {f"{arm}_ms": v for arm, v in ms.items()}
            # the inverse CDF, two arms interleaved on the same probabilities and uniforms
            probs = torch.log_softmax(logits / 0.8, -1).exp()
            u = torch.rand(B, generator=gen, dtype=torch.float64)
            ms = interleaved({"blocks": lambda: engines.inverse_cdf(probs, u),
                              "whole-row": lambda: whole_row_inverse_cdf(probs, u)}, args.reps)
            row |= {f"inverse_cdf_{arm}_ms": v for arm, v in ms.items()}
            row["inverse_cdf_same_tokens"] = bool(torch.equal(engines.inverse_cdf(probs, u),
                                                              whole_row_inverse_cdf(probs, u)))
            report["shapes"][f"{B}x{W}"] = row
            print(json.dumps({"rows": B, "columns": W, **row}), flush=True)
        decoder.cache = None
    print(json.dumps(report))


if __name__ == "__main__":
    main()
