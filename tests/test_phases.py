"""Paper scale, phase by phase (docs/memory.md "Phases"): the rollouts and the update take turns on the GPUs. The
trainer's sharded state waits in host memory while the engines generate (distributed.move_trainer), and nothing of a
finished phase stays allocated. Run here on CPU ranks (gloo) under torchrun, like tests/test_trainer.py's FSDP2
tests."""
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_trainer import tool_model_dir, torchrun  # noqa: E402,F401  (a fixture, and 2 CPU ranks under torchrun)


def test_the_trainers_state_to_host_and_back_leaves_training_exactly_as_it_was(tmp_path, tiny_model_dir):
    """Two FSDP2 updates on two gloo ranks, once with the sharded weights and AdamW moments sent to host memory and
    back between them: bitwise the same weights, optimizer state and update numbers as without the round trip
    (oracle: the run that never moved). The move really happened: every shard and moment was in new storage on the
    way out and again on the way back."""
    torchrun("offload", tiny_model_dir, tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    plain, moved = got[False], got[True]
    assert moved["moved_away"] and moved["moved_back"]
    assert plain["numbers"] == moved["numbers"]
    assert plain["weights"].keys() == moved["weights"].keys()
    for k in plain["weights"]:
        assert torch.equal(plain["weights"][k], moved["weights"][k]), k
    for k, s in plain["optimizer"]["state"].items():
        for name, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(moved["optimizer"]["state"][k][name])), (k, name)


def test_rl_steps_with_the_trainer_offloaded_between_updates_equal_steps_without(tmp_path, tool_model_dir):
    """Two RL steps of rstar2_mini.train_stage on two gloo ranks, rollouts on rank 0, a checkpoint every step: with
    offload_trainer (the state in host memory during rollouts, back for each update and each checkpoint's gather,
    phases.py) the checkpoints hold bitwise the weights and optimizer state of the run without it, and the steps'
    losses are the same. The offload's switches are logged (metrics.jsonl)."""
    import json

    import model as models
    import rstar2_mini as R

    torchrun("stage", tool_model_dir, tmp_path / "plain", 2)
    torchrun("stage", tool_model_dir, tmp_path / "offload", 2, "offload")
    runs = {}
    for name in ("plain", "offload"):
        d = tmp_path / name / "stage1"
        ckpt = R.latest_checkpoint(d)
        lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        runs[name] = (torch.load(ckpt / "trainer_state.pt", weights_only=False),
                      models.load_model(ckpt).state_dict(), lines)
    (s0, w0, m0), (s1, w1, m1) = runs["plain"], runs["offload"]
    assert s0["step"] == s1["step"] == 2
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    for k, st in s0["optimizer"]["state"].items():
        for name, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(s1["optimizer"]["state"][k][name])), (k, name)
    assert [x.get("loss") for x in m0] == [x.get("loss") for x in m1]
    assert any(x.get("loss") is not None for x in m1)   # the steps trained
    assert any("trainer_to_host_s" in x for x in m1) and not any("trainer_to_host_s" in x for x in m0)
    for name in ("plain", "offload"):   # nothing of the finished stage is reachable (close_runtime collects)
        assert [(tmp_path / name / "stage1" / f"alive.rank{r}").read_text() for r in (0, 1)] == ["0", "0"]


# ---------------------------------------------------------------------------------------------------------
# vLLM's side, with a stand-in for vLLM's AsyncLLM (vLLM itself is not installed for the CPU suite)


