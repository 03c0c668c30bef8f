"""Tests for the CPU engine's decode path (engines.TransformersEngine over slot_engine.py): its tokens against a
plain full-forward sampler drawing the same uniforms, the vectorized sampler against the per-row one, slots
refilled in the iteration after a row leaves, weight syncs, and the refusal of models it does not implement."""
import pytest
import torch

import model as models
import scheduler as S


from test_scheduler import tiny, wave  # noqa: E402,F401  (the tiny model fixture; one decode wave's results)


def per_row_sample(logp_row, temperature, gen):
    """The sampler as it was written row by row (the reference): greedy, or the inverse CDF of softmax(logits / T)
    with one float64 uniform from the row's generator, sums in float64."""
    if temperature <= 0:
        return int(torch.argmax(logp_row))
    cdf = torch.cumsum(logp_row.exp(), 0, dtype=torch.float64)
    u = torch.rand(1, generator=gen, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), len(cdf) - 1)


def full_forward_sample(model, tokenizer, req, eos_ids):
    """The oracle: one request alone, every token from a full forward of its whole context (no KV cache), drawn
    with the request's own generator, stopped as the engine stops (eos, the stop text, the length budget)."""
    gen = torch.Generator().manual_seed(req.seed)
    ids, out, lps = list(req.ids), [], []
    T = req.temperature if req.temperature > 0 else 1.0
    while True:
        with torch.no_grad():
            # the whole context through every layer; the vocabulary projection of its last position only
            logits = model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()
        logp = torch.log_softmax(logits / T, -1)
        tok = per_row_sample(logp, req.temperature, gen)
        ids.append(tok)
        out.append(tok)
        lps.append(float(logp[tok]))
        why = S.finish_reason(tokenizer, out, req, eos_ids)
        if why:
            return out, lps, why


def test_engine_tokens_equal_a_full_forward_sampler_with_the_same_draws(tokenizer, tiny):
    """fp32, three slots for seven requests of very different lengths (rows leave and others take their slots
    while the rest decode), one without the shared system prompt, then the continuations of three rows stopped at
    a tool call (their KV kept, only the tool's response prefilled) beside a fresh request: every request's
    tokens and finish are the oracle's, its log-probs within 1e-4 nats."""
    engine = S.TransformersEngine(tiny, tokenizer, max_batch=3)
    prompts = [S.render_prompt(tokenizer, f"question {i} " + "pad " * (25 * (i % 4))) for i in range(6)]
    prompts.append(S.encode(tokenizer, "<|im_start|>user\nNo system prompt here.<|im_end|>\n<|im_start|>assistant\n"))
    reqs = [S.GenRequest(p, 6 + 9 * (i % 3), temperature=[1.0, 0.7, 0.0][i % 3], seed=S.request_seed(1, i, 0, 0),
                         key=(i, 0, 0), stop_text="@@") for i, p in enumerate(prompts)]
    got = wave(engine, reqs)
    # tool stops: a stop text that the first turn writes at its 5th token
    first = [S.GenRequest(r.ids, 16, temperature=r.temperature, seed=r.seed, key=(i, 1, 0),
                          stop_text=tokenizer.decode(g.token_ids[4:5]).strip() or "@@")
             for i, (r, g) in enumerate(zip(reqs[:3], got[:3]))]
    turn1 = wave(engine, first)
    tool = S.encode(tokenizer, "<|im_start|>user\n<tool_response>42</tool_response><|im_end|>\n")
    second = [S.GenRequest(q.ids + r.token_ids + tool, 8, temperature=1.0, seed=50 + i, key=(i, 1, 1),
                           stop_text="@@") for i, (q, r) in enumerate(zip(first, turn1))]
    fresh = S.GenRequest(prompts[5], 8, temperature=1.0, seed=99, key=(9, 0, 0), stop_text="@@")
    reused = engine.reused_tokens
    more = wave(engine, second + [fresh])
    assert engine.reused_tokens > reused + sum(len(q.ids) - len(engine.prefix_ids) for q in first) // 2
    assert sum(r.finish == "tool" for r in turn1) >= 2
    for req, r in zip(reqs + first + second + [fresh], got + turn1 + more):
        ids, lps, why = full_forward_sample(tiny, tokenizer, req, engine.eos_ids)
        assert (r.token_ids, r.finish) == (ids, why)
        assert torch.allclose(torch.tensor(r.logprobs), torch.tensor(lps), atol=1e-4)


