"""GPU check of the paper-scale trainer path, torch only (no vLLM, no model download; skipped without CUDA).

What the CPU suite proves on CPU ranks over gloo, on one CUDA (or ROCm) GPU over NCCL, with small Qwen3-shaped
models built from transformers' Qwen3Config (random weights, Qwen3's vocabulary of 151,936):
  1. the device: models.training_device picks "cuda" for the paper preset (no silent CPU fallback);
  2. lr = 0 means rho = 1 and no clipping in rl_update.policy_update under bf16 autocast (chunked log-probs and
     activation checkpointing on); token_logprobs in fp32 give a row the same log-probs however it is packed;
  3. chunked log-probs and checkpointed layers leave the values and the gradient as the plain computation gives
     them (bf16 tolerance: cuBLAS picks kernels by shape, so chunks may round differently);
  4. the memory plan does not under-count: torch.cuda.max_memory_allocated of one row's forward + backward
     (bf16 weights, as FSDP2 computes; checkpointing on, chunks of 1024) at 2K, 4K and 8K tokens is at most the
     plan's figure for the same tokens (memory_plan.activation_bytes_per_token and logits_bytes) plus 25%;
  5. FSDP2 over NCCL (world 1): distributed.shard_policy and full_state give back every tensor of the model's
     state dict, fp32, the same shapes and values, tied and untied heads;
  6. the FSDP2 update's memory against the plan's items: FSDP2 at world size 1 (it still runs its reduce path:
     fp32 reduce-scatter inputs kept until the next unit's post-backward) with the bf16 policy, checkpointed
     layers and log-prob chunks, one row of 4K and 8K tokens forward, backward and an AdamW step: the peak of
     torch.cuda.max_memory_allocated is at most memory_plan.trainer_bytes's items (the CUDA context aside, which
     torch does not count) and at least half of them (a plan that over-counts wastes the KV cache).

    python -m pytest -q -s tests/gpu_check_paper_scale.py     # ~1 min on one GPU; prints the memory figures

Not yet run on a GPU (none was available where it was written): its bounds are the CPU measurements'
(docs/memory.md); a failure of 4 means the plan's per-token figures need the GPU's own numbers, of 6 that an
item of the FSDP2 update (memory_plan.trainer_bytes) is missing or wrong. Prints the figures to put beside the
plan's in docs/memory.md.
"""
import os
import socket
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (or ROCm) GPU")

VOCAB = 151_936


def qwen3_like(hidden=512, layers=2, tie=False, dtype=torch.float32):
    """A random Qwen3 causal LM on the GPU (heads 8 x 64, kv heads 4, intermediate 3 x hidden)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=VOCAB,
                      tie_word_embeddings=tie, max_position_embeddings=16384, attn_implementation="sdpa")
    return Qwen3ForCausalLM(cfg).to(device="cuda", dtype=dtype)


def rows(lengths, seed=0):
    """Random token rows and loss masks (the first quarter of each row a 'prompt', mask 0)."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    masks = [[0] * (n // 4) + [1] * (n - n // 4) for n in lengths]
    return seqs, masks


def test_the_paper_preset_trains_on_the_gpu():
    import model as models
    from config import PRESETS, Config

    assert models.training_device(Config(preset="paper", **PRESETS["paper"])) == "cuda"