def fake_vllm(monkeypatch, calls: list, captured: list):
    """vllm.AsyncEngineArgs and vllm.v1.engine.async_llm.AsyncLLM stand-ins: the engine arguments are captured, the
    sleep-mode calls recorded in order; one engine with a KV capacity of 4,096 tokens."""
    import types

    class AsyncEngineArgs:
        def __init__(self, **kw):
            captured.append(kw)

    class AsyncLLM:
        vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(
            hf_config=types.SimpleNamespace(tie_word_embeddings=True)))

        def __init__(self):
            async def call_all(name, method, timeout, args, kwargs):
                return [[4096]]
            self.engine_core = types.SimpleNamespace(call_utility_all_async=call_all)

        @classmethod
        def from_engine_args(cls, args, stat_loggers=None):
            return cls()

        def get_num_unfinished_requests(self):
            return 0

        async def sleep(self, level):
            calls.append(("sleep", level))

        async def wake_up(self, tags):
            calls.append(("wake_up", tags))

    mods = {"vllm": types.ModuleType("vllm"), "vllm.v1": types.ModuleType("vllm.v1"),
            "vllm.v1.engine": types.ModuleType("vllm.v1.engine"),
            "vllm.v1.engine.async_llm": types.ModuleType("vllm.v1.engine.async_llm")}
    mods["vllm"].AsyncEngineArgs = AsyncEngineArgs
    mods["vllm.v1.engine.async_llm"].AsyncLLM = AsyncLLM
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


def test_launch_starts_vllm_with_the_plans_sequence_and_token_caps(monkeypatch, tiny_model_dir):
    """The paper preset's plan on 8 x 80 GB: vLLM's engines start with max_num_seqs = engine_batch (256, vLLM's
    engine-context default 128) and max_num_batched_tokens 8,192 (default 2,048), and with sleep mode on."""
    import asyncio

    import memory_plan as MP
    import vllm_engine
    from config import PRESETS, Config

    calls, captured = [], []
    fake_vllm(monkeypatch, calls, captured)
    cfg = Config(**{**PRESETS["paper"], "preset": "paper", "stage": "all"})
    plan = MP.plan_for(cfg, ROOT / "bench" / "model_configs" / "qwen3-14b", gpus=8, gpu_gb=79.2, ranks=8)
    loop = asyncio.new_event_loop()
    try:
        engines = vllm_engine.VLLMEngine.launch(str(tiny_model_dir), loop, num_gpus=1, enable_sleep_mode=True,
                                                **plan.engine_args)
    finally:
        loop.close()
    (args,) = captured
    assert args["max_num_seqs"] == cfg.engine_batch == 256 and args["max_num_batched_tokens"] == 8192
    assert args["enable_sleep_mode"] is True
    assert engines[0].capacity_tokens == 4096


def test_a_step_sleeps_the_engines_before_the_trainer_returns_and_wakes_their_kv_after_it_left(monkeypatch,
                                                                                                tiny_model_dir):
    """The order phases.py promises (vLLM 0.32 sleep mode, as verl runs it): sleep(level=2) before the trainer's
    state comes back to the GPU; wake_up(["weights"]) before the weights are loaded; the trainer's state to host
    memory before wake_up(["kv_cache"]). A sync into sleeping weights is refused (trl#5142)."""
    import asyncio

    import model as models
    import phases
    import pytest
    import rstar2_mini as R
    import vllm_engine

    calls, captured = [], []
    fake_vllm(monkeypatch, calls, captured)
    loop = asyncio.new_event_loop()
    engines = vllm_engine.VLLMEngine.launch(str(tiny_model_dir), loop, num_gpus=1, enable_sleep_mode=True)
    real_move, real_load = phases.move_trainer, vllm_engine.VLLMEngine.load_weights
    monkeypatch.setattr(phases, "move_trainer", lambda m, o, to: calls.append(("trainer", to)) or real_move(m, o, to))

    def load_weights(self, weights):
        if "weights" in self.backend.get("asleep", ()):
            raise RuntimeError("asleep")
        calls.append(("load",))
    monkeypatch.setattr(vllm_engine.VLLMEngine, "load_weights", load_weights)

    policy = models.load_model(tiny_model_dir)
    optimizer, _ = R.make_optimizer(policy, R.Config())
    turns = phases.Turns(on=True)
    phases.trainer_to_host(turns, policy, optimizer)
    phases.for_update(turns, engines, policy, optimizer)
    phases.sync_for_rollouts(turns, engines, policy, optimizer, policy)
    loop.close()
    assert calls == [("trainer", "host"), ("sleep", 2), ("trainer", "device"), ("wake_up", ["weights"]), ("load",),
                     ("trainer", "host"), ("wake_up", ["kv_cache"])]
    assert {"engine_sleep_s", "trainer_to_device_s", "engine_wake_weights_s", "sync_s", "trainer_to_host_s",
            "engine_wake_kv_s"} <= set(turns.timings)
    engines[0].backend["asleep"] = {"weights"}
    with pytest.raises(RuntimeError, match="weights sleep"):
        real_load(engines[0], {})