def test_the_sampler_draws_every_row_at_once_and_as_the_per_row_sampler_does(monkeypatch):
    """64 rows at SmolLM2's vocabulary, temperatures 1, 0.7, 0.3 and greedy: the same tokens as the row-by-row
    inverse CDF with the same generators, log-probs log_softmax(logits / T), the searches of all rows at once (one
    for their blocks, one inside them: engines.inverse_cdf)."""
    import engines

    calls = []
    real = torch.searchsorted
    monkeypatch.setattr(torch, "searchsorted", lambda *a, **k: calls.append(1) or real(*a, **k))
    B, V = 64, 49_152
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(0)) * 4
    temps = [[1.0, 0.7, 0.3, 0.0][b % 4] for b in range(B)]
    tokens, lps = engines.sample_rows(logits, temps, [1.0] * B, [torch.Generator().manual_seed(b) for b in range(B)])
    assert len(calls) == 2
    monkeypatch.setattr(torch, "searchsorted", real)
    for b in range(B):
        logp = torch.log_softmax(logits[b] / (temps[b] or 1.0), -1)
        assert tokens[b] == per_row_sample(logp, temps[b], torch.Generator().manual_seed(b))
        assert lps[b] == pytest.approx(float(logp[tokens[b]]), abs=1e-6)


def whole_row_inverse_cdf(probs_row, points):
    """The reference: one float64 cumulative sum over the whole row, token k for u * cdf[-1] in [cdf[k-1], cdf[k])."""
    cdf = torch.cumsum(probs_row, 0, dtype=torch.float64)
    return torch.searchsorted(cdf, points * cdf[-1], right=True).clamp_(max=len(cdf) - 1)


def test_the_inverse_cdf_by_blocks_draws_the_tokens_of_the_whole_rows_cumulative_sum():
    """engines.inverse_cdf finds each row's block by the blocks' float64 sums, then the token inside the block by
    its own cumulative sum. Against one float64 cumulative sum over the whole row (the reference), at
    SmolLM2's 49,152 tokens and at a size that is no multiple of the block: 20,000 random points a row, and the
    midpoint of the reference's interval of 3,000 tokens, the 1,000 least likely of p > 1e-12 among them (their
    intervals are narrower than float32's step, so only float64 points reach them: no token is lost)."""
    import engines

    gen = torch.Generator().manual_seed(0)
    for V, spread in ((49_152, 4.0), (49_152, 8.0), (3_001, 3.0)):
        probs = torch.softmax(torch.randn(V, generator=gen) * spread, -1)
        points = torch.rand(20_000, generator=gen, dtype=torch.float64)
        got = engines.inverse_cdf(probs.expand(len(points), V), points)
        assert torch.equal(got, whole_row_inverse_cdf(probs, points))
        cdf = torch.cumsum(probs, 0, dtype=torch.float64)
        lower = torch.cat([cdf.new_zeros(1), cdf[:-1]])
        alive = (probs.double() / probs.double().sum() > 1e-12).nonzero()[:, 0]
        tokens = torch.cat([alive[probs[alive].argsort()[:1000]],
                            alive[torch.randperm(len(alive), generator=gen)[:2000]]])
        mid = (lower[tokens] + cdf[tokens]) / 2 / cdf[-1]
        assert torch.equal(engines.inverse_cdf(probs.expand(len(mid), V), mid), tokens)


def test_the_sampler_never_sums_a_whole_vocabulary_row_cumulatively(monkeypatch):
    """torch's float64 cumsum runs element by element on CPU and copies its whole input to float64: over 20-48
    rows x 49,152 tokens it took 0.6-1.9 ms in a decode loop (up to 7 ms with fresh pages). The sampler's
    cumulative sums span one block of a row at most; blocks are summed (vectorized) instead."""
    import engines

    spans = []
    real = torch.cumsum
    monkeypatch.setattr(torch, "cumsum", lambda x, *a, **k: spans.append(x.shape[-1]) or real(x, *a, **k))
    logits = torch.randn(20, 49_152, generator=torch.Generator().manual_seed(0)) * 4
    engines.sample_rows(logits, [0.8] * 20, [1.0] * 20, [torch.Generator().manual_seed(b) for b in range(20)])
    assert spans and max(spans) < logits.shape[1], spans
    assert max(spans) <= engines.CDF_BLOCK


