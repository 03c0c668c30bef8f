"""Memory at paper scale (issue 33, DESIGN.md): log-probs in chunks of tokens and activation checkpointing leave
the values and gradients of the update exactly as they were (oracle: each trajectory's own plain full forward),
and the memory plan's per-token figures agree with what the real code holds on small Qwen3-shaped models."""
import random

import pytest
import torch

import model as models
import rl_update as U
from test_trainer import oracle_logprobs, random_trajectories


def oracle_gradients(m, seqs, masks, temperature, weights):
    """The gradient of sum_b sum_t w[b][t] * log pi(x_t) over model tokens, each trajectory by its own full forward."""
    m.zero_grad()
    total = 0.0
    for s, mask, w in zip(seqs, masks, weights):   # w: a weight per token, or one for the whole trajectory
        total = total + (oracle_logprobs(m, s, temperature) * torch.tensor(mask, dtype=torch.float32) * w).sum()
    total.backward()
    return [p.grad.clone() for p in m.parameters()]


def same_gradient(g, r) -> bool:
    """Equal to fp32 rounding: summing a gradient over tokens in chunks (or one token at a time) changes the order
    of the sum, so the tolerance scales with the gradient's largest entry (the tied embedding's reaches ~8)."""
    return torch.allclose(g, r, atol=1e-5 * max(1.0, float(r.abs().max())), rtol=1e-4)


def fast_gradients(m, seqs, masks, temperature, weights, **kw):
    """token_logprobs (values [B, L]) and the gradient of the same weighted sum through it."""
    m.zero_grad()
    logp = U.token_logprobs(m, seqs, temperature, masks=masks, **kw)
    w = torch.zeros_like(logp)
    for b, row in enumerate(weights):
        w[b, :len(row)] = row
    (logp * w).sum().backward()
    return logp, [p.grad.clone() for p in m.parameters()]


# ---------------------------------------------------------------------------------------------------------
# 1. Chunked log-probs: full-vocabulary logits for at most chunk_tokens tokens at once, same values and gradients


def test_chunked_logprobs_equal_the_full_forward_values_and_gradients(tokenizer):
    """Chunks of 1, 3 and 7 tokens cut rows anywhere (a row's model tokens fall into several chunks, a chunk spans
    rows); 1024 is one chunk. For two packings, with and without the shared prefix, at T = 0.7: every model
    token's log-prob and the gradient of a weighted sum equal each trajectory's own full forward (fp32)."""
    m = models.tiny_model(tokenizer, seed=1)
    rng = random.Random(1)
    trajs = random_trajectories(tokenizer, rng, 8)
    for trial, n_rows in enumerate((1, 4)):
        rows = rng.sample(trajs, n_rows)
        seqs, masks = [t.input_ids for t in rows], [t.loss_mask for t in rows]
        weights = [torch.randn(len(s), generator=torch.Generator().manual_seed(trial)) for s in seqs]
        refs = [oracle_logprobs(m, s, 0.7) for s in seqs]
        ref_grads = oracle_gradients(m, seqs, masks, 0.7, weights)
        for chunk in (1, 3, 7, 1024):
            for share in (True, False):
                logp, got = fast_gradients(m, seqs, masks, 0.7, weights, share_prefix=share, chunk_tokens=chunk)
                for b, (s, mask, ref) in enumerate(zip(seqs, masks, refs)):
                    want = torch.tensor(mask, dtype=torch.bool)
                    assert torch.allclose(logp[b, :len(s)][want], ref[want], atol=1e-5), (chunk, trial, b)
                    assert torch.all(logp[b, :len(s)][~want] == 0) and torch.all(logp[b, len(s):] == 0)
                for g, r in zip(got, ref_grads):
                    assert same_gradient(g, r), (chunk, trial, share)


def test_chunked_logprobs_keep_no_vocabulary_wide_tensor_for_backward(tokenizer):
    """What autograd keeps after the forward: with chunks, no tensor as wide as the vocabulary outside the chunks'
    checkpoints (each chunk keeps only its hidden states); unchunked (one chunk of every token), the logits'
    log_softmax is kept whole. Oracle: the saved tensors themselves, seen through saved_tensors_hooks."""
    m = models.tiny_model(tokenizer, seed=1)
    trajs = random_trajectories(tokenizer, random.Random(5), 4)
    seqs, masks = [t.input_ids for t in trajs], [t.loss_mask for t in trajs]
    V, K = len(tokenizer), sum(sum(mk) for mk in masks)

    weights = {p.untyped_storage().data_ptr() for p in m.parameters()}   # (W^T saved by a matmul costs nothing)

    def widest_saved(chunk):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            U.token_logprobs(m, seqs, 0.7, masks=masks, chunk_tokens=chunk)
        return max((t.numel() for t in saved if t.dim() and t.shape[-1] == V
                    and t.untyped_storage().data_ptr() not in weights), default=0)

    assert widest_saved(0) >= K * V          # unchunked (today's computation): log_softmax of every kept token
    assert widest_saved(2) == 0               # chunked: recomputed in backward, nothing V-wide kept


