"""memory_plan.py - what each GPU holds while the recipe trains, from the model's config.json alone, before a run
starts (DESIGN.md "Memory at paper scale"; the paper trains Qwen3-14B on 64 MI300X GPUs, section 4; this project's
paper scale is one 8-GPU node, distributed.py).

    config.json -> ModelDims -> per GPU, in bytes:
      trainer   sharded fp32 state: weights, gradients, AdamW m and v = 16 x P / ranks (FSDP2, distributed.py)
                + CUDA context and NCCL buffers
                + activations kept for backward (bytes per token x tokens of the largest micro-batch)
                + the larger of the backward's two peaks: the output head (the log-prob chunk's logits, the head's
                  unit: gathered bf16 weights, gradient, fp32 reduce-scatter input), or a decoder layer run again
                  (its activations, its unit)
      vLLM      bf16 weights (each GPU's engine holds the whole model) + its runtime + KV cache
                (2 x layers x kv_heads x head_dim x 2 bytes a token)
      margin    what is left once the trainer, a reserve for fragmentation and vLLM's minimum (KV for one
                full-length rollout, as vLLM demands at start-up) are counted; vLLM's KV takes it too
                (gpu_memory_utilization = (GPU - trainer - reserve) / GPU, rounded down)
    -> fits or not, the largest micro_batch_tokens that fits, vLLM's gpu_memory_utilization
       (vllm_engine.vllm_placement), and the one line a run that does not fit stops with (rstar2_mini.main)

    python rstar2_mini.py --preset paper --stage all --model bench/model_configs/qwen3-14b --plan --gpus 8 \
        --gpu-memory-gb 79.2        # (on the GPU node itself: --plan alone; a run checks the same plan first)

Per-token activation bytes are counted tensor by tensor for Qwen2/Qwen3 decoder layers (layer_bytes_per_token) and
were measured with the real code on small models of the same shape (bench/measure_memory.py; the test holds the
formulas to the measurements: tests/test_memory_plan.py; figures in docs/memory.md). The vLLM runtime, CUDA
context and fragmentation reserve are assumptions, not measurements: no GPU was available.
"""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from config import Config, UsageError, apply_stage

GiB = 2 ** 30
PROMPT_TOKENS = 2048          # a row is at most prompt + max_response_tokens (vLLM's max_model_len: rstar2_mini)
TRAINER_RUNTIME = 1.5 * GiB   # CUDA context (~0.5 GiB) and NCCL buffers of a training process (assumed)
VLLM_RUNTIME = 4 * GiB        # vLLM's CUDA context, CUDA graphs, profile-run activations, sampler (assumed)
LOGITS_BYTES_PER_TOKEN_VOCAB = 10   # a chunk's backward: fp32 logits / T (4) + softmax (4) + bf16 logits (2)


def reserve_bytes(gpu_bytes: float) -> float:
    """Left unallocated for the caching allocator's fragmentation: 5% of the GPU, at least 2 GiB (assumed)."""
    return max(2 * GiB, 0.05 * gpu_bytes)


@dataclass
class ModelDims:
    """The shape of a Qwen2/Qwen3/Llama-style decoder, as config.json gives it."""
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool            # Qwen3 normalises q and k per head (RMSNorm): more activations, 2 x head_dim weights
    qkv_bias: bool           # Qwen2 has biases on q, k, v
    name: str = ""

    @classmethod
    def from_hf_config(cls, c, name: str = "") -> "ModelDims":
        get = (lambda k, d=None: c.get(k, d)) if isinstance(c, dict) else (lambda k, d=None: getattr(c, k, d))
        kind = get("model_type", "")
        head_dim = get("head_dim") or get("hidden_size") // get("num_attention_heads")
        return cls(hidden=get("hidden_size"), intermediate=get("intermediate_size"), layers=get("num_hidden_layers"),
                   heads=get("num_attention_heads"), kv_heads=get("num_key_value_heads") or get("num_attention_heads"),
                   head_dim=head_dim, vocab=get("vocab_size"), tied=bool(get("tie_word_embeddings", False)),
                   qk_norm=kind == "qwen3", qkv_bias=bool(get("attention_bias", kind == "qwen2")), name=name or kind)

    @classmethod
    def from_config_json(cls, path) -> "ModelDims":
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.exists():
            raise UsageError(f"{path}: no config.json for the memory plan (a Hugging Face model directory)")
        return cls.from_hf_config(json.loads(file.read_text()), name=file.parent.name)