def test_a_free_slot_is_filled_in_the_next_iteration_and_the_trace_says_so(tokenizer, tiny):
    """Eight slots, twelve requests: the iteration after a row leaves has a newcomer in its slot (admission at
    any iteration, no wait for a quarter of the rows); the engine's trace counts busy rows per iteration and its
    occupancy is their mean."""
    engine = S.TransformersEngine(tiny, tokenizer, max_batch=8)
    prompts = [S.render_prompt(tokenizer, f"q{i}") for i in range(12)]
    reqs = [S.GenRequest(p, 3 + 4 * i, temperature=1.0, seed=i, stop_text="@@") for i, p in enumerate(prompts)]
    engine.trace = []
    wave(engine, reqs)
    rows = [t["rows"] for t in engine.trace]
    assert rows[:4] == [8, 8, 8, 8]        # the first leaves after its 3rd token, its slot is refilled at once
    assert max(rows) == 8 and rows[-1] == 1
    occ = engine.occupancy()
    assert occ["iterations"] == len(rows) and occ["rows_mean"] == pytest.approx(sum(rows) / len(rows))


def test_fp32_decode_attention_reads_only_up_to_the_longest_busy_row(tokenizer, tiny):
    """The slots' buffer grows to the longest context the phase has seen (and 128 columns beyond); a row shorter
    than the longest busy one reads masked columns. In fp32 each decode iteration's attention reads every slot's
    own columns only up to the longest busy row (a strided block: as fast as the contiguous one in fp32, unlike
    bf16's), so that a phase's tail, after its longest rows left, does not read what they left behind. The tokens
    against the oracle: test_engine_tokens_equal_a_full_forward_sampler_with_the_same_draws."""
    engine = S.TransformersEngine(tiny, tokenizer, max_batch=3)
    prompts = [S.render_prompt(tokenizer, f"q{i} " + "pad " * (40 * (i % 3))) for i in range(6)]
    reqs = [S.GenRequest(p, 4 + 30 * (i % 2), temperature=1.0, seed=i, stop_text="@@") for i, p in enumerate(prompts)]
    engine.trace = []
    wave(engine, reqs)
    decoding = [t for t in engine.trace if t["prefill"] == 0]
    assert decoding and all(t["read"] == t["columns"] for t in decoding), [(t["read"], t["columns"]) for t in decoding]
    assert engine.occupancy()["read_mean"] == pytest.approx(sum(t["read"] for t in engine.trace) / len(engine.trace))


def test_the_occupancy_counts_prefilled_tokens_and_the_time_of_the_iterations_that_prefill(tokenizer, tiny):
    """A rollout phase forwards two kinds of tokens: one sampled token per decoding row, and the contexts of the
    rows admitted (their prompts past the shared prefix; after a tool call, the tool's response). The occupancy
    counts the latter (the oracle: each request's own context, by hand) and the seconds of the iterations that
    forwarded any, which a floor of the phase needs (bench_rl_step.py)."""
    engine = S.TransformersEngine(tiny, tokenizer, max_batch=4)
    prompts = [S.render_prompt(tokenizer, f"question {i}" * (i + 1)) for i in range(6)]
    reqs = [S.GenRequest(p, 3 + 2 * i, temperature=1.0, seed=i, stop_text="@@") for i, p in enumerate(prompts)]
    engine.trace = []
    wave(engine, reqs)
    own = sum(len(r.ids) - len(engine.prefix_ids) for r in reqs)   # every prompt starts with the shared prefix
    assert all(r.ids[:len(engine.prefix_ids)] == engine.prefix_ids for r in reqs)
    occ = engine.occupancy()
    assert occ["prefill_tokens"] == own == sum(t["prefill"] for t in engine.trace)
    assert occ["tokens"] == own + sum(t["rows"] for t in engine.trace) - len(reqs)   # the rest: one per row
    assert occ["prefill_iterations"] == sum(t["prefill"] > 0 for t in engine.trace) == engine.waves >= 2
    assert 0 < occ["prefill_seconds"] <= occ["ms_per_iteration"] * occ["iterations"] / 1000 + 1e-9