# ---------------------------------------------------------------------------------------------------------
# 2. Activation checkpointing per decoder layer: the same gradients, also through the shared prompt's KV


def test_the_update_keeps_each_kv_head_once_for_backward(tokenizer):
    """Grouped-query attention: backward keeps the keys and values once per KV head, not repeated for every query
    head (repeat_kv: 3x the attention's memory for SmolLM2's 9 query / 3 KV heads, the largest activation of a CPU
    update). The oracle of the values and gradients is the full-forward tests above; here, what is kept."""
    m = models.tiny_model(tokenizer, seed=5)
    heads, kv_heads = m.config.num_attention_heads, m.config.num_key_value_heads
    assert heads > kv_heads
    trajs = random_trajectories(tokenizer, random.Random(0), 3, one_problem=True)
    seqs, masks = [t.input_ids for t in trajs], [t.loss_mask for t in trajs]
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(tuple(t.shape)) or t, lambda t: t):
        prompt_kv, _ = U.shared_prompt_kv(m, seqs[0][:U.shared_prefix_length(seqs, masks) - 1])
        U.token_logprobs(m, seqs, 1.0, masks=masks, prefix_kv=prompt_kv)
    head_dim = m.config.hidden_size // heads
    longest = max(len(s) for s in seqs)
    keys = [s for s in kept if len(s) == 4 and s[-1] == head_dim and s[2] > 1 and s[1] in (heads, kv_heads)
            and s[2] >= longest - 1]   # [rows, heads, key length, head dim]
    assert keys and all(s[1] == kv_heads for s in keys), keys


def test_checkpointed_layers_give_the_full_forwards_gradients(tokenizer):
    """checkpoint_layers=True: every decoder layer keeps its inputs only and runs again in backward. Gradients
    equal each trajectory's own full forward (fp32), with the prefix shared inside the call, without it, and with
    the system prompt's KV computed once (shared_prompt_kv: the recompute must not append the rows' KV to the
    cache twice) and its backward run once at the end (backward_through_prompt). Checkpointing really ran:
    autograd keeps a fraction of the bytes it keeps without it."""
    m = models.tiny_model(tokenizer, seed=2)
    rng = random.Random(7)
    trajs = random_trajectories(tokenizer, rng, 5, one_problem=True)
    seqs, masks = [t.input_ids for t in trajs], [t.loss_mask for t in trajs]
    weights = [torch.randn(len(s), generator=torch.Generator().manual_seed(1)) for s in seqs]
    ref_grads = oracle_gradients(m, seqs, masks, 0.7, weights)
    for share in (True, False):
        _, got = fast_gradients(m, seqs, masks, 0.7, weights, share_prefix=share, checkpoint_layers=True,
                                chunk_tokens=5)
        for g, r in zip(got, ref_grads):
            assert same_gradient(g, r), share
    p = U.shared_prefix_length(seqs, masks) - 1
    assert p >= 16
    m.zero_grad()
    leaves, graph = U.shared_prompt_kv(m, seqs[0][:p])
    logp = U.token_logprobs(m, seqs, 0.7, masks=masks, prefix_kv=leaves, checkpoint_layers=True, chunk_tokens=5)
    w = torch.zeros_like(logp)
    for b, row in enumerate(weights):
        w[b, :len(row)] = row
    (logp * w).sum().backward()
    U.backward_through_prompt(leaves, graph)
    for p_, r in zip(m.parameters(), ref_grads):
        assert same_gradient(p_.grad, r)

    weights = {p.untyped_storage().data_ptr() for p in m.parameters()}

    def saved_bytes(ckpt):   # activations autograd keeps: unique storages, the weights left out
        seen = {}
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) and t,
                lambda t: t):
            U.token_logprobs(m, seqs, 0.7, masks=masks, checkpoint_layers=ckpt, chunk_tokens=5)
        return sum(n for ptr, n in seen.items() if ptr not in weights)

    assert saved_bytes(True) < 0.5 * saved_bytes(False)


