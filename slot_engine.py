"""slot_engine.py - the forward pass behind TransformersEngine (engines.py): a Llama-family decoder over slot KV.

Data flow: TransformersEngine's decode loop holds up to max_batch rows, row i in KV slot i. Every iteration it
calls SlotDecoder.forward(ids, positions, rows) with one token for each decoding row (its last sampled token) and,
for each row admitted in that iteration, the tokens of its context that no KV covers yet; the decoder writes
their keys and values into the rows' slots in place and returns the logits of each row's last token, which the
loop samples (engines.sample_rows, paper section 3.2: the rollout engine).

    SlotKV        keys and values of every slot, [2, slots, kv heads, columns, head dim] a layer, preallocated
                  (columns grow in chunks); lens[slot] own columns filled. Row i of the running batch lives in
                  slot i: a row that leaves is replaced by the last row (one row's columns moved), a row
                  stopped at a tool call hands its columns to the engine (take) and its continuation gets them
                  back in a free slot (put), so it prefills only the tool's response; rows admitted with one
                  context take a copy of the first one's columns (copy).
    SlotDecoder   the model's weights as GEMM operands (q, k, v fused into one, gate and up into one;
                  oneDNN-prepacked where that measured faster), rebuilt at every weight sync (refresh);
                  the forward over a packed batch: no padding, one GEMM per weight for all rows' tokens.

Every prompt starts with the same ~450-token system prompt and tool schema: its KV (prefix_kv) is computed once
per weight version and read once per iteration for all rows, as one matmul with the query heads of a KV head
stacked (GQA). A decoding row attends to

    scores = [q K_prefix^T | q K_own^T] * d^-1/2 + mask,   p = softmax(scores),   out = p_prefix V_prefix + p_own V_own

(mask: -inf past the row's own length, and on the prefix for a row whose context does not start with it); an
admitted row runs sdpa over [prefix | its own columns] with a causal mask. The cast points are transformers'
(RMSNorm in fp32, cos/sin in the model's dtype, scores and softmax in fp32), so a bf16 copy samples as the
transformers model in bf16 does, and an fp32 engine gives the trainer's log-probs (tests/test_scheduler.py).
Llama, Qwen2 and Qwen3 checkpoints only; anything else is refused with a message (run it with vLLM).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED = ("llama", "qwen2", "qwen3")


def check_supported(model) -> None:
    """A clear refusal for a model this decoder does not implement."""
    cfg = model.config
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED or getattr(cfg, "use_sliding_window", False):
        raise ValueError(f"TransformersEngine runs Llama-family decoders ({', '.join(SUPPORTED)}, full attention); "
                         f"this model is {kind!r}: run it with vLLM (--set engine=vllm)")


def prepack_measures_faster(dtype) -> bool:
    """oneDNN-prepacked weights (mkldnn._linear_pointwise) against F.linear, on weights that are not in cache
    (bench/roofline.py, bench/bench_decode_parts.py print the A/B): in bf16 18% faster, bitwise equal (an
    AVX512-BF16 host); in fp32 on an AVX2-only host a decode iteration's GEMMs (the vocabulary's included) 1.34x
    faster at 48 rows up to 1.82x at 4, within fp32 rounding (oneDNN sums in another order than MKL). fp32 is
    prepacked on x86 only, where it was measured (MKL's own packed sgemm gained little)."""
    if not (hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()):
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32 and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


class Linear:
    """One GEMM operand y = x W^T + b: the plain weight, or its oneDNN-prepacked copy."""

    def __init__(self, weight, bias, prepack: bool, rows: int):
        self.bias = bias
        self.packed = prepack and weight.device.type == "cpu"
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, rows) if self.packed else weight

    def __call__(self, x):
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def fused(linears, prepack: bool, rows: int) -> Linear:
    """nn.Linear modules side by side as one operand: [W_1; W_2; ...] (one GEMM instead of several)."""
    weight = torch.cat([m.weight for m in linears]) if len(linears) > 1 else linears[0].weight
    biases = [m.bias for m in linears]
    bias = None if biases[0] is None else torch.cat(biases)
    return Linear(weight, bias, prepack, rows)