def test_the_samples_of_one_question_admitted_together_prefill_it_once(tokenizer, tiny):
    """A step admits the 2G samples of a question at once: their contexts are the same tokens. The engine
    prefills such a context once and copies its keys, values and last logits into the other rows' slots (each row
    still samples with its own generator). The oracle: every request's tokens and finish are a full forward's,
    its log-probs within 1e-4 nats; and the prefilled tokens, counted by hand, hold each distinct context once
    (two questions x four samples, one question alone, in six slots: the second question's last two samples come
    in together when two rows leave, and prefill its context once more)."""
    engine = S.TransformersEngine(tiny, tokenizer, max_batch=6)
    questions = [S.render_prompt(tokenizer, f"question {i} " + "pad " * (7 * i)) for i in range(3)]
    prompts = [questions[0]] * 4 + [questions[1]] * 4 + [questions[2]]
    reqs = [S.GenRequest(p, 3 + 3 * (i % 3), temperature=[1.0, 0.7, 0.0][i % 3], seed=S.request_seed(2, i, 0, 0),
                         key=(i, 0, 0), stop_text="@@") for i, p in enumerate(prompts)]
    engine.trace = []
    got = wave(engine, reqs)
    for req, r in zip(reqs, got):
        ids, lps, why = full_forward_sample(tiny, tokenizer, req, engine.eos_ids)
        assert (r.token_ids, r.finish) == (ids, why)
        assert torch.allclose(torch.tensor(r.logprobs), torch.tensor(lps), atol=1e-4)
    own = [len(q) - len(engine.prefix_ids) for q in questions]
    assert engine.trace[0]["rows"] == 6 and engine.trace[0]["prefill"] == own[0] + own[1]
    assert engine.trace[0]["copies"] == 3 + 1 and sum(t["copies"] for t in engine.trace) == 5
    assert engine.occupancy()["prefill_tokens"] == own[0] + 2 * own[1] + own[2]
    assert engine.occupancy()["copied_tokens"] == 3 * own[0] + 2 * own[1]


def test_while_tool_calls_hold_cores_the_engine_decodes_on_fewer_threads_and_samples_the_same(tokenizer, tiny):
    """A tool call's code runs on one core; an OpenMP team member sharing that core holds up every parallel
    region of a decode iteration. The engine asks cores_taken() before each iteration and decodes on torch's
    threads less that many (at least one), then gives the thread its count back. The oracle: the full-forward
    sampler's tokens and log-probs, and the threads each iteration ran on, counted by hand (2, 2, then 1 while
    one call "runs", then 1 while three do, then 2 again)."""
    reqs = [S.GenRequest(S.render_prompt(tokenizer, f"question {i}"), 9, temperature=1.0,
                         seed=S.request_seed(5, i, 0, 0)) for i in range(3)]
    held = [0, 0, 1, 1, 3, 3, 0]          # cores other work holds before iteration 1, 2, ...
    asked = []

    def cores_taken():
        asked.append(torch.get_num_threads())   # the threads the previous iteration left set
        return held[min(len(asked), len(held)) - 1]

    before = torch.get_num_threads()
    torch.set_num_threads(2)               # (the suite runs on one thread: conftest.py)
    try:
        engine = S.TransformersEngine(tiny, tokenizer, max_batch=4)
        engine.cores_taken = cores_taken
        engine.trace = []
        got = wave(engine, reqs)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    for req, r in zip(reqs, got):
        ids, lps, why = full_forward_sample(tiny, tokenizer, req, engine.eos_ids)
        assert (r.token_ids, r.finish) == (ids, why)
        assert torch.allclose(torch.tensor(r.logprobs), torch.tensor(lps), atol=1e-4)
    n = len(engine.trace)
    assert n == 9 and len(asked) == n
    assert [t["threads"] for t in engine.trace] == [2, 2, 1, 1, 1, 1, 2, 2, 2]
    assert asked[1:] == [t["threads"] for t in engine.trace][:-1]
    assert engine.occupancy()["threads_mean"] == pytest.approx(14 / 9)
    assert after == 2                      # the team is whole again when the loop ends