# ----------------------------------------------------------------------------------------------------------
# Parameters


def layer_params(d: ModelDims) -> int:
    """One decoder layer: q, k, v, o projections, the MLP's gate, up and down, two RMSNorms (+ Qwen3's q/k norms)."""
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    attn = d.hidden * q + 2 * d.hidden * kv + q * d.hidden + ((q + 2 * kv) if d.qkv_bias else 0)
    return attn + 3 * d.hidden * d.intermediate + 2 * d.hidden + (2 * d.head_dim if d.qk_norm else 0)


def total_params(d: ModelDims) -> int:
    """P: embeddings, the output head unless tied, the layers, the final norm. Qwen3-14B: 14.77e9."""
    vocab = d.vocab * d.hidden
    return vocab * (1 if d.tied else 2) + d.layers * layer_params(d) + d.hidden


# ----------------------------------------------------------------------------------------------------------
# Activations, bytes per token (bf16 compute as under FSDP2's mixed precision; "autocast": fp32 weights under bf16
# autocast, the single-process GPU path with accelerate). Counted from what each op saves for backward in
# transformers' Qwen3 layer, and measured (bench/measure_memory.py).


def layer_bytes_per_token(d: ModelDims, precision: str = "bf16", kv_repeated: bool = True) -> int:
    """What one decoder layer saves for backward, per token (no checkpointing):

      RMSNorm x 2        fp32 copy of the input 4h, rsqrt 4, bf16 normalised 2h, its output 2h (proj. input)  16h + 8
                         (autocast: fp32 input 4h, fp32 output 4h, a bf16 cast per projection: 3 x 2h / 2 x 2h) 26h + 8
      q/k norms (Qwen3)  fp32 copies and bf16 outputs of q and k, rsqrt per head                6q + 6kv + 4(n_h + n_kv)
      attention          rotated q 2q, k 2kv, v 2kv, output 2q, logsumexp 4 n_h                 4q + 4kv + 4 n_h
                         (on GPUs, transformers repeats k and v to every head when a mask is present: +4(q - kv))
      MLP                gate 2i, up 2i, silu(gate) 2i, silu(gate) * up 2i                                   8i
    with q = heads x head_dim, kv = kv_heads x head_dim, i = intermediate. Qwen3-14B, bf16: 299 KB a token."""
    h, i, q, kv = d.hidden, d.intermediate, d.heads * d.head_dim, d.kv_heads * d.head_dim
    norms = (26 if precision == "autocast" else 16) * h + 8
    qk = (6 * q + 6 * kv + 4 * (d.heads + d.kv_heads)) if d.qk_norm else 0
    attn = 4 * q + 4 * kv + 4 * d.heads + (4 * (q - kv) if kv_repeated else 0)
    return norms + qk + attn + 8 * i


def activation_bytes_per_token(d: ModelDims, checkpointing: bool, precision: str = "bf16", kv_repeated: bool = True,
                               kv_cache: bool = False) -> dict:
    """Per token of a micro-batch: `kept` from the forward until backward, and `backward`, what the backward of one
    layer adds on top (with checkpointing: that layer's forward run again, and the gradients in flight, ~6h).

      kept = outside the layers (final norm 6h, the head's input 2h, RoPE's cos/sin 4 head_dim, ids 16)
             + layers x (checkpointing: the layer's input, 2h bf16 / 4h fp32; else layer_bytes_per_token)
    kv_cache: the shared-prompt path (one process) keeps every layer's K and V in the cache: + 4kv (8kv fp32)."""
    h, width = d.hidden, (4 if precision == "autocast" else 2)
    outside = (6 + width) * h + 4 * d.head_dim * (2 if precision == "autocast" else 1) + 16
    layer = layer_bytes_per_token(d, precision, kv_repeated)
    per_layer = width * h + 8 if checkpointing else layer
    if kv_cache:
        per_layer += 2 * width * d.kv_heads * d.head_dim
    return {"kept": outside + d.layers * per_layer, "backward": (layer if checkpointing else 0) + 3 * width * h,
            "layer": layer}