def trajectories(lengths, seed=0):
    """Trajectories of random tokens: a shared 64-token prompt, then model turns and a tool response (mask 0)."""
    import random

    from protocol import Segment, Trajectory

    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB) for _ in range(64)]
    out = []
    for k, n in enumerate(lengths):
        turn = [rng.randrange(VOCAB) for _ in range(n)]
        tool = [rng.randrange(VOCAB) for _ in range(n // 4)]
        out.append(Trajectory(f"p{k}", prompt, [Segment(turn[: n // 2], 1), Segment(tool, 0),
                                                Segment(turn[n // 2:], 1)], reward=float(k % 2)))
    return out


@pytest.mark.parametrize("micro_batch_tokens", [1, 4096])
def test_policy_update_at_lr0_has_ratio_1_and_no_clipping_in_bf16(micro_batch_tokens):
    """rl_update.policy_update on CUDA (bf16 autocast over fp32 masters, chunked log-probs, checkpointed layers):
    with lr = 0, pi_theta = pi_old, so every ratio is 1 and nothing is clipped, one row a micro-batch or all."""
    import random

    import rstar2_mini as R

    m = qwen3_like()
    cfg = R.Config(lr=0.0, warmup_steps=1, grad_clip=1e9, minibatches=2, micro_batch_tokens=micro_batch_tokens,
                   activation_checkpointing=True, logprob_chunk_tokens=256, temperature=1.0)
    optimizer, schedule = R.make_optimizer(m, cfg)
    rt = R.Runtime(m, None, engines=[], pool=None, loop=None)
    trajs = trajectories([300, 500, 200, 700])
    kept = [(t, a) for t, a in zip(trajs, [1.0, -0.5, 0.7, -1.1])]
    out = R.policy_update(rt, cfg, optimizer, schedule, kept, random.Random(1))
    assert out["clip_frac"] == 0.0 and out["ratio_min"] == 1.0 == out["ratio_max"], out
    assert out["loss_tokens"] == sum(t.num_model_tokens for t in trajs), out


def test_token_logprobs_do_not_depend_on_the_packing():
    """fp32 on CUDA: each row's log-probs packed with others (padded, one shared prefix) equal the row alone."""
    import rl_update as U

    m = qwen3_like()
    trajs = trajectories([300, 500, 200], seed=3)
    seqs, masks = [t.input_ids for t in trajs], [t.loss_mask for t in trajs]
    with torch.no_grad():
        packed = U.token_logprobs(m, seqs, 0.7, masks=masks)
        for b, (s, mk) in enumerate(zip(seqs, masks)):
            alone = U.token_logprobs(m, [s], 0.7, masks=[mk], share_prefix=False)[0]
            assert torch.allclose(packed[b, :len(s)], alone, atol=1e-4), (b, float((packed[b, :len(s)] - alone)
                                                                                  .abs().max()))


def test_chunks_and_checkpointing_keep_values_and_gradient():
    import model as models
    import rl_update as U

    m = qwen3_like()
    seqs, masks = rows([600, 800], seed=1)

    def run(chunk, ckpt):
        m.zero_grad()
        with models.bf16_autocast(m, True):
            logp = U.token_logprobs(m, seqs, 1.0, masks=masks, share_prefix=False, chunk_tokens=chunk,
                                    checkpoint_layers=ckpt)
        logp.sum().backward()
        return logp.detach(), [p.grad.clone() for p in m.parameters()]

    ref, ref_g = run(0, False)   # every kept token's logits at once, no checkpointing: the plain computation
    for chunk, ckpt in ((1024, False), (128, True)):
        got, got_g = run(chunk, ckpt)
        assert torch.allclose(got, ref, atol=2e-2), (chunk, ckpt, float((got - ref).abs().max()))
        cos = [torch.nn.functional.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0)
               for a, b in zip(got_g, ref_g) if b.abs().sum() > 0]
        assert min(float(c) for c in cos) > 0.99, (chunk, ckpt)


@pytest.mark.parametrize("tokens", [2048, 4096, 8192])
def test_memory_of_one_row_is_within_the_plan(tokens):
    import memory_plan as plan
    import rl_update as U

    m = qwen3_like(dtype=torch.bfloat16)   # bf16 weights: what FSDP2's mixed precision computes with
    for p in m.parameters():               # the gradients exist beforehand (FSDP2 allocates them by unit)
        p.grad = torch.zeros_like(p)
    dims = plan.ModelDims.from_hf_config(m.config, name="qwen3-small")
    seqs, masks = rows([tokens], seed=2)
    masks = [[0] + [1] * (tokens - 1)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    logp = U.token_logprobs(m, seqs, 1.0, masks=masks, share_prefix=False, chunk_tokens=1024,
                            checkpoint_layers=True)
    logp.sum().backward()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - start
    act = plan.activation_bytes_per_token(dims, True, "bf16", kv_repeated=False)
    planned = act["kept"] * tokens + max(plan.logits_bytes(dims, 1024, tokens), act["backward"] * tokens)
    print(f"\n[memory] {tokens} tokens: measured {measured / 2**20:.1f} MiB, plan {planned / 2**20:.1f} MiB "
          f"({measured / tokens:.0f} vs {planned / tokens:.0f} B/token)")
    assert measured <= 1.25 * planned, (measured, planned)


@pytest.fixture
def nccl_world_of_one():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tie", [False, True])
def test_fsdp2_full_state_over_nccl(tie, nccl_world_of_one):
    import distributed

    m = qwen3_like(hidden=256, tie=tie)
    want = {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}
    sharded = distributed.shard_policy(m, bf16=True)
    saved = (distributed.DIST.world, distributed.DIST.rank)
    distributed.DIST.world, distributed.DIST.rank = 2, 0   # full_state's collective path (world 1 returns None)
    try:
        weights, _ = distributed.full_state(sharded)
    finally:
        distributed.DIST.world, distributed.DIST.rank = saved
    assert set(weights) == set(want)
    for k, v in want.items():
        assert weights[k].dtype == torch.float32 and weights[k].shape == v.shape, k
        assert torch.equal(weights[k].cpu(), v), k


@pytest.mark.parametrize("tokens", [4096, 8192])
def test_fsdp2_update_memory_is_held_to_the_plans_items(tokens, nccl_world_of_one):
    """FSDP2 world size 1, bf16 policy (distributed.shard_policy: every layer, the embeddings and the head their
    own units), checkpointed layers, log-prob chunks of 1024: a first update allocates the fp32 gradient shards and
    AdamW's moments (16 P); the second's peak (forward, backward, clip, step) is measured against the plan's
    trainer items for the same tokens: 16 P, the kept activations and the larger backward phase (the head's:
    chunks, fp32 gradient buffer; a layer's: recompute, its unit, the previous unit's fp32 reduce-scatter input)."""
    import distributed
    import memory_plan as plan
    import model as models
    import rl_update as U
    from config import Config

    m = distributed.shard_policy(qwen3_like(hidden=512, layers=4), bf16=True)
    dims = plan.ModelDims.from_hf_config(m.config, name="qwen3-small")
    cfg = Config(activation_checkpointing=True, logprob_chunk_tokens=1024)
    optimizer = models.adamw(m.parameters(), lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999))
    seqs, _ = rows([tokens], seed=4)
    masks = [[0] + [1] * (tokens - 1)]

    def update():
        optimizer.zero_grad(set_to_none=False)
        logp = U.token_logprobs(m, seqs, 1.0, masks=masks, share_prefix=False, chunk_tokens=1024,
                                checkpoint_layers=True)
        (-logp.sum() / tokens).backward()
        distributed.clip_gradients(m, 1.0)
        optimizer.step()

    update()   # gradients and AdamW state exist from here on
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    update()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    items = plan.trainer_bytes(dims, cfg, ranks=1, tokens=tokens, kv_repeated=False, fsdp=True)
    items.pop(plan.TRAINER_CONTEXT)   # the CUDA context and NCCL's buffers: outside torch's allocator
    planned = sum(items.values())
    print(f"\n[fsdp2 update] {tokens} tokens: measured {measured / 2**20:.0f} MiB, plan {planned / 2**20:.0f} MiB "
          f"(ratio {measured / planned:.2f}): " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in items.items()))
    assert 0.5 * planned <= measured <= planned, (measured, planned)