def test_a_weight_sync_reaches_the_fused_operands_also_when_the_trainer_shares_the_model(tokenizer):
    """The engine samples from copies of the weights (fused, maybe prepacked): after the trainer changes its
    model in place and syncs (load_weights of the engine's own model), the engine samples as a fresh engine on
    those weights does."""
    m = models.tiny_model(tokenizer, seed=0)
    engine = S.TransformersEngine(m, tokenizer, max_batch=2)
    req = S.GenRequest(S.render_prompt(tokenizer, "hi"), 12, temperature=1.0, seed=3)
    before = wave(engine, [req])[0]
    with torch.no_grad():
        for p, q in zip(m.parameters(), models.tiny_model(tokenizer, seed=1).parameters()):
            p.copy_(q)                      # an optimizer step, in place
    engine.load_weights(m)
    after = wave(engine, [req])[0]
    fresh = wave(S.TransformersEngine(models.tiny_model(tokenizer, seed=1), tokenizer, max_batch=2), [req])[0]
    assert after.token_ids == fresh.token_ids and after.token_ids != before.token_ids



def test_the_update_runs_without_the_decoders_operands_and_the_next_rollout_samples_as_before(tokenizer):
    """The decoder's fused (maybe prepacked) copies of the weights are stale from the update's first optimizer
    step: phases.for_update lets them go (270 MB of the 135M model in bf16), with the shared prefix's KV and the
    KV kept for rows stopped at a tool call whose continuation never came (the step's rollouts are over: 7 rows,
    80 MB in a step of the main command), so the update's peak does not hold them; the next decode rebuilds the
    operands, and samples as an engine that kept them."""
    import weakref

    import phases

    m = models.tiny_model(tokenizer, seed=0)
    engine = S.TransformersEngine(m, tokenizer, max_batch=2)
    req = S.GenRequest(S.render_prompt(tokenizer, "hi"), 12, temperature=1.0, seed=3)
    before = wave(engine, [req])[0]
    # a row that stops at a tool call (its 3rd token ends the stop text) keeps its KV for a continuation
    tool = S.GenRequest(req.ids, 12, temperature=1.0, seed=3, key=(0, 0, 0),
                        stop_text=tokenizer.decode(before.token_ids[2:3]).strip() or "@@")
    assert wave(engine, [tool])[0].finish == "tool" and len(engine._kept_kv) == 1
    held = [weakref.ref(engine.decoder.layers[0]["qkv"].weight), weakref.ref(engine._prefix_kv),
            weakref.ref(next(iter(engine._kept_kv.values()))[2])]
    phases.for_update(phases.Turns(), [engine], m, None)
    import gc
    gc.collect()
    assert all(r() is None for r in held)
    assert wave(engine, [req])[0].token_ids == before.token_ids

def test_a_model_the_decoder_does_not_implement_is_refused_with_a_message(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="Llama-family.*vLLM"):
        S.TransformersEngine(gpt2, tokenizer)


@pytest.mark.skipif(not models.bf16_is_fast("cpu"), reason="needs a CPU with bf16 units")
def test_prepacked_bf16_gemms_equal_plain_ones():
    """The oneDNN-prepacked weights give F.linear's numbers bit for bit at the decode shapes (1, 17, 64 rows)."""
    import slot_engine

    w = torch.nn.Linear(576, 1536).bfloat16()
    packed = slot_engine.fused([w], prepack=True, rows=64)
    assert packed.packed
    for rows in (1, 17, 64):
        x = torch.randn(rows, 576).bfloat16()
        assert torch.equal(packed(x), torch.nn.functional.linear(x, w.weight, w.bias))


X86 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and torch.backends.mkldnn.is_available()


@pytest.mark.skipif(not X86, reason="oneDNN's fp32 prepacking is used (and was measured) on x86 CPUs only")
def test_fp32_engines_run_prepacked_gemms_within_rounding_of_plain_ones(tokenizer, tiny):
    """In fp32 too the decoder's GEMM operands are oneDNN-prepacked (on an AVX2-only host 1.34-1.82x F.linear's
    speed at 48 down to 4 rows, docs/benchmarks.md): the fused layers and the output projection. Not bit for bit
    (oneDNN sums in another order than MKL): within fp32 rounding of F.linear at the decode shapes. The engine's
    tokens against the full-forward oracle (above) run this path."""
    import slot_engine

    engine = S.TransformersEngine(tiny, tokenizer, max_batch=4)
    engine.decoder.refresh()
    layer = engine.decoder.layers[0]
    assert all(layer[k].packed for k in ("qkv", "o", "gate_up", "down")) and engine.decoder.head.packed
    w = torch.nn.Linear(576, 1536)
    packed = slot_engine.fused([w], prepack=True, rows=64)
    for rows in (1, 17, 64, 300):
        x = torch.randn(rows, 576)
        plain = torch.nn.functional.linear(x, w.weight, w.bias)
        assert torch.allclose(packed(x), plain, rtol=1e-5, atol=1e-5 * plain.abs().max().item())