def logits_bytes(d: ModelDims, chunk_tokens: int, tokens: int) -> int:
    """The log-prob chunk's peak (models.chunked_logprobs, measured): ~10 bytes x V per token of one chunk, plus the
    gradient of the head's input (2h a kept token). Unchunked (chunk <= 0) every token's logits at once, ~12 x V."""
    if chunk_tokens <= 0:
        return 12 * d.vocab * tokens + 2 * d.hidden * tokens
    return LOGITS_BYTES_PER_TOKEN_VOCAB * d.vocab * min(chunk_tokens, tokens) + 2 * d.hidden * tokens


def kv_bytes_per_token(d: ModelDims) -> int:
    """vLLM's KV cache in bf16: K and V, every layer: 2 x layers x kv_heads x head_dim x 2. Qwen3-14B: 160 KiB."""
    return 2 * d.layers * d.kv_heads * d.head_dim * 2


# ----------------------------------------------------------------------------------------------------------
# The plan: what each GPU holds in each phase of a step
#
# Paper scale (torchrun, vLLM, cfg.offload_trainer; docs/memory.md "Phases"): the rollouts and the update take
# turns on every GPU, as verl and OpenRLHF do.
#   rollout      the trainer's sharded state waits in (pinned) host memory (distributed.move_trainer); each GPU
#                holds the trainer's CUDA context and one vLLM engine: its CUDA context (created before vLLM's
#                memory snapshot, gpu_worker.init_device: outside gpu_memory_utilization), bf16 weights, runtime
#                and a KV cache as large as what is left
#   update       the engines sleep (vLLM sleep mode, level 2: weights and KV released; its context and runtime
#                stay); the trainer's state is back on the GPU: 16 P / ranks, activations, the backward's peak
#   weight sync  the engines' weights wake (wake_up(tags=["weights"])) beside the trainer's state; vLLM's in-place
#                reload materialises each layer on the GPU before copying it in (the largest: the head, 2 V H),
#                and the trainer gathers one tensor at a time in bf16 (distributed.gathered_weights); then the
#                engines empty their cache (vllm_engine: rstar2_sync_end), the trainer goes to host memory and the
#                KV cache wakes
# Without the offload (one process, or offload_trainer=false) the trainer and the engines share every GPU at once:
#   update       the trainer's peak beside the engine's whole budget; weight sync: the trainer's state, the
#                engine's budget, the reload's largest layer and the gathered tensor
# The SFT (stage "sft") is a phase of its own: the trainer alone (no engine), its micro-batches packed by forwarded
# tokens (sft.py), checkpointed and chunked like the RL update.

TRAINER_CONTEXT = "trainer: CUDA context, NCCL (assumed)"
VLLM_CONTEXT = 1.0 * GiB      # vLLM's CUDA context (and its NCCL communicator), outside gpu_memory_utilization (assumed)
ENGINE_BATCHED_TOKENS = 8192  # vLLM's max_num_batched_tokens (its engine-context default: 2,048): prefill chunks


@dataclass
class Phase:
    name: str
    items: dict                # item -> bytes on the busiest GPU

    @property
    def total(self) -> float:
        return sum(self.items.values())


@dataclass
class Plan:
    model: str
    params: int                # P
    gpus: int
    ranks: int                 # training processes (torchrun); 1 = one process
    gpu_bytes: float
    row_tokens: int            # the longest row: prompt + max_response_tokens of the run's longest stage
    micro_tokens: int          # tokens of the RL micro-batch that needs most: a row alone, or micro_batch_tokens
    offload: bool              # the trainer's state in host memory during rollouts, the engines asleep in the update
    phases: list               # [Phase]: what each phase holds on the busiest GPU
    margin: float              # the least free GPU memory over the phases, the reserve left aside; in the rollout
                               # phase (and without the offload) beyond vLLM's minimum: KV for one full-length rollout
    gpu_memory_utilization: float
    kv_tokens: int             # KV capacity of one engine at that utilization
    engine_gpus: list
    max_micro_batch_tokens: int   # the largest multiple of 1024 that still fits (0: none)
    host: dict                 # item -> host bytes on the node (the offload, the sync's and a checkpoint's gathers)
    engine_args: dict          # what vLLM's engines start with (vllm_engine.VLLMEngine.launch)

    @property
    def fits(self) -> bool:
        return self.margin >= 0

    @property
    def rollouts_per_engine(self) -> float:
        return self.kv_tokens / self.row_tokens

    @property
    def host_bytes(self) -> float:
        return max(self.host.values(), default=0)


