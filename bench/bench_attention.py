"""The CPU engine's decode attention against rewrites of it, at rollout shapes (slot_engine.SlotDecoder).

One query per busy row attends to [the shared prompt | the row's own columns]; the prompt is read once for all
rows (GQA heads stacked). The arms, timed over 30 layers of SmolLM2-135M's shape (9 query heads, 3 KV heads, head
dim 64) in --dtype (bf16, or fp32 as an engine on a CPU without bf16 units runs), interleaved, best of 4:

  whole-buffer    slot_engine.decode_attention over every column of the busy slots, one contiguous block
                  (masked past each row's length): what the engine runs in bf16
  up-to-longest   the same over the busy slots' columns up to the longest busy row only (a strided block):
                  what the engine runs in fp32
  flash-lse       CPU flash attention (aten._scaled_dot_product_flash_attention_for_cpu) once over the own columns
                  (masked) and once over the prompt, merged by their log-sum-exp
  column-major    the KV stored [columns, slots, kv heads, d], so that reading only up to the longest busy row is a
                  slice without a batch stride; then slot_engine.decode_attention

Row lengths are drawn between a sixth of the buffer's columns and 64 short of them.

    python bench/bench_attention.py                   # about a minute
    python bench/bench_attention.py --dtype float32

The last line printed is one JSON object (milliseconds per iteration, per shape).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from slot_engine import decode_attention  # noqa: E402

KVH, G, D, P, LAYERS, SLOTS = 3, 3, 64, 470, 30, 64
SHAPES = ((8, 384), (20, 512), (20, 800), (48, 512))     # (busy rows, columns of the slot buffer)
BF = torch.bfloat16   # the dtype of the arms (--dtype)
flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def whole_buffer(q, kv, kvc, pre, mask, bmask, w):
    B = q.shape[0]
    return decode_attention(q, kv[0, :B], kv[1, :B], pre, mask)


def up_to_longest(q, kv, kvc, pre, mask, bmask, w):
    B = q.shape[0]
    return decode_attention(q, kv[0, :B, :, :w], kv[1, :B, :, :w], pre, mask[..., :P + w])


def flash_lse(q, kv, kvc, pre, mask, bmask, w):
    B = q.shape[0]
    o1, l1 = flash(q, kv[0, :B], kv[1, :B], attn_mask=bmask)[:2]
    o2, l2 = flash(q.transpose(0, 1).reshape(1, KVH, B * G, D), pre[0][None], pre[1][None])[:2]
    o2, l2 = o2.view(KVH, B, G, D).transpose(0, 1), l2.view(KVH, B, G).transpose(0, 1)
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m)[..., None], torch.exp(l2 - m)[..., None]
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(BF)


def column_major(q, kv, kvc, pre, mask, bmask, w):
    B = q.shape[0]
    keys, values = kvc[0, :w, :B].permute(1, 2, 0, 3), kvc[1, :w, :B].permute(1, 2, 0, 3)
    return decode_attention(q, keys, values, pre, mask[..., :P + w])


def main():
    global BF
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    BF = getattr(torch, parser.parse_args().dtype)
    gen = torch.Generator().manual_seed(0)
    arms = {"whole-buffer": whole_buffer, "up-to-longest": up_to_longest, "flash-lse": flash_lse,
            "column-major": column_major}
    report = {"threads": torch.get_num_threads(), "dtype": str(BF).removeprefix("torch."), "shapes": {}}
    with torch.inference_mode():
        for B, W in SHAPES:
            lens = torch.randint(W // 6, W - 64, (B,), generator=gen)
            own = torch.arange(W)[None] <= lens[:, None]
            mask = torch.zeros(B, P + W).masked_fill_(~torch.cat([torch.ones(B, P, dtype=torch.bool), own], 1),
                                                      float("-inf")).view(B, 1, 1, -1)
            bmask = torch.zeros(B, W, dtype=BF).masked_fill_(~own, float("-inf")).view(B, 1, 1, W)
            kv = [torch.randn((2, SLOTS, KVH, W, D), generator=gen).to(BF) for _ in range(LAYERS)]
            kvc = [x.permute(0, 3, 1, 2, 4).contiguous() for x in kv]          # the same values, column-major
            pre = [torch.randn((2, KVH, P, D), generator=gen).to(BF) for _ in range(LAYERS)]
            q = torch.randn((B, KVH, G, D), generator=gen).to(BF)
            w = int(lens.max()) + 1
            ref = whole_buffer(q, kv[0], kvc[0], pre[0], mask, bmask, w).float()
            row = {}
            for name, fn in arms.items():   # the same numbers, up to bf16 rounding
                got = fn(q, kv[0], kvc[0], pre[0], mask, bmask, w).float()
                row[f"{name}_max_diff"] = float((got - ref).abs().max())
            ms = {name: [] for name in arms}
            for _ in range(4):
                for name, fn in arms.items():
                    started = time.perf_counter()
                    for li in range(LAYERS):
                        fn(q, kv[li], kvc[li], pre[li], mask, bmask, w)
                    ms[name].append(1000 * (time.perf_counter() - started))
            row |= {f"{name}_ms": round(min(v), 2) for name, v in ms.items()}
            report["shapes"][f"{B}x{W}"] = row
            print(json.dumps({"rows": B, "columns": W, "longest": w, **row}), flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