def test_policy_update_with_checkpointing_and_chunks_keeps_the_papers_gradient(tokenizer):
    """policy_update with activation_checkpointing and chunks of 5 tokens (the shared system prompt once per
    mini-batch, micro-batches of one row and of all rows): ratio 1 at lr = 0 and the gradient of the paper's loss
    written out on each trajectory's own full forward (as tests/test_trainer.py checks without them)."""
    from test_trainer import lr0_update

    rng = random.Random(3)
    for micro in (1, 4096):
        trajs = random_trajectories(tokenizer, rng, 5, one_problem=True)
        kept = [(t, a) for t, a in zip(trajs, [1.0, -0.5, 0.75, -1.25, 0.3])]
        out, m = lr0_update(tokenizer, kept, minibatches=1, micro_batch_tokens=micro, temperature=0.7,
                            activation_checkpointing=True, logprob_chunk_tokens=5)
        assert abs(out["ratio_min"] - 1) < 1e-6 and abs(out["ratio_max"] - 1) < 1e-6
        got = [p.grad.clone() for p in m.parameters()]
        N = sum(sum(t.loss_mask) for t in trajs)
        ref = oracle_gradients(m, [t.input_ids for t, _ in kept], [t.loss_mask for t, _ in kept], 0.7,
                               [-a / N for _, a in kept])
        for g, r in zip(got, ref):
            assert same_gradient(g, r), micro


def test_fsdp_ranks_with_checkpointing_and_chunks_give_the_full_forwards_gradients(tmp_path, tokenizer):
    """Under torchrun (2 CPU ranks, gloo): an untied Qwen3 sharded with its embeddings, head and layers as their own
    units (distributed.shard_policy), every layer checkpointed and log-probs in chunks of 3 tokens. The gradients
    summed over the ranks equal each trajectory's own full forward in one process (fp32)."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    m = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     tie_word_embeddings=False, max_position_embeddings=4096))
    m.save_pretrained(tmp_path / "model")
    trajs = random_trajectories(tokenizer, random.Random(9), 4)
    seqs, masks = [t.input_ids for t in trajs], [t.loss_mask for t in trajs]
    weights = [torch.randn(len(s), generator=torch.Generator().manual_seed(i)) for i, s in enumerate(seqs)]
    torch.save({"seqs": seqs, "masks": masks, "weights": weights}, tmp_path / "batch.pt")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(port),
                           str(root / "tests" / "fsdp_memory_ranks.py"), str(tmp_path / "model"),
                           str(tmp_path / "batch.pt"), str(tmp_path / "grads.pt")],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = torch.load(tmp_path / "grads.pt")
    plain = models.load_model(tmp_path / "model")
    ref = oracle_gradients(plain, seqs, masks, 0.7, weights)
    for (name, _), r in zip(plain.named_parameters(), ref):
        assert same_gradient(got[name], r), name


# ---------------------------------------------------------------------------------------------------------
# 3-4. The memory plan: its arithmetic, its per-token figures against the real code's, its refusal

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
QWEN3_14B = ROOT / "bench" / "model_configs" / "qwen3-14b"
QWEN25_15B = ROOT / "bench" / "model_configs" / "qwen2.5-1.5b-instruct"


@pytest.mark.parametrize("model_dir", [QWEN3_14B, QWEN25_15B])
def test_plan_counts_the_parameters_transformers_builds(model_dir):
    """Oracle: the model transformers builds from the stored config.json (on the meta device: no memory), counted."""
    import memory_plan as MP
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    d = MP.ModelDims.from_config_json(model_dir)
    assert MP.total_params(d) == sum(p.numel() for p in m.parameters())
    assert MP.layer_params(d) == sum(p.numel() for p in m.model.layers[0].parameters())


def test_plan_kv_and_state_arithmetic():
    import memory_plan as MP

    d = MP.ModelDims.from_config_json(QWEN3_14B)
    assert MP.kv_bytes_per_token(d) == 2 * 40 * 8 * 128 * 2 == 160 * 1024      # K and V, 40 layers, bf16
    cfg = __import__("config").Config(preset="paper", stage="1", activation_checkpointing=True)
    t = MP.trainer_bytes(d, cfg, ranks=8, tokens=8192)
    assert t["trainer: fp32 weights, grads, AdamW m and v: 16 P / ranks"] == 16 * MP.total_params(d) / 8


def test_plans_per_token_figures_agree_with_the_real_codes_measurements():
    """bench/measure_memory.py's measurements on a small Qwen3 (bf16, 2 layers, GQA 8:1) through
    rl_update.token_logprobs, with and without checkpointing: bytes kept for backward per token and the peak of
    forward + backward per token, within 15% of memory_plan's. A vocabulary of 512 here, so that the peak is the
    layers' (with checkpointing: a layer run again in backward), not the head's; the head's log-prob chunk apart,
    at Qwen's V = 151,936: ~10 bytes per token of a chunk and vocabulary entry (its gradient buffer aside), 12 for
    every token unchunked."""
    import sys

    import memory_plan as MP

    sys.path.insert(0, str(ROOT / "bench"))
    import measure_memory as M

    model = M.qwen3_like(256, 2, heads=8, kv_heads=1, vocab=512)
    for ckpt in (False, True):
        row = M.compare(model, rows=1, length=256, checkpointing=ckpt, chunk=64)
        assert 0.85 < row["kept_ratio"] < 1.15, row
        assert 0.85 < row["peak_ratio"] < 1.15, row
    chunked, whole = M.measure_logits(32, 96, 16), M.measure_logits(32, 96, 0)
    assert abs(chunked["bytes_per_token_vocab"] - MP.LOGITS_BYTES_PER_TOKEN_VOCAB) < 1.5, chunked
    assert abs(whole["bytes_per_token_vocab"] - 12) < 1.5, whole
    assert chunked["peak_bytes"] < 0.5 * whole["peak_bytes"]


def plan_cli(capsys, *args):
    """rstar2_mini.main([... --plan]) in this process: (exit status, stdout, stderr)."""
    import types

    import rstar2_mini as R

    code = R.main(["--preset", "paper", "--plan", *args])
    out = capsys.readouterr()
    return types.SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def test_plan_command_prints_the_plan_and_refuses_what_does_not_fit(capsys, monkeypatch):
    """--plan on this CPU machine for hypothetical nodes: 14B on 8 x H200 fits (exit 0); on 8 x 24 GiB it does not
    (exit 2, one line); one process on 8 GPUs puts 16 bytes x P on GPU 0 and is told to use torchrun."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    ok = plan_cli(capsys, "--model", str(QWEN3_14B), "--gpus", "8", "--gpu-memory-gb", "139.8")
    assert ok.returncode == 0 and "fits" in ok.stdout and "gpu_memory_utilization" in ok.stdout, ok.stderr
    small = plan_cli(capsys, "--model", str(QWEN3_14B), "--gpus", "8", "--gpu-memory-gb", "24")
    assert small.returncode == 2 and "DOES NOT FIT" in small.stdout
    assert small.stderr.count("\n") == 1 and small.stderr.startswith("error: the memory plan does not fit")
    one = plan_cli(capsys, "--model", str(QWEN3_14B), "--gpus", "8", "--gpu-memory-gb", "79.2", "--ranks", "1")
    assert one.returncode == 2 and "torchrun --nproc-per-node 8" in one.stderr
    small_model = plan_cli(capsys, "--model", str(QWEN25_15B), "--gpus", "1", "--gpu-memory-gb", "79.2",
                           "--ranks", "1")
    assert small_model.returncode == 0, small_model.stdout + small_model.stderr
    blind = plan_cli(capsys, "--model", str(QWEN3_14B))
    assert blind.returncode == 2 and "--gpus" in blind.stderr