def trainer_bytes(d: ModelDims, cfg: Config, ranks: int, tokens: int, kv_repeated: bool = True,
                  fsdp: bool | None = None) -> dict:
    """The trainer's peak on its busiest GPU, by item. ranks > 1: FSDP2, with the embeddings, the head and each layer
    their own units (distributed.shard_policy), bf16 compute; ranks == 1: the whole fp32 model on one GPU under bf16
    autocast (accelerate), the system prompt's KV shared through the cache (rl_update.shared_prompt_kv).
    fsdp=True with ranks == 1: FSDP2 on one GPU (tests/gpu_check_paper_scale.py measures it)."""
    P, Pl, Pv = total_params(d), layer_params(d), d.vocab * d.hidden
    fsdp = ranks > 1 if fsdp is None else fsdp
    act = activation_bytes_per_token(d, cfg.activation_checkpointing, "bf16" if fsdp else "autocast",
                                     kv_repeated=kv_repeated, kv_cache=not fsdp)
    kept = act["kept"] * tokens
    logits = logits_bytes(d, cfg.logprob_chunk_tokens, tokens)
    dh = 2 * d.hidden * tokens   # the gradient of the head's input, alive from the head's backward on
    if fsdp:
        # FSDP2 (torch 2.13: _fsdp_param_group.post_backward, _fsdp_collectives.foreach_reduce): a unit's backward
        # holds its gathered bf16 weights (2 bytes x its parameters) and their bf16 gradient (2); then it frees the
        # weights and copies the gradient into the fp32 reduce-scatter input (4). The next unit is gathered ahead
        # (2 Pl). A unit's fp32 reduce-scatter input stays alive until the *next* unit's post-backward
        # (comm_ctx.reduce_scatter_states, reduce_scatter_max_input_buffers = 1: the oldest is dropped only once the
        # next unit's gradients exist). Backward runs head, last layer, ..., embeddings: the head's 4 Pv lives
        # through the last layer's recompute and backward, and each layer carries the one before's 4 Pl.
        #   head phase:  the log-prob chunks beside the head's bf16 weights and its fp32 gradient buffer (2 + 4 Pv:
        #                models.chunked_logprobs sums the chunks in fp32), the buffer's cast to bf16 (8 Pv at
        #                once), then its reduce-scatter (bf16 gradient + fp32 input: 6 Pv)
        #   layer phase: act x T + 6 Pl + 4 max(Pv, Pl)
        head = max(logits + 6 * Pv, 8 * Pv, dh + 6 * Pv) + 2 * Pl
        layer = act["backward"] * tokens + 6 * Pl + 4 * max(Pv, Pl)
    else:
        # one process: autocast's bf16 copies of the weights (all kept for backward without checkpointing; with it,
        # the recomputed layer's and the head's), and the head's backward: fp32 gradient buffer + bf16 copy (6 Pv)
        casts = 2 * P if not cfg.activation_checkpointing else 2 * (Pl + Pv)
        head = logits + 6 * Pv + casts
        layer = act["backward"] * tokens + casts
    return {"trainer: fp32 weights, grads, AdamW m and v: 16 P / ranks": 16 * P / ranks,
            TRAINER_CONTEXT: TRAINER_RUNTIME,
            f"activations kept for backward ({act['kept'] / 1024:.0f} KiB/token x {tokens})": kept,
            ("backward peak beyond them: output head (log-prob chunks, its unit)" if head >= layer else
             "backward peak beyond them: a layer run again, its unit, the last unit's fp32 grads"):
            max(head, layer)}