def rms_norm(x, weight, eps: float):
    """transformers' LlamaRMSNorm: in fp32, the result cast back before the weight multiplies it."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def decode_attention(q, keys, values, prefix, mask):
    """One query per row over [prefix | own columns], GQA heads stacked (the module docstring's equation).
    q [B, kv heads, g, d] (the g query heads of a KV head); keys, values [B, kv heads, W, d]; prefix: the shared
    prefix's [2, kv heads, P, d] or None; mask [B, 1, 1, P + W] (or W) additive, fp32. Returns [B, kv heads, g, d]."""
    B, kvh, g, d = q.shape
    scores = torch.matmul(q, keys.transpose(2, 3))                     # [B, kv heads, g, W]
    if prefix is not None:
        P = prefix.shape[2]
        s_pre = torch.matmul(q.transpose(0, 1).reshape(kvh, B * g, d), prefix[0].transpose(1, 2))
        scores = torch.cat([s_pre.view(kvh, B, g, P).transpose(0, 1), scores], -1)
    p = torch.softmax(scores.float() * d ** -0.5 + mask, -1).to(values.dtype)
    out = torch.matmul(p[..., -keys.shape[2]:], values)                 # [B, kv heads, g, d]
    if prefix is not None:
        p_pre = p[..., :P].transpose(0, 1).reshape(kvh, B * g, P)
        out = out + torch.matmul(p_pre, prefix[1]).view(kvh, B, g, d).transpose(0, 1)
    return out


class SlotKV:
    """Keys and values of `slots` rows, one tensor a layer [2, slots, kv heads, columns, head dim], written in
    place. One tensor a layer, so that growing it holds one layer twice at a time, not the whole cache."""

    def __init__(self, layers: int, slots: int, kv_heads: int, head_dim: int, dtype, device, columns: int = 128):
        # zeros, not garbage: a masked column still multiplies (0 x NaN would be NaN); later stale columns are
        # some row's old keys and values, finite
        self.kv = [torch.zeros((2, slots, kv_heads, columns, head_dim), dtype=dtype, device=device)
                   for _ in range(layers)]
        self.lens = [0] * slots

    @property
    def columns(self) -> int:
        return self.kv[0].shape[3]

    def reserve(self, columns: int) -> None:
        """Room for `columns` own columns in every slot, grown 128 at a time (in bf16 decode attention reads every
        column of the busy slots, so the room stays small), copying the filled part."""
        if columns <= self.columns:
            return
        used = min(max(self.lens), self.columns)
        for li, old in enumerate(self.kv):
            new = old.new_zeros((*old.shape[:3], columns + 128, old.shape[4]))
            new[:, :, :, :used] = old[:, :, :, :used]
            self.kv[li] = new

    def copy(self, src: int, dst: int) -> None:
        """Slot src's filled columns into slot dst as well (rows admitted with the same context)."""
        n = self.lens[src]
        for layer in self.kv:
            layer[:, dst, :, :n] = layer[:, src, :, :n]
        self.lens[dst] = n

    def move(self, src: int, dst: int) -> None:
        """Slot src's filled columns into slot dst, src freed (a row leaving makes room for the last row)."""
        self.copy(src, dst)
        self.lens[src] = 0

    def take(self, slot: int, n: int):
        """A copy of the first n columns of a slot, [layers, 2, kv heads, n, head dim]; the slot is free."""
        self.lens[slot] = 0
        return torch.stack([layer[:, slot, :, :n] for layer in self.kv])

    def put(self, slot: int, kept) -> None:
        n = kept.shape[3]
        self.reserve(n)
        for layer, part in zip(self.kv, kept):
            layer[:, slot, :, :n] = part
        self.lens[slot] = n


class SlotDecoder:
    """A Llama-family model's forward over a packed batch of rows in SlotKV slots (see the module docstring)."""

    def __init__(self, model, slots: int, device):
        check_supported(model)
        cfg = model.config
        self.model, self.slots, self.device = model, slots, device
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.dtype = next(model.parameters()).dtype
        self.prepack = prepack_measures_faster(self.dtype) and torch.device(device).type == "cpu"
        self.layers = None        # per layer: its GEMM operands and norms (refresh)
        self.head = None          # the output projection's prepacked operand, else None (refresh)
        self.cache: SlotKV | None = None
        self._rope = None         # cos, sin [positions, head dim] in the model's dtype
        self.read_columns = 0     # own columns of each slot the last forward's decode attention read

    # -- weights ---------------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """The GEMM operands from the model's current weights (after every weight sync: fused and prepacked
        copies are copies). Held as copies, never as views replacing the model's parameters: an engine may share
        the trainer's model, whose optimizer and checkpoints must keep seeing separate tensors."""
        self.layers = self.head = None   # the old operands go before the new ones are built
        layers = []
        for layer in self.model.model.layers:
            att, mlp = layer.self_attn, layer.mlp
            layers.append({
                "norm1": layer.input_layernorm.weight, "norm2": layer.post_attention_layernorm.weight,
                "qkv": fused([att.q_proj, att.k_proj, att.v_proj], self.prepack, self.slots),
                "o": fused([att.o_proj], self.prepack, self.slots),
                "gate_up": fused([mlp.gate_proj, mlp.up_proj], self.prepack, self.slots),
                "down": fused([mlp.down_proj], self.prepack, self.slots), "act": mlp.act_fn,
                "q_norm": getattr(att, "q_norm", None), "k_norm": getattr(att, "k_norm", None)})
        self.layers = layers
        head = self.model.get_output_embeddings()   # prepacked: 21-45 ms against 39-71 for W h^T at 8-64 rows in bf16
        self.head = fused([head], True, self.slots) if self.prepack and isinstance(head, torch.nn.Linear) else None

    def rope(self, positions):
        """cos and sin at these positions ([T, head dim], the model's dtype), from a table grown by doubling
        (transformers' rotary embedding computes the table, so every rope scaling it knows is honoured)."""
        need = int(positions.max()) + 1
        if self._rope is None or self._rope[0].shape[0] < need:
            n = max(need, 2 * (self._rope[0].shape[0] if self._rope is not None else 1024))
            x = torch.empty((1, 1, self.head_dim), dtype=self.dtype, device=self.device)
            cos, sin = self.model.model.rotary_emb(x, torch.arange(n, device=self.device)[None])
            self._rope = cos[0], sin[0]
        cos, sin = self._rope[0][positions], self._rope[1][positions]
        half = self.head_dim // 2
        return cos, torch.cat([-sin[:, :half], sin[:, half:]], -1)  # rotate_half's sign folded into sin

    # -- the forward -----------------------------------------------------------------------------------------
    def new_cache(self, columns: int = 128, slots: int | None = None) -> SlotKV:
        return SlotKV(len(self.layers), slots or self.slots, self.kv_heads, self.head_dim, self.dtype, self.device,
                      columns)

    def forward(self, ids: list[int], positions: list[int], rows: list[tuple[int, bool]], prefix=None):
        """ids, positions: the packed tokens of rows 0..B-1 in order; rows[i] = (tokens of row i, whether it
        attends to the prefix): the first rows with one token each decode, the others are admitted and
        prefilled. Row i's tokens go to slot i at its columns lens[i]...; returns logits [B, vocab] in fp32.
        prefix: the shared prefix's KV [layers, 2, kv heads, P, head dim], or None."""
        cache, dev = self.cache, self.device
        starts = cache.lens[:len(rows)]
        cache.reserve(max(s + n for s, (n, _) in zip(starts, rows)))
        ids_t = torch.tensor(ids, device=dev)
        pos_t = torch.tensor(positions, device=dev)
        cos, sin = self.rope(pos_t)
        cos, sin = cos[:, None], sin[:, None]
        n_dec = next((i for i, (n, _) in enumerate(rows) if n != 1), len(rows))
        dec = self._decode_plan(starts[:n_dec], [p for _, p in rows[:n_dec]], prefix)
        h = self.model.model.embed_tokens(ids_t)
        H, kvh, d = self.heads, self.kv_heads, self.head_dim
        for li, w in enumerate(self.layers):
            x = rms_norm(h, w["norm1"], self.eps)
            qkv = w["qkv"](x).view(len(ids), H + 2 * kvh, d)
            qk, v = qkv[:, :H + kvh], qkv[:, H + kvh:]
            if w["q_norm"] is not None:   # Qwen3: RMSNorm of every head before rope
                qk = torch.cat([w["q_norm"](qk[:, :H]), w["k_norm"](qk[:, H:])], 1)
            qk = qk * cos + torch.roll(qk, d // 2, -1) * sin                  # rope: x cos + rotate_half(x) sin
            q, k = qk[:, :H], qk[:, H:]
            layer_pre = None if prefix is None else prefix[li]
            out = [self._decode_attention(li, q[:n_dec], k[:n_dec], v[:n_dec], dec, layer_pre)] if n_dec else []
            at = n_dec
            for slot in range(n_dec, len(rows)):
                n, has_prefix = rows[slot]
                out.append(self._prefill_attention(li, slot, starts[slot], q[at:at + n], k[at:at + n],
                                                   v[at:at + n], layer_pre if has_prefix else None))
                at += n
            h = h + w["o"](torch.cat(out) if len(out) > 1 else out[0])
            x = rms_norm(h, w["norm2"], self.eps)
            gate, up = w["gate_up"](x).chunk(2, -1)
            h = h + w["down"](w["act"](gate) * up)
        for slot, (n, _) in enumerate(rows):
            cache.lens[slot] = starts[slot] + n
        last = torch.tensor([n for n, _ in rows], device=dev).cumsum(0) - 1   # each row's last token
        h = self.model.model.norm(h[last])
        if self.head is not None:
            return self.head(h).float()
        head = self.model.get_output_embeddings()
        logits = torch.mm(head.weight, h.T).T   # W h^T: MKL runs it 1.6-2x faster than h W^T at 8-64 rows (fp32)
        return (logits if head.bias is None else logits + head.bias).float()

    def _decode_plan(self, starts, has_prefix, prefix):
        """What every layer's decode attention shares: where the rows' new keys and values go, the columns read,
        the additive mask."""
        if not starts:
            self.read_columns = 0
            return None
        dev, B = self.device, len(starts)
        # bf16: every column of the slots, so that slots 0..B-1 are one contiguous block (bf16 batched matmuls ran
        # 4-10x faster on it than on the first max-length columns, a batch stride of the buffer: AVX512-BF16 host).
        # fp32: the columns up to the longest busy row only; the strided block ran as fast per column (AVX2-only
        # host), and a row that is not the longest reads fewer masked columns (docs/benchmarks.md)
        width = self.cache.columns if self.dtype == torch.bfloat16 else max(starts) + 1
        self.read_columns = width
        own = torch.arange(width, device=dev)[None] <= torch.tensor(starts, device=dev)[:, None]
        if prefix is not None:
            seen = torch.tensor(has_prefix, device=dev)[:, None].expand(B, prefix.shape[3])
            own = torch.cat([seen, own], 1)
        mask = torch.zeros(own.shape, device=dev).masked_fill_(~own, float("-inf")).view(B, 1, 1, -1)
        # where each row's new key and value go: row b, KV head h at column starts[b] of slot b, as rows of the
        # layer's buffer seen as [2 x slots x kv heads x columns, head dim] (keys first, then values)
        S, kvh, C = self.cache.kv[0].shape[1:4]
        rows = ((torch.arange(2, device=dev)[:, None, None] * S + torch.arange(B, device=dev)[None, :, None]) * kvh
                + torch.arange(kvh, device=dev)[None, None, :]) * C + torch.tensor(starts, device=dev)[None, :, None]
        return {"kv_rows": rows.reshape(-1), "width": width, "mask": mask}

    def _decode_attention(self, li, q, k, v, plan, prefix):
        """One query per row (rows 0..B-1 in slots 0..B-1): write its key and value, attend (decode_attention)."""
        kv, B = self.cache.kv[li], q.shape[0]
        # [B, kv heads, d] keys and values at each row's column: one index_copy_ (with an advanced-index write of k
        # and one of v, the engine ran 1.04x slower at 64 rows in fp32, the same tokens: docs/benchmarks.md)
        kv.view(-1, self.head_dim).index_copy_(0, plan["kv_rows"], torch.stack([k, v]).reshape(-1, self.head_dim))
        keys, values = kv[0, :B, :, :plan["width"]], kv[1, :B, :, :plan["width"]]
        q = q.reshape(B, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
        return decode_attention(q, keys, values, prefix, plan["mask"]).reshape(B, self.heads * self.head_dim)

    def _prefill_attention(self, li, slot, start, q, k, v, prefix):
        """n queries of one admitted row over [prefix | its columns 0..start+n): sdpa with a causal mask."""
        kv, n = self.cache.kv[li], q.shape[0]
        kv[0, slot, :, start:start + n] = k.transpose(0, 1)
        kv[1, slot, :, start:start + n] = v.transpose(0, 1)
        keys, values = kv[0, slot, :, :start + n], kv[1, slot, :, :start + n]
        mask = torch.ones((n, start + n), dtype=torch.bool, device=self.device).tril(start)
        if prefix is not None:
            keys, values = torch.cat([prefix[0], keys], 1), torch.cat([prefix[1], values], 1)
            mask = torch.cat([mask.new_ones((n, prefix.shape[2])), mask], 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                             enable_gqa=True)          # [1, heads, n, d]
        return out[0].transpose(0, 1).reshape(n, self.heads * self.head_dim)

    def prefix_kv(self, ids: list[int]):
        """The KV of one shared prefix, [layers, 2, kv heads, P, head dim]: a prefill of it alone."""
        held, self.cache = self.cache, self.new_cache(len(ids) + 1, slots=1)
        try:
            self.forward(ids, list(range(len(ids))), [(len(ids), False)])
            return self.cache.take(0, len(ids))
        finally:
            self.cache = held