def test_nothing_of_a_finished_sft_stays_allocated(tmp_path, tiny_model_dir):
    """rstar2_mini.run_sft_stage under two gloo ranks (FSDP2, a fixed chat file), Python's garbage collector off:
    once it has returned, none of its policy's parameters is reachable (weak references), on either rank. An FSDP2
    module that ran forward, backward and a step holds reference cycles, so only a collection frees it: at 14B
    13.75 GiB a GPU would otherwise stay into stage 1's first update."""
    import json

    import fsdp_ranks

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in fsdp_ranks.chat_rows()))
    out = tmp_path / "run"
    out.mkdir()
    torchrun("sft_free", tiny_model_dir, chats, out)
    for rank in (0, 1):
        got = torch.load(out / f"free.rank{rank}")
        assert got["parameters"] > 0 and got["alive"] == 0, (rank, got)


def test_the_last_barrier_waits_for_rank0_on_the_store(tmp_path):
    """close_distributed while rank 0 is still busy (writing the final checkpoint) for longer than the collective
    timeout (3 s here, 30 min in a run): the other ranks wait on torchrun's store first, as for the other long
    rank-0 phases (distributed.wait_for_rank0), so no collective times out and both ranks exit 0."""
    torchrun("last_barrier", 8)


# ---------------------------------------------------------------------------------------------------------
# The SFT at paper scale: packed by forwarded tokens, checkpointed, chunked


def test_the_packed_sft_on_two_ranks_gives_the_oracles_loss_and_gradients(tmp_path, tiny_model_dir, tokenizer):
    """Under torchrun every rank forwards whole rows (prompt + response: no shared prefix), so micro-batches are
    packed by forwarded tokens, rows x the longest row <= micro_batch_tokens (1000 here: two of these ~420-token
    rows), the layers run checkpointed and the log-probs 5 tokens at a time (packed_sft_config). One batch of 5 chats on two gloo ranks:
    the loss and every parameter's gradient are the oracle's, each example's own plain fp32 forward:
        L = sum over examples, labeled t of -log softmax(logits_{t-1})[x_t] / N."""
    import json

    import fsdp_ranks
    import model as models
    import sft

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in fsdp_ranks.chat_rows()))
    torchrun("sft_grad", tiny_model_dir, chats, tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt", weights_only=False)

    m = models.load_model(tiny_model_dir)
    examples = sft.load_chat_jsonl(str(chats), tokenizer)[:5]
    n = sum(sum(t.loss_mask) for t in examples)
    total = 0.0
    for t in examples:
        ids = torch.tensor([t.input_ids])
        logp = torch.log_softmax(m(input_ids=ids).logits[0, :-1].float(), -1)
        target = ids[0, 1:]
        mask = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        total = total - logp[torch.arange(len(target)), target][mask].sum() / n
    total.backward()
    assert got["loss"] == pytest.approx(total.item(), rel=1e-5)
    for name, p in m.named_parameters():
        g = got["grads"][name]
        assert torch.allclose(g, p.grad, atol=1e-6 * max(1.0, float(p.grad.abs().max())), rtol=1e-4), name
    for rank in got["ranks"]:
        assert rank["forwarded"] and max(rank["forwarded"]) <= 1000, rank    # packed by forwarded tokens
        assert rank["checkpointed_runs"] > 0                                # the layers ran checkpointed


# ---------------------------------------------------------------------------------------------------------
# The output head's gradient under FSDP2's bf16 weights


def test_the_heads_gradient_sums_its_chunks_in_fp32():
    """models.chunked_logprobs with bf16 weights (FSDP2's bf16 policy gathers them so): the head's gradient is the
    sum over chunks of g^T h. Summed in bf16 chunk by chunk it rounds once per chunk (512 chunks of 1 token: 1.4%
    from the fp64 oracle, against 0.2% for one GEMM over every token); summed in fp32 and rounded once at the end,
    every chunking stays within 1.5 x the one GEMM's error. Oracle: the same log-probs in fp64 from the same bf16
    values."""
    import model as models

    torch.manual_seed(0)
    K, H, V = 512, 64, 1000
    h = torch.randn(K, H).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H) * 0.05).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, V, (K,))
    w64 = w.detach().double().requires_grad_()
    torch.log_softmax(h.detach().double() @ w64.t(), -1).gather(-1, y[:, None]).sum().backward()

    def error(chunk):
        w.grad = None
        models.chunked_logprobs(h, y, w, None, 1.0, chunk).sum().backward()
        assert w.grad.dtype == torch.bfloat16
        return float((w.grad.double() - w64.grad).norm() / w64.grad.norm())

    one_gemm = error(K)
    for chunk in (64, 8, 1):
        assert error(chunk) <= 1.5 * one_gemm, (chunk, error(chunk), one_gemm)