def test_a_gpu_run_whose_plan_does_not_fit_refuses_before_loading_anything(monkeypatch, capsys):
    """A paper-preset run on 8 x 24 GiB GPUs (torch's answers faked): exit 2 with the plan's one line, before any
    weight is read (the model directory holds config.json only)."""
    import types

    import rstar2_mini as R

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 8)
    monkeypatch.setattr("torch.cuda.get_device_properties", lambda i: types.SimpleNamespace(total_memory=24 * 2 ** 30))
    assert R.main(["--preset", "paper", "--stage", "1", "--model", str(QWEN3_14B)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the memory plan does not fit: qwen3-14b on 8 x 24.0 GiB") and err.count("\n") == 1


def test_vllm_placement_follows_the_plan():
    import memory_plan as MP
    import vllm_engine
    from config import PRESETS, Config

    cfg = Config(**{**PRESETS["paper"], "preset": "paper", "stage": "all"})
    plan = MP.plan_for(cfg, QWEN3_14B, gpus=8, gpu_gb=139.8, ranks=8)
    devices, fraction = vllm_engine.vllm_placement(8, 8, plan.params, int(139.8 * 2 ** 30), plan=plan)
    assert devices == list(range(8)) and fraction == plan.gpu_memory_utilization
    rollout = next(p for p in plan.phases if p.name == "rollout")
    outside = MP.TRAINER_RUNTIME + MP.VLLM_CONTEXT    # what vLLM's fraction does not cover on its GPU
    assert fraction * plan.gpu_bytes + outside + MP.reserve_bytes(plan.gpu_bytes) <= plan.gpu_bytes
    assert rollout.total == pytest.approx(fraction * plan.gpu_bytes + outside)
    assert plan.kv_tokens >= plan.row_tokens


def paper(**kw):
    from config import PRESETS, Config

    return Config(**{**PRESETS["paper"], "preset": "paper", "stage": "all", **kw})


def test_the_plan_counts_what_fsdp2_and_vllm_hold_beyond_the_obvious():
    """Qwen3-14B on 8 x 79.2 GiB, the paper preset (stages sft, 1-3), each item against its count written out here
    from the sources named in memory_plan.py: the update's layer phase is act x T + 6 Pl + 4 max(Pv, Pl) (torch 2.13
    keeps a unit's fp32 reduce-scatter input until the next unit's post-backward); vLLM's CUDA context is outside
    gpu_memory_utilization and in every phase; the weight sync holds the reload's largest layer (2 V H) beside the
    engine's weights and the trainer's state. The engines' KV holds at least 16 full-length rollouts, the host the
    offloaded 12 P, and vLLM starts with the plan's sequence and token caps."""
    import memory_plan as MP

    d = MP.ModelDims.from_config_json(QWEN3_14B)
    P, Pl, Pv = MP.total_params(d), MP.layer_params(d), d.vocab * d.hidden
    cfg = paper()
    plan = MP.plan_for(cfg, QWEN3_14B, gpus=8, gpu_gb=79.2, ranks=8)
    assert plan.fits and plan.offload
    phases = {p.name: p.items for p in plan.phases}
    assert list(phases) == ["sft", "rollout", "update", "weight sync"]
    T = 12288 + 2048
    act = MP.activation_bytes_per_token(d, True, "bf16", kv_repeated=False)
    peak = next(v for k, v in phases["update"].items() if k.startswith("backward peak"))
    assert peak == act["backward"] * T + 6 * Pl + 4 * Pv
    for name in ("rollout", "update", "weight sync"):
        assert phases[name]["vLLM CUDA context, outside gpu_memory_utilization (assumed)"] == MP.VLLM_CONTEXT
    assert phases["weight sync"]["vLLM reload: its largest layer materialised (2 V H)"] == 2 * Pv
    assert phases["weight sync"]["vLLM bf16 weights, awake: 2 P"] == 2 * P
    assert not any("16 P" in k for k in phases["rollout"])          # the trainer's state is in host memory
    assert plan.rollouts_per_engine >= 16
    assert plan.kv_tokens * MP.kv_bytes_per_token(d) <= plan.gpu_memory_utilization * plan.gpu_bytes - 2 * P
    assert plan.host["the trainer's state while the engines generate: weights, AdamW m and v, 12 P"] == 12 * P
    assert plan.engine_args == {"max_num_seqs": cfg.engine_batch, "max_num_batched_tokens": 8192}
    # the SFT stage: the trainer alone, micro-batches of micro_batch_tokens forwarded tokens
    sft = MP.plan_for(paper(stage="sft"), QWEN3_14B, gpus=8, gpu_gb=79.2, ranks=8)
    assert [p.name for p in sft.phases] == ["sft"] and not sft.engine_gpus
    assert any(f"x {cfg.micro_batch_tokens})" in k for k in sft.phases[0].items)


def test_without_the_offload_14b_on_80gb_refuses_and_names_the_setting(capsys, monkeypatch):
    """Trainer and engines on the GPUs at once (offload_trainer=false): 14B on 8 x 79.2 GiB does not fit once the
    items above are counted; the refusal names the setting that fixes it, and the default (offload) fits."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    off = plan_cli(capsys, "--model", str(QWEN3_14B), "--gpus", "8", "--gpu-memory-gb", "79.2",
                   "--set", "offload_trainer=false")
    assert off.returncode == 2 and "--set offload_trainer=true" in off.stderr, off.stdout
    on = plan_cli(capsys, "--model", str(QWEN3_14B), "--gpus", "8", "--gpu-memory-gb", "79.2")
    assert on.returncode == 0 and "rollout phase" in on.stdout and "update phase" in on.stdout
    sft = plan_cli(capsys, "--model", str(QWEN3_14B), "--gpus", "8", "--gpu-memory-gb", "24", "--stage", "sft")
    assert sft.returncode == 2 and "sft phase" in sft.stdout