def sync_bytes(d: ModelDims, ranks: int) -> dict:
    """The weight sync's extra on a GPU: vLLM's in-place reload materialises each layer before copying it into place
    (model_loader/reload/layerwise.py; the largest: the head or embeddings, 2 V H in bf16), and under torchrun the
    trainer gathers one tensor at a time in bf16 (distributed.gathered_weights: 2 V H at most). The engine's cache
    would keep the reloaded layer: vllm_engine empties it at the end of every sync."""
    largest = max(d.vocab * d.hidden, layer_params(d) // 3)
    items = {"vLLM reload: its largest layer materialised (2 V H)": 2 * largest}
    if ranks > 1:
        items["trainer: one tensor gathered in bf16 for the sync (2 V H)"] = 2 * largest
    return items


def plan(d: ModelDims, cfg: Config, gpus: int, gpu_gb: float, ranks: int) -> Plan:
    """The plan for the stages the run takes on `gpus` GPUs of `gpu_gb` GiB each (as torch reports them) with `ranks`
    training processes (torchrun --nproc-per-node ranks; 1: one process)."""
    gpu, P = gpu_gb * GiB, total_params(d)
    stages = run_stages(cfg)
    rl = [s for s in stages if s != "sft"]
    row = max([apply_stage(cfg, s).max_response_tokens for s in rl] or [cfg.max_response_tokens]) + PROMPT_TOKENS
    with_vllm = cfg.engine != "transformers" and bool(rl)
    shared = ranks > 1 or gpus == 1      # an engine beside the trainer on every GPU (else: GPU 0 is the trainer's)
    offload = cfg.offload_trainer and ranks > 1 and with_vllm
    reserve, kv_row = reserve_bytes(gpu), kv_bytes_per_token(d) * row
    vllm_min = 2 * P + VLLM_RUNTIME + kv_row
    engine_args = {"max_num_seqs": cfg.engine_batch, "max_num_batched_tokens": ENGINE_BATCHED_TOKENS}

    def at(micro: int):
        """(phases, margin, gpu_memory_utilization, RL tokens) for a micro_batch_tokens."""
        phases = []
        if "sft" in stages:   # packed by forwarded tokens: micro_batch_tokens at most (SFT rows are short)
            phases.append(Phase("sft", trainer_bytes(d, cfg, ranks, micro, kv_repeated=True)))
        if not rl:
            return phases, min(gpu - reserve - p.total for p in phases), 0.0, 0
        # the largest micro-batches: one row alone (up to `row` tokens, no padding: no attention mask, so k and v
        # reach the attention unrepeated), or several shorter rows padded to the longest (up to `micro` tokens,
        # a mask: transformers repeats k and v for every head on GPUs)
        tokens, trainer = max(((n, trainer_bytes(d, cfg, ranks, n, kv_repeated=rep)) for n, rep in
                               ((row, False), (micro, True))), key=lambda c: sum(c[1].values()))
        state = {k: v for k, v in trainer.items() if k.startswith("trainer:")}
        margins = [gpu - reserve - p.total for p in phases]
        if not with_vllm:
            phases.append(Phase("update", trainer))
            return phases, min(margins + [gpu - reserve - sum(trainer.values())]), 0.0, tokens
        context = {"vLLM CUDA context, outside gpu_memory_utilization (assumed)": VLLM_CONTEXT}
        if offload:
            util = math.floor(100 * (gpu - TRAINER_RUNTIME - VLLM_CONTEXT - reserve) / gpu) / 100
            kv = util * gpu - 2 * P - VLLM_RUNTIME
            phases.append(Phase("rollout", {TRAINER_CONTEXT: TRAINER_RUNTIME, **context,
                                            "vLLM bf16 weights: 2 P": 2 * P, "vLLM runtime (assumed)": VLLM_RUNTIME,
                                            f"vLLM KV cache ({kv / kv_row:.1f} full-length rollouts)": kv}))
            margins.append(kv - kv_row)   # vLLM refuses to start without KV for one full-length rollout
            asleep = {**context, "vLLM asleep: its runtime stays (assumed)": VLLM_RUNTIME}
            phases.append(Phase("update", {**trainer, **asleep}))
            phases.append(Phase("weight sync", {**state, **asleep, "vLLM bf16 weights, awake: 2 P": 2 * P,
                                                **sync_bytes(d, ranks)}))
            margins += [gpu - reserve - p.total for p in phases[-2:]]
            return phases, min(margins), util, tokens
        # trainer and engine share the GPU at once: the engine's budget is what the trainer's worst moment leaves
        sync = {**state, **sync_bytes(d, ranks)}
        room = gpu - reserve - VLLM_CONTEXT - max(sum(trainer.values()), sum(sync.values())) if shared else \
            gpu - reserve - VLLM_CONTEXT
        util = math.floor(100 * room / gpu) / 100
        budget = {f"vLLM engine (gpu_memory_utilization {util:.2f}): weights, runtime, KV": util * gpu}
        if shared:
            phases.append(Phase("update", {**trainer, **context, **budget}))
            phases.append(Phase("weight sync", {**sync, **context, **budget}))
        else:
            phases.append(Phase("update (GPU 0)", trainer))
            phases.append(Phase("rollout (GPUs 1-)", {**context, **budget}))
        margins.append(util * gpu - vllm_min)
        if not shared:
            margins.append(gpu - reserve - sum(trainer.values()))
        return phases, min(margins), max(0.0, util), tokens

    phases, margin, util, tokens = at(cfg.micro_batch_tokens)
    best = 0
    for micro in range(1024, 262145, 1024):
        if at(micro)[1] < 0:
            break
        best = micro
    engine_gpus = (list(range(gpus)) if shared else list(range(1, gpus))) if with_vllm else []
    kv_tokens = max(0, int((util * gpu - 2 * P - VLLM_RUNTIME) // kv_bytes_per_token(d))) if engine_gpus else 0
    host = {}
    if offload:
        host["the trainer's state while the engines generate: weights, AdamW m and v, 12 P"] = 12 * P
    if ranks > 1:
        from vllm_engine import SYNC_BUCKET_BYTES

        largest = max(d.vocab * d.hidden, layer_params(d) // 3)
        host["weight sync: a bucket and one bf16 tensor on rank 0"] = SYNC_BUCKET_BYTES + 2 * largest
        host["a checkpoint: full weights and AdamW state on rank 0, 16 P"] = 16 * P
    return Plan(d.name, P, gpus, ranks, gpu, row, tokens, offload, phases, margin, util, kv_tokens, engine_gpus,
                best, host, engine_args)


def run_stages(cfg: Config) -> list[str]:
    """The stages a command runs (their lengths differ: config.STAGES)."""
    return {"all": ["sft", "1", "2", "3"], "sft": ["sft"]}.get(cfg.stage, [cfg.stage])


def format_plan(p: Plan) -> str:
    """The plan as a table a person reads before starting a run."""
    g = lambda b: f"{b / GiB:7.1f} GiB"  # noqa: E731
    how = f"torchrun, {p.ranks} ranks (FSDP2)" if p.ranks > 1 else "one process" + (
        ", the trainer alone on GPU 0" if p.gpus > 1 else ", trainer and engine share the GPU")
    if p.offload:
        how += "; the trainer's state in host memory during rollouts, vLLM asleep during the update"
    lines = [f"memory plan: {p.model} ({p.params / 1e9:.2f}B parameters) on {p.gpus} x {p.gpu_bytes / GiB:.1f} GiB, "
             f"{how}; rows up to {p.row_tokens} tokens, micro-batches up to {p.micro_tokens} tokens"]
    reserve = reserve_bytes(p.gpu_bytes)
    for phase in p.phases:
        lines.append(f"  {phase.name} phase (busiest GPU):")
        lines += [f"    {k:<70} {g(v)}" for k, v in phase.items.items()]
        lines.append(f"    {'reserve (fragmentation: 5%, at least 2 GiB, assumed)':<70} {g(reserve)}")
        lines.append(f"    {'free':<70} {g(p.gpu_bytes - reserve - phase.total)}")
    lines.append(f"  {'margin (the least over the phases; with vLLM beyond its minimum)':<72} {g(p.margin)}  " +
                 ("fits" if p.fits else "DOES NOT FIT"))
    if p.engine_gpus:
        lines.append(f"  vLLM: gpu_memory_utilization {p.gpu_memory_utilization:.2f} on GPUs {p.engine_gpus}: KV for "
                     f"{p.kv_tokens:,} tokens per engine = {p.rollouts_per_engine:.1f} full-length rollouts; "
                     f"max_num_seqs {p.engine_args['max_num_seqs']}, max_num_batched_tokens "
                     f"{p.engine_args['max_num_batched_tokens']}")
    if p.host:
        lines.append("  host memory of the node:")
        lines += [f"    {k:<70} {g(v)}" for k, v in p.host.items()]
        lines.append(f"    {'at most':<70} {g(p.host_bytes)}")
    lines.append(f"  largest micro_batch_tokens that fits: {p.max_micro_batch_tokens or 'none'}")
    return "\n".join(lines)


def refusal(p: Plan, cfg: Config) -> str:
    """One line for a plan that does not fit: by how much, and what to change."""
    if p.ranks == 1 and p.gpus > 1 and 16 * p.params + reserve_bytes(p.gpu_bytes) > p.gpu_bytes:
        fix = f"run under torchrun --nproc-per-node {p.gpus} (FSDP2 shards the 16 bytes a parameter over the GPUs)"
    elif p.ranks > 1 and p.engine_gpus and not p.offload:
        fix = "--set offload_trainer=true (the trainer's state in host memory during rollouts)"
    elif not cfg.activation_checkpointing:
        fix = "--set activation_checkpointing=true"
    elif cfg.micro_batch_tokens > p.max_micro_batch_tokens > 0:
        fix = f"--set micro_batch_tokens={p.max_micro_batch_tokens}"
    elif cfg.logprob_chunk_tokens <= 0 or cfg.logprob_chunk_tokens > 1024:
        fix = "--set logprob_chunk_tokens=1024"
    else:
        fix = "more GPUs, larger GPUs, or a shorter --set max_response_tokens"
    return (f"the memory plan does not fit: {p.model} on {p.gpus} x {p.gpu_bytes / GiB:.1f} GiB GPUs lacks "
            f"{-p.margin / GiB:.1f} GiB per GPU (--plan prints it): {fix}")


def plan_for(cfg: Config, model_dir, gpus: int, gpu_gb: float, ranks: int) -> Plan:
    """The plan from a model directory's (or a config.json's) shape."""
    return plan(ModelDims.from_config_json(model_dir), cfg, gpus, gpu_gb, ranks)


# ----------------------------------------------------------------------------------------------------------
# The plan of a run (rstar2_mini.main: --plan, and the check before a GPU run loads a weight)


def plan_for_run(cfg: Config, model_path):
    """The plan for this run: the GPUs torch sees (or --gpus / --gpu-memory-gb), torchrun's ranks (or
    --ranks; for a plan printed without torchrun, the paper preset's one rank per GPU)."""
    import torch

    seen = torch.cuda.is_available()
    gpus = cfg.gpus or (torch.cuda.device_count() if seen else 0)
    gb = cfg.gpu_memory_gb or (torch.cuda.get_device_properties(0).total_memory / GiB if seen else 0)
    if not gpus or not gb:
        raise UsageError("the memory plan needs the GPUs: on a machine without them pass --gpus N and "
                         "--gpu-memory-gb G (e.g. --gpus 8 --gpu-memory-gb 79.2 for 8 x H100 80GB)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ranks = cfg.ranks or (world if world > 1 else gpus if cfg.preset == "paper" and cfg.plan else 1)
    return plan_for(cfg, model_path, gpus, gb, ranks)


def print_plan_for_run(cfg: Config) -> int:
    """--plan: the plan as a table; exit 0 if it fits, else the refusal a run would stop with (exit 2)."""
    import model as models

    path = Path(cfg.model).expanduser()
    plan = plan_for_run(cfg, path if (path / "config.json").exists() else models.resolve_model(cfg.model))
    print(format_plan(plan))
    if not plan.fits:
        print(f"error: {refusal(plan, cfg)}", file=sys.stderr)
        return 2
    return 0