def test_a_rollout_phase_floor_adds_its_prefilled_tokens_at_the_decoder_layers_flops(tokenizer, tiny):
    """bench/roofline.phase_floor_s, written out by hand for the tiny model (hidden 64, MLP 128, 2 layers, 4 query
    heads and 2 KV heads of 16): a prefilled token multiplies by every decoder layer's weights, not by the head,
    and attends to the prefix and the mean own context; the decode part is the iterations' floor."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import roofline

    layer_params = 2 * (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128)   # q, k, v, o; gate, up, down
    per_token = 2 * layer_params + 4 * (10 + 20) * 2 * 4 * 16                     # + scores and values over P + C
    args = dict(iterations=7, rows=3.0, columns=20.0, prefix=10, gflops=1e-3, gbs=1.0, dtype_bytes=4)
    none = roofline.phase_floor_s(tiny, prefill_tokens=0, **args)
    some = roofline.phase_floor_s(tiny, prefill_tokens=100, **args)
    iteration = roofline.iteration_floor_ms(tiny, 3.0, 20.0, 10, 1e-3, 1.0, 4)["floor_ms"]
    assert none["floor_s"] == none["decode_floor_s"] == pytest.approx(7 * iteration / 1e3)
    assert some["prefill_floor_s"] == pytest.approx(100 * per_token / 1e6)
    assert some["floor_s"] == pytest.approx(none["floor_s"] + some["prefill_floor_s"])


def test_a_replayed_trace_forwards_each_traced_iteration_and_its_time_split_recovers_known_costs(tokenizer, tiny):
    """bench/bench_replay.py runs a real phase's traced iterations through the decoder alone (two traces in turn
    with --against): each replayed iteration forwards the traced tokens (one a decoding row, the prefilled ones
    over the rows admitted with a prefill; copies forward none) over as many rows; and its least-squares split,
    given milliseconds made from known costs per term, gives those costs back."""
    import sys
    from pathlib import Path

    from slot_engine import SlotDecoder

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_replay

    engine = S.TransformersEngine(tiny, tokenizer, max_batch=5)
    prompts = [S.render_prompt(tokenizer, f"question {i // 3} " + "pad " * (5 * (i // 3))) for i in range(9)]
    reqs = [S.GenRequest(p, 2 + 3 * (i % 4), temperature=1.0, seed=i, stop_text="@@") for i, p in enumerate(prompts)]
    engine.trace = []
    wave(engine, reqs)
    assert sum(t["copies"] for t in engine.trace) >= 2
    for it in engine.trace:
        starts, rows = bench_replay.iteration_shape(it)
        assert sum(n for n, _ in rows) == it["tokens"] and len(rows) + it["copies"] == it["rows"]
        decoding = it["tokens"] - it["prefill"]
        assert starts[:decoding] == [it["read"] - 1] * decoding and starts[decoding:] == [0] * (len(rows) - decoding)
    decoder = SlotDecoder(tiny, 5, "cpu")
    with torch.inference_mode():
        decoder.refresh()
        prefix = decoder.prefix_kv(engine.prefix_ids)
        ms = bench_replay.replay_step(decoder, prefix, len(engine.prefix_ids), engine.trace)
        a, b = bench_replay.alternating(decoder, prefix, len(engine.prefix_ids), engine.trace, engine.trace[:3], 2)
    assert len(ms) == len(engine.trace) and all(m > 0 for m in ms) and a > b > 0
    made = [500 + 200 * t["rows"] + 300 * t["rows"] * t["read"] / 1000 + 50 * t["prefill"] for t in engine.trace]
    split = bench_replay.time_split(engine.trace, made)
    assert (split["ms_fixed"], split["ms_per_row"], split["ms_per_prefilled_token"]) == pytest.approx((500, 200, 50),
                                                                                                      abs=1e-2)
    assert split["ms_per_row_kcolumn"] == pytest.approx(300, abs=0.5)
    # each term's seconds (rounded to 0.1 s) add up to the phase's
    assert sum(split[f"{term}_s"] for term in bench_replay.TERMS) == pytest.approx(sum(made) / 1000, abs=0.25)