def test_the_bf16_fsdp2_update_on_two_ranks_agrees_with_the_fp32_oracle(tmp_path, tiny_model_dir, tokenizer):
    """What the GPUs run: FSDP2's bf16 mixed-precision policy (bf16 weights and compute in forward and backward,
    gradients reduce-scattered in fp32 into fp32 master shards), checkpointed layers, log-prob chunks of 7 tokens,
    two gloo ranks. Oracle: the same update in one process in fp32 (no FSDP, no chunks). lr 0 leaves the gradient
    in p.grad. Tolerance: bf16 keeps 8 bits of mantissa (relative rounding 2^-9 = 0.2% per op); through a few
    layers and a softmax the loss agrees to 1% and every parameter's gradient to 3% of its norm (measured: 1.0% at
    most; the update's direction: cosine > 0.998)."""
    import random

    import fsdp_ranks
    import model as models
    import rstar2_mini as R

    m = models.load_model(tiny_model_dir)
    rt = R.Runtime(m, tokenizer, engines=[], pool=None, loop=None)
    cfg = fsdp_ranks.bf16_update_config()
    optimizer, schedule = R.make_optimizer(m, cfg)
    ref = R.policy_update(rt, R.dataclasses.replace(cfg, activation_checkpointing=False, logprob_chunk_tokens=0),
                          optimizer, schedule, fsdp_ranks.fixed_batch(tokenizer), random.Random(0))
    torchrun("bf16_update", tiny_model_dir, tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    assert got["numbers"]["loss"] == pytest.approx(ref["loss"], rel=1e-2, abs=1e-4)
    assert got["numbers"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-2)
    errors = {}
    for name, p in m.named_parameters():
        g, r = got["grads"][name].double(), p.grad.double()
        assert g.dtype == r.dtype and g.shape == r.shape
        errors[name] = float((g - r).norm() / r.norm().clamp_min(1e-12))
    assert max(errors.values()) < 0.03, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    flat_g = torch.cat([got["grads"][n].double().flatten() for n, _ in m.named_parameters()])
    flat_r = torch.cat([p.grad.double().flatten() for _, p in m.named_parameters()])
    assert float(torch.nn.functional.cosine_similarity(flat_g, flat_r, dim=0)) > 0.998


def test_the_weight_sync_gathers_one_tensor_at_a_time_in_bf16(tmp_path, tiny_model_dir):
    """distributed.gathered_weights on two gloo ranks: rank 0 receives every tensor of the model's state dict, in
    its order, cast to bf16 on each rank before the all-gather: bitwise the full model's tensors cast to bf16
    (oracle: the model loaded whole in one process). The other rank receives nothing (its process checks).
    bench/bench_weight_sync.py measures rank 0's host peak and the time against the fp32 full state."""
    import model as models

    torchrun("gather", tiny_model_dir, tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    want = models.load_model(tiny_model_dir).state_dict()
    assert [k for k, _ in got] == list(want)
    for k, t in got:
        assert t.dtype == torch.bfloat16 and t.device.type == "cpu"
        assert torch.equal(t, want[k].to(torch.bfloat16)), k
