"""Tests for sft.py, sft_data.py and chores.py: the data follows the RL protocol with real sandbox outputs, is
varied, trains on model tokens only, the shared-prefix loss is exact, and run_sft trains, stops early and
saves a loadable checkpoint."""
import asyncio
import dataclasses
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import eval as grader
import model as models
import sft
import sft_data
from chores import chore_programs
from chores_math import CHORES
from sandbox import SandboxPool
from scheduler import IM_END, TOOL_NAME, Trajectory, parse_tool_call, render_prompt


@pytest.fixture(scope="module")
def examples(tokenizer):
    return sft.build_sft_examples(tokenizer, 80, seed=3)


def model_texts(tokenizer, t: Trajectory) -> list[str]:
    return [tokenizer.decode(s.ids) for s in t.segments if s.loss_mask]


# ---- data


def test_examples_follow_the_rl_protocol(tokenizer, examples):
    assert len(examples) == 80
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    for t in examples:
        question = tokenizer.decode(t.prompt_ids).split("This is the problem: ")[1].split(IM_END)[0]
        assert t.prompt_ids == render_prompt(tokenizer, question)      # the exact RL prompt
        masks = [s.loss_mask for s in t.segments]
        assert masks == [1, 0] * t.tool_calls + [1]          # model / tool alternate, the model answers last
        assert t.segments[-1].ids[-1] == eos                  # the model learns to stop
        texts = model_texts(tokenizer, t)
        for text in texts[:-1]:
            assert re.fullmatch(r"<reason> .+ </reason>\n<tool_call>\n.+\n</tool_call>", text, re.DOTALL)
            call = parse_tool_call(text)
            assert call.error is None and json.loads(text.split("<tool_call>\n")[1][:-13])["name"] == TOOL_NAME
        for s in t.segments:
            if not s.loss_mask:
                assert tokenizer.decode(s.ids).startswith(IM_END + "\n<|im_start|>user\n<tool_response>\n")
        assert grader.answer_format_ok(texts[-1]) and texts[-1].startswith("<reason> ")
        assert "\\boxed" not in "".join(texts[:-1])
        # ids are never re-tokenized: the trajectory is exactly prompt + segments
        assert t.input_ids == t.prompt_ids + [i for s in t.segments for i in s.ids]


def test_tool_responses_are_real_sandbox_outputs(tokenizer, examples):
    with_tool = [t for t in examples if t.tool_calls]
    assert len(with_tool) >= 40

    async def rerun(calls):
        async with SandboxPool(workers=2) as pool:
            return [await pool.run(c.code, c.stdin) for c in calls]

    last_calls = [parse_tool_call(model_texts(tokenizer, t)[-2]) for t in with_tool[:12]]
    results = asyncio.run(rerun(last_calls))
    for t, result in zip(with_tool, results):
        assert result.status == "ok"
        tool_text = tokenizer.decode(t.segments[-2].ids)
        assert f"stdout: {result.stdout}" in tool_text        # the response holds what the code really prints
        assert grader.extract_answer(model_texts(tokenizer, t)[-1]) == result.stdout.strip()
    for t in with_tool:
        if t.tool_errors:                                    # "error, then fix": a real traceback comes back
            assert "Tool call failure" in tokenizer.decode(t.segments[1].ids)
            assert "NameError" in tokenizer.decode(t.segments[1].ids)


def test_examples_are_varied(tokenizer, examples):
    firsts = [model_texts(tokenizer, t)[0] for t in examples]
    reasons = {re.match(r"<reason> (.*?) </reason>", f).group(1) for f in firsts}
    assert len(reasons) >= 30                                # no single memorisable sentence
    calls = [parse_tool_call(f) for f in firsts if "<tool_call>" in f]
    assert len({c.code for c in calls}) >= 0.9 * len(calls)
    assert any(c.stdin for c in calls) and any(not c.stdin for c in calls)       # stdin and literal styles
    assert any("for " in c.code for c in calls) and any(c.code.startswith("print(") for c in calls)
    counts = [t.tool_calls for t in examples]
    assert {0, 1, 2} <= set(counts)                          # direct answers, one call, two calls
    assert any(t.tool_errors for t in examples)
    assert len({t.problem_id.split("-", 2)[2] for t in examples}) >= 10    # many chore kinds
    untimed = lambda t: re.sub(r"execution time: [0-9.]+s", "", t.response_text)  # noqa: E731  (real timings vary)
    assert [untimed(t) for t in sft.build_sft_examples(tokenizer, 5, seed=3)] == [untimed(t) for t in examples[:5]]


def run_here(code: str, stdin: str = "") -> str:
    import contextlib
    import io
    import sys

    out, old_stdin = io.StringIO(), sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out):
            exec(code, {})  # noqa: S102 - the module's own programs
    finally:
        sys.stdin = old_stdin
    return out.getvalue()


def test_naming_the_result_keeps_what_every_chore_program_prints():
    """`print(f(g(x)))` -> `result = f(g(x))` + `print(result)` (fewer parentheses to close on one line), and
    every chore's every program, named or not, still prints the chore's answer."""
    assert sft_data.name_the_result("s = 'ab'\nprint(', '.join(sorted(s)))") == \
        "s = 'ab'\nresult = ', '.join(sorted(s))\nprint(result)"
    assert sft_data.name_the_result("result = 2\nprint(abs(result))").endswith("answer = abs(result)\nprint(answer)")
    for unchanged in ("x = 3\nprint(x)", "print(5)", "print(1, 2)", "print('a', end='')", "for i in range(2):\n    print(i)"):
        assert sft_data.name_the_result(unchanged) == unchanged
    import random
    for chore_fn in CHORES:
        for seed in range(5):
            chore = chore_fn(random.Random(seed))
            for code, stdin in chore_programs(chore):
                named = sft_data.name_the_result(code)
                assert run_here(named, stdin).strip() == run_here(code, stdin).strip() == chore.answer, named


def test_the_everyday_math_chores_print_their_answer_in_every_style():
    """Range loops, math.comb / math.perm, sympy, int(text, base), numbers read from a sentence: each chore's
    answer is computed once in the generator, and every program (a loop, a formula, a library call, stdin) must
    print exactly it, over enough seeds to reach every kind of question."""
    import random

    import chores_math as chores
    kinds = {chores.range_count: 3, chores.range_total: 2, chores.choose_ways: 3, chores.sympy_chore: 5,
             chores.hex_color: 3, chores.number_in_sentence: 3}
    for chore_fn, n_kinds in kinds.items():
        seen = set()
        for seed in range(40):
            chore = chore_fn(random.Random(seed))
            seen.add(chore.what.split(" with ")[0].rstrip("0123456789 "))
            for code, stdin in chore_programs(chore):
                assert run_here(code, stdin).strip() == chore.answer, (chore.question, code)
        assert len(seen) == n_kinds, (chore_fn.__name__, seen)


def test_a_draft_depends_only_on_its_seed_and_index():
    """The SFT data is a function of (seed, index): drawing the same examples again, after other draws, gives the
    same questions and programs (a chore that draws from a library's global RNG would not)."""
    import sympy
    cfg = sft.SFTConfig()
    first = [sft_data.draft_example(0, i, cfg) for i in range(200)]
    sympy.randprime(10, 10**6)   # disturb any global random state a chore might read
    again = [sft_data.draft_example(0, i, cfg) for i in range(200)]
    assert [(d.question, d.calls) for d in first] == [(d.question, d.calls) for d in again]


def test_the_added_math_chores_are_right_by_an_independent_count():
    """digit_check, layer_blocks, dotted_sum and base_display: every program prints the answer, and the answer
    agrees with a count done another way here (digits by divmod, sums of powers by Faulhaber's closed forms, the
    numeral's digits times powers of its base)."""
    import random
    import re as regex

    import chores_math as chores
    for seed in range(40):
        chore = chores.digit_check(random.Random(seed))
        n, total = int(regex.search(r"\d{6,}", chore.question).group()), 0
        while n:
            n, digit = divmod(n, 10)
            total += digit
        assert chore.answer == str(total)
        chore = chores.layer_blocks(random.Random(seed))
        a, b = map(int, regex.search(r"(\d+) (?:through|to) (\d+)", chore.question).groups())
        squares = lambda m: m * (m + 1) * (2 * m + 1) // 6   # noqa: E731 - sum of k^2 for k = 1..m
        cubes = lambda m: (m * (m + 1) // 2) ** 2             # noqa: E731 - sum of k^3 for k = 1..m
        closed = squares if "square" in chore.question else cubes
        assert chore.answer == str(closed(b) - closed(a - 1)), chore.question
        chore = chores.dotted_sum(random.Random(seed))   # "a^p + (a+1)^p + ... + b^p", p = 1 written "a + ..."
        first, second, last = regex.search(r"(\S+) \+ (\S+) \+ \.\.\. \+ (\S+) ", chore.question).groups()
        a, p = (int(x) for x in (first.split("^") + ["1"])[:2])
        b = int(last.split("^")[0])
        linear = lambda m: m * (m + 1) // 2                   # noqa: E731 - sum of k for k = 1..m
        closed = {1: linear, 2: squares, 3: cubes}[p]
        assert second == (f"{a + 1}^{p}" if p > 1 else str(a + 1)) and b > a, chore.question
        assert chore.answer == str(closed(b) - closed(a - 1)), chore.question
        chore = chores.base_display(random.Random(seed))
        base = int(regex.search(r"base[- ](\d)", chore.question).group(1))
        numeral = regex.search(r"(?:display|reads) (\d+)", chore.question).group(1)
        assert max(numeral) < str(base) and not numeral.startswith("0"), chore.question
        assert chore.answer == str(sum(int(d) * base**i for i, d in enumerate(reversed(numeral)))), chore.question
        for fn in (chores.digit_check, chores.layer_blocks, chores.dotted_sum, chores.base_display):
            c = fn(random.Random(seed))
            for code, stdin in chore_programs(c):
                assert run_here(code, stdin).strip() == c.answer, (c.question, code)


def test_math_share_draws_the_math_chores_with_that_probability(monkeypatch):
    """math_share=None keeps the preset's mix (CHORES); a share p draws a tool example from MATH_CHORES with
    probability p, else from EVERYDAY_CHORES (a binomial count over 400 drafts; each list is replaced by one chore
    that names its list)."""
    import chores_math
    from chores import Chore
    for name in ("CHORES", "MATH_CHORES", "EVERYDAY_CHORES"):   # CHORES is read through chores_math.chore_mix
        monkeypatch.setattr(chores_math if name == "CHORES" else sft_data, name,
                            [lambda rng, n=name: Chore(n, "What is 1 + 1?", "2", ["print(1 + 1)"])])
    for share, lo, hi in ((None, 0.0, 0.0), (1.0, 1.0, 1.0), (0.5, 0.43, 0.57), (0.0, 0.0, 0.0)):
        drafts = [sft_data.draft_example(0, i, sft.SFTConfig(math_share=share)) for i in range(400)]
        lists = [d.id.split("-")[2] for d in drafts if not d.id.endswith("-direct")]
        assert set(lists) <= ({"CHORES"} if share is None else {"MATH_CHORES", "EVERYDAY_CHORES"}), share
        assert lo <= lists.count("MATH_CHORES") / len(lists) <= hi, share


def test_extra_chores_add_to_the_preset_mix_and_change_no_other_draw():
    """extra_chores="dotted_sum" appends that chore twice to CHORES: every draft is either the preset's own draft
    of that (seed, index) or a sum written with dots, 2 in 47 of the 95% tool examples (a binomial count over 1000
    drafts: 40 expected, 22-60 within about three standard deviations), and the preset never writes one."""
    preset, extra = sft.SFTConfig(), sft.SFTConfig(extra_chores="dotted_sum")
    dotted = 0
    for i in range(1000):
        mine, theirs = sft_data.draft_example(0, i, extra), sft_data.draft_example(0, i, preset)
        assert " + ... + " not in theirs.question
        if (mine.question, mine.calls) != (theirs.question, theirs.calls):
            assert " + ... + " in mine.question and "range(" in mine.calls[-1][1], mine.question
            dotted += 1
    assert 22 <= dotted <= 60, dotted


def test_an_unknown_extra_chore_or_one_beside_math_share_is_refused():
    """A name chores_math.EXTRA_CHORES lacks: one line naming it and the known ones (from the config, from
    rstar2_mini's --set as a usage error); with math_share, which replaces the mix extra_chores adds to: refused."""
    import rstar2_mini
    with pytest.raises(ValueError, match="unknown chore dotted_sums; known: dotted_sum"):
        sft.SFTConfig(extra_chores="dotted_sums")
    with pytest.raises(ValueError, match="set one of them"):
        sft.SFTConfig(extra_chores="dotted_sum", math_share=0.5)
    with pytest.raises(rstar2_mini.UsageError, match="sft_extra_chores.*unknown chore nope"):
        rstar2_mini.parse_args(["--set", "sft_extra_chores=nope"])
    assert rstar2_mini.parse_args(["--set", "sft_extra_chores=dotted_sum"]).sft_extra_chores == "dotted_sum"


@pytest.mark.parametrize("field,value", [("math_share", 1.5), ("math_share", -0.1), ("direct_share", 2.0),
                                         ("verify_share", -1.0), ("fix_share", 1.01), ("name_share", float("nan"))])
def test_a_share_outside_0_1_is_refused_by_name(field, value):
    """A share is a probability: outside [0, 1] every draw would silently take one branch (math_share 1.5 gave
    only math chores). The config refuses it, naming the field; sft.py prints it and exits 2."""
    with pytest.raises(ValueError, match=field):
        sft.SFTConfig(**{field: value})
    for end in (0.0, 1.0):   # the ends are shares
        sft.SFTConfig(**{field: end})


def test_sft_cli_reports_a_bad_share_without_a_traceback(tmp_path):
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "sft.py", "--math-share", "1.5", "--out", str(tmp_path / "model")],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "math_share" in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert not (tmp_path / "model").exists()


def test_sft_cli_reports_a_missing_model_without_a_traceback(tmp_path):
    """`python sft.py --model DIR` with no model there: one line naming the path and exit 2 (no traceback), as
    rstar2_mini.py does, and no output directory is created."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    missing = tmp_path / "no-such-model"
    run = subprocess.run([sys.executable, "sft.py", "--model", str(missing), "--out", str(tmp_path / "model")],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert str(missing) in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert not (tmp_path / "model").exists()


def test_most_generated_programs_are_shallow(tokenizer, examples):
    """The share of first programs whose deepest line nests brackets 3 or more levels (the lines a 135M model
    most often closes wrongly) stays small: 34% before the programs named their result, about 15% now."""
    def depth(code):
        deepest = 0
        for line in code.split("\n"):
            level = 0
            for ch in line:
                level += (ch in "([{") - (ch in ")]}")
                deepest = max(deepest, level)
        return deepest
    calls = [parse_tool_call(model_texts(tokenizer, t)[0]) for t in examples if t.tool_calls]
    assert sum(depth(c.code) >= 3 for c in calls) / len(calls) < 0.25


# ---- loss only on model tokens


def test_labels_are_ignored_exactly_on_mask_0_tokens(tokenizer, examples):
    batch = sft.collate(examples[:6], tokenizer.pad_token_id)
    for row, t in enumerate(examples[:6]):
        n = len(t.input_ids)
        mask = torch.tensor(t.loss_mask)
        labels = batch["labels"][row]
        assert torch.equal(labels[:n] == -100, mask == 0)
        assert torch.equal(labels[:n][mask == 1], torch.tensor(t.input_ids)[mask == 1])
        assert (labels[n:] == -100).all() and (batch["attention_mask"][row, n:] == 0).all()


def test_no_gradient_from_system_user_or_tool_tokens(tokenizer, examples):
    """d loss / d logits is zero at every position whose next token is a prompt, tool or padding token."""
    batch = sft.collate(examples[:4], tokenizer.pad_token_id)
    B, T = batch["input_ids"].shape
    logits = torch.randn(B, T, 50, requires_grad=True)
    ids = batch["input_ids"] % 50

    class FixedLogits(torch.nn.Module):  # a stand-in model whose logits are a leaf tensor (gradient readable)
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(50, 50, bias=False)  # the output projection (identity), which
            self.lm_head.weight.data = torch.eye(50)             # batch_loss restricts to labels
            self.lm_head.weight.requires_grad_(False)

        def get_output_embeddings(self):
            return self.lm_head

        def parameters(self):
            return iter([logits])

        def forward(self, input_ids, attention_mask, logits_to_keep=0, use_cache=True):  # as transformers
            return SimpleNamespace(logits=self.lm_head(logits[:, -logits_to_keep:] if logits_to_keep else logits))

    labels = torch.where(batch["labels"] == -100, -100, ids)
    loss_sum, count = sft.batch_loss(FixedLogits(), {**batch, "input_ids": ids, "labels": labels}, share_prefix=False)
    loss_sum.backward()
    trained_next = torch.zeros(B, T, dtype=torch.bool)
    trained_next[:, :-1] = batch["labels"][:, 1:] != -100
    row_has_grad = logits.grad.abs().sum(-1) > 0
    assert torch.equal(row_has_grad, trained_next)
    assert count == sum(t.num_model_tokens for t in examples[:4])


def test_shared_prefix_gives_the_same_loss_and_gradients(tokenizer, examples):
    model = models.tiny_model(tokenizer, seed=1)
    batch = sft.collate(examples[:5], tokenizer.pad_token_id)
    assert sft.shared_prefix_len(batch) > 300                  # the system prompt is shared
    grads = []
    for share in (False, True):
        model.zero_grad()
        loss_sum, count = sft.batch_loss(model, batch, share_prefix=share)
        (loss_sum / count).backward()
        grads.append((loss_sum.item(), [p.grad.clone() for p in model.parameters()]))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-5)
    for a, b in zip(grads[0][1], grads[1][1]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-3)


def test_loss_equals_cross_entropy_of_the_plain_full_forward(tokenizer, examples):
    """batch_loss projects only the labeled positions onto the vocabulary (model.next_token_logits with keep):
    the same summed loss and gradients as the textbook loss over a plain forward's full [B, T, V] logits."""
    model = models.tiny_model(tokenizer, seed=2)
    batch = sft.collate(examples[:4], tokenizer.pad_token_id)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert out.logits.shape[:2] == batch["input_ids"].shape      # the reference computes every logit
    ref = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                            ignore_index=-100, reduction="sum")
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    for share in (False, True):
        model.zero_grad()
        loss_sum, count = sft.batch_loss(model, batch, share_prefix=share)
        loss_sum.backward()
        assert count == sum(t.num_model_tokens for t in examples[:4])
        assert loss_sum.item() == pytest.approx(ref.item(), rel=1e-5)
        for a, p in zip(ref_grads, model.parameters()):
            assert torch.allclose(a, p.grad, atol=1e-5, rtol=1e-3)


def test_micro_batches_give_the_batch_gradient(tokenizer, examples):
    """Gradient accumulation over micro-batches: the same token-level mean loss and gradient as one batch."""
    model = models.tiny_model(tokenizer, seed=1)
    batch = examples[:5]
    loss_sum, count = sft.batch_loss(model, sft.collate(batch, tokenizer.pad_token_id))
    assert count == sum(sum(t.loss_mask) for t in batch)  # the N that accumulate_gradients divides by
    results = []
    for micro in (100_000, 400):  # one pass, then several
        model.zero_grad()
        cfg = sft.SFTConfig(micro_batch_tokens=micro, bf16=False)  # exact: fp32 throughout
        loss = sft.accumulate_gradients(model, batch, cfg, tokenizer.pad_token_id)
        assert (len(sft.my_micro_batches_of(batch, micro)) > 1) == (micro < 10_000), micro
        results.append((loss, [p.grad.clone() for p in model.parameters()]))
    assert results[0][0] == pytest.approx(loss_sum.item() / count, rel=1e-5)
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-3)


def test_the_prompt_runs_once_a_batch_and_logits_exist_a_chunk_at_a_time(tokenizer, examples, monkeypatch):
    """Memory and speed of a step (bench/bench_sft_step.py): the shared system prompt is forwarded once for the
    whole batch, not once per micro-batch, and the 49K-wide logits exist for at most logprob_chunk_tokens tokens
    at once. The oracle is the textbook loss over a plain forward of the whole batch, every logit computed."""
    model = models.tiny_model(tokenizer, seed=4)
    batch = examples[:6]
    plain = sft.collate(batch, tokenizer.pad_token_id)
    out = model(input_ids=plain["input_ids"], attention_mask=plain["attention_mask"])
    ref = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), plain["labels"][:, 1:].flatten(),
                                            ignore_index=-100, reduction="sum")
    n = int((plain["labels"] != -100).sum())
    (ref / n).backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    widths, prompt_runs = [], []
    opening = plain["input_ids"][0, :16]   # a forward that starts at the prompt runs the prompt
    model.get_input_embeddings().register_forward_hook(
        lambda _m, args, _out: prompt_runs.append(int((args[0][:, :16] == opening).all(dim=1).sum())))
    selected = models.selected_logprobs
    monkeypatch.setattr(models, "selected_logprobs", lambda h, *a: widths.append(h.shape[0]) or selected(h, *a))
    cfg = sft.SFTConfig(micro_batch_tokens=300, logprob_chunk_tokens=64, bf16=False)
    loss = sft.accumulate_gradients(model, batch, cfg, tokenizer.pad_token_id)
    assert len(sft.my_micro_batches_of(batch, cfg.micro_batch_tokens)) >= 3
    assert sum(prompt_runs) == 1                                          # once for the batch
    assert widths and max(widths) <= 64                                   # never more than a chunk of logits
    assert loss == pytest.approx(ref.item() / n, rel=1e-5)
    for a, p in zip(ref_grads, model.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-6, rtol=1e-3)


def test_bf16_autocast_keeps_the_loss_and_the_gradient_direction(tokenizer, examples):
    """bf16 autocast (the default where the CPU has bf16 units) changes rounding, not the loss or where the
    gradient points: fp32 master weights, fp32 loss."""
    model = models.tiny_model(tokenizer, seed=1)
    runs = []
    for bf16 in (False, True):
        model.zero_grad()
        loss = sft.accumulate_gradients(model, examples[:4], sft.SFTConfig(bf16=bf16), tokenizer.pad_token_id)
        runs.append((loss, torch.cat([p.grad.flatten() for p in model.parameters()])))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert runs[1][0] == pytest.approx(runs[0][0], rel=2e-2)
    assert not torch.equal(runs[0][1], runs[1][1])                       # bf16 really ran
    assert torch.nn.functional.cosine_similarity(runs[0][1], runs[1][1], dim=0) > 0.99


# ---- training


def test_run_sft_trains_stops_early_and_saves(tokenizer, tmp_path):
    model = models.tiny_model(tokenizer, seed=0)
    cfg = sft.SFTConfig(n_examples=24, heldout_examples=4, batch_size=4, lr=3e-3, warmup_steps=1, eval_every=2,
                        patience=1, min_delta=0.0)
    logs = []
    out = tmp_path / "sft" / "model"
    metrics = sft.run_sft(model, tokenizer, cfg, out, log=logs.append)
    assert metrics["steps"] >= 2 and metrics["examples"] == 24
    assert metrics["heldout_losses"][-1][1] < metrics["heldout_losses"][0][1]   # it learned something
    json.dumps(metrics)
    reloaded = models.load_model(out)
    assert (out / "sft_metrics.json").exists() and models.load_tokenizer(out).eos_token == IM_END
    for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()):
        assert torch.equal(a, b)
    assert sorted(p.name for p in out.parent.iterdir()) == ["model"]              # no temp dirs left behind

    # lr 0: the held-out loss cannot improve, so training stops after `patience` evaluations
    cfg0 = sft.SFTConfig(n_examples=24, heldout_examples=4, batch_size=4, lr=0.0, eval_every=1, patience=1)
    m0 = sft.run_sft(models.tiny_model(tokenizer, seed=0), tokenizer, cfg0, out, log=logs.append)
    assert m0["stopped_early"] and m0["steps"] == 1 < m0["planned_steps"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["model"]              # overwritten atomically


# ---- chat examples from JSONL


def test_chat_jsonl_masks_only_assistant_turns(tokenizer, tmp_path):
    rows = [{"messages": [{"role": "user", "content": "Reverse abc."},
                          {"role": "assistant", "content": "<tool_call>\n{}\n</tool_call>"},
                          {"role": "tool", "content": "cba"},
                          {"role": "assistant", "content": "<answer> \\boxed{cba} </answer>"}]},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "",
                           "tool_calls": [{"function": {"name": TOOL_NAME, "arguments": "{\"code\": \"1\"}"}}]}]}]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    first, second = sft.load_chat_jsonl(path, tokenizer)
    trained = "".join(tokenizer.decode(s.ids) for s in first.segments if s.loss_mask)
    inserted = "".join(tokenizer.decode(s.ids) for s in first.segments if not s.loss_mask)
    assert trained == "<tool_call>\n{}\n</tool_call><|im_end|><answer> \\boxed{cba} </answer><|im_end|>"
    assert "<tool_response>\ncba\n</tool_response>" in inserted
    assert "Reverse abc." in tokenizer.decode(first.prompt_ids) and "# Tools" in tokenizer.decode(first.prompt_ids)
    assert "Be brief." in tokenizer.decode(second.prompt_ids)
    assert parse_tool_call(tokenizer.decode(second.segments[0].ids)).code == "1"


@pytest.mark.parametrize("bad, why", [("{not json", "not valid JSON"), ('{"text": "x"}', "messages"),
                                      ('{"messages": [{"role": "bot", "content": "x"}]}', "role"),
                                      ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant")])
def test_chat_jsonl_malformed_line_names_its_line(tokenizer, tmp_path, bad, why):
    good = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    path = tmp_path / "chats.jsonl"
    path.write_text(f"{good}\n\n{bad}\n")
    with pytest.raises(ValueError, match=rf"chats\.jsonl:3: .*{why}"):
        sft.load_chat_jsonl(path, tokenizer)


# ---- a killed SFT continues from its latest checkpoint


def interrupt_step(monkeypatch, k: int):
    """Ctrl-C during the k-th optimizer step (1-based): KeyboardInterrupt from inside its gradient computation,
    as a person pressing Ctrl-C mid-step raises it. Returns a function that takes the interruption away."""
    real, calls = sft.accumulate_gradients, []

    def interrupted(*args, **kw):
        calls.append(1)
        if len(calls) == k:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(sft, "accumulate_gradients", interrupted)
    return lambda: monkeypatch.setattr(sft, "accumulate_gradients", real)


def test_killed_sft_resumes_to_the_same_weights_and_losses(tokenizer, tmp_path, monkeypatch):
    """Killed in step 4 of 5 (checkpoints after steps 2 and 4), then run again: it continues from step 2 and
    ends with exactly the weights, training losses and held-out losses of a run that was never interrupted."""
    cfg = sft.SFTConfig(n_examples=10, heldout_examples=2, batch_size=2, lr=3e-3, warmup_steps=1, eval_every=2,
                        patience=10, save_every=2, bf16=False)   # fp32: exact on a CPU
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    restore = interrupt_step(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        sft.run_sft(models.tiny_model(tokenizer, seed=0), tokenizer, cfg, killed / "model", run_dir=killed)
    restore()
    assert not (killed / "model").exists()
    # the reference, uninterrupted, on the same data: two builds differ in the execution times the sandbox
    # reports inside the tool responses, so the killed run's saved data is what both train on
    whole.mkdir()
    shutil.copy(killed / "sft_data.pt", whole / "sft_data.pt")
    ref_model = models.tiny_model(tokenizer, seed=0)
    ref = sft.run_sft(ref_model, tokenizer, cfg, whole / "model", run_dir=whole)
    assert ref["steps"] == 5 and len(ref["heldout_losses"]) == 4    # step 0, 2, 4 and the last

    logs = []
    resumed = models.tiny_model(tokenizer, seed=5)  # other initial weights: the checkpoint's must replace them
    got = sft.run_sft(resumed, tokenizer, cfg, killed / "model", run_dir=killed, log=logs.append)
    assert any("continuing from step 2 of 5" in line for line in logs), logs
    assert got["losses"] == ref["losses"] and got["heldout_losses"] == ref["heldout_losses"]
    assert got["final_loss"] == ref["final_loss"] and got["steps"] == 5
    for (name, a), b in zip(ref_model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(ref_model.state_dict().values(), models.load_model(killed / "model").state_dict().values()):
        assert torch.equal(a, b)
    assert sorted(p.name for p in killed.iterdir()) == ["model"]   # checkpoints and data go once the model is saved


def test_resuming_with_other_settings_is_refused(tokenizer, tmp_path, monkeypatch):
    cfg = sft.SFTConfig(n_examples=8, heldout_examples=0, batch_size=2, save_every=1, bf16=False)
    restore = interrupt_step(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        sft.run_sft(models.tiny_model(tokenizer), tokenizer, cfg, tmp_path / "model", run_dir=tmp_path)
    restore()
    with pytest.raises(sft.ResumeMismatch, match=r"lr: 0.0002 -> 0.001"):
        sft.run_sft(models.tiny_model(tokenizer), tokenizer, dataclasses.replace(cfg, lr=1e-3), tmp_path / "model",
                    run_dir=tmp_path)


def test_ctrl_c_in_the_recipes_sft_then_a_plain_rerun_continues_it(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """`rstar2_mini.py --stage sft` interrupted in its 6th step exits 130 and names the command that continues
    it; the same command run again continues the SFT from its checkpoint (step 5) instead of step 0."""
    import rstar2_mini as R

    args = ["--stage", "sft", "--model", str(tiny_model_dir), "--out", str(tmp_path / "run"),
            "--set", "sft_examples=12", "--set", "sft_batch=2"]   # 6 steps: a checkpoint after each of 1-5
    restore = interrupt_step(monkeypatch, 6)
    assert R.main(args) == 130
    restore()
    err = capsys.readouterr().err
    assert "--resume" in err and "--stage sft" in err and str(tmp_path / "run") in err, err
    assert R.main(args + ["--set", "sft_lr=1e-3"]) == 2                   # other settings: refused, nothing lost
    assert "(sft_lr: 0.0002 -> 0.001)" in capsys.readouterr().err
    assert R.main(args) == 0
    out = capsys.readouterr().out
    assert "continuing from step 5 of 6" in out, out
    metrics = json.loads((tmp_path / "run" / "sft" / "metrics.json").read_text())
    assert metrics["steps"] == len(metrics["losses"]) == 6 and metrics["resumed_at_step"] == 5
    models.load_model(tmp_path / "run" / "sft" / "model")


def test_ctrl_c_that_lands_inside_an_import_is_still_an_interruption(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """Python wraps an exception raised in a descriptor's __set_name__ (matplotlib.pyplot's first import runs many)
    in a RuntimeError: Ctrl-C there must still end the run as an interruption (exit 130, the command that
    continues it), not as a crash with a traceback."""
    import rstar2_mini as R

    class Wrapper:
        def __set_name__(self, owner, name):
            raise KeyboardInterrupt   # the signal arriving while a class body is being set up

    def interrupted(*args, **kw):
        class Axes:            # noqa: F841  (what `import matplotlib.pyplot` does hundreds of times)
            method = Wrapper()

    monkeypatch.setattr(sft, "accumulate_gradients", interrupted)
    with pytest.raises(RuntimeError) as wrapped:   # the interpreter's behaviour this test relies on
        interrupted()
    assert isinstance(wrapped.value.__cause__, KeyboardInterrupt)
    args = ["--stage", "sft", "--model", str(tiny_model_dir), "--out", str(tmp_path / "run"),
            "--set", "sft_examples=4", "--set", "sft_batch=2"]
    assert R.main(args) == 130
    err = capsys.readouterr().err
    assert "interrupted: the latest checkpoint is intact" in err and "--resume" in err, err


def env_after_import(entry: str, name: str, **set_vars):
    """(exit code, os.environ[name], stderr) in a fresh interpreter just after `import entry`, which must not load
    torch (its OpenMP runtime reads the variable once, when it loads); OMP_WAIT_POLICY, GOMP_SPINCOUNT,
    ONEDNN_PRIMITIVE_CACHE_CAPACITY and LRU_CACHE_CAPACITY are unset there unless given in set_vars."""
    import os
    import subprocess
    import sys

    code = f"import os, sys; import {entry}; assert 'torch' not in sys.modules; print(os.environ[{name!r}])"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                                                "ONEDNN_PRIMITIVE_CACHE_CAPACITY",
                                                                "LRU_CACHE_CAPACITY")} | set_vars
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(Path(__file__).resolve().parent.parent),
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout.strip(), done.stderr[-2000:]


@pytest.mark.parametrize("entry", ["rstar2_mini", "sft"])
def test_openmp_threads_wait_passively_in_the_entry_points(entry):
    """Importing an entry point sets OMP_WAIT_POLICY=PASSIVE before anything loads torch, and keeps a value the
    person set."""
    code, value, err = env_after_import(entry, "OMP_WAIT_POLICY")
    assert code == 0 and value == "PASSIVE", err
    code, value, err = env_after_import(entry, "OMP_WAIT_POLICY", OMP_WAIT_POLICY="ACTIVE")
    assert code == 0 and value == "ACTIVE", err


def test_the_main_command_spins_briefly_before_its_openmp_threads_sleep():
    """rstar2_mini sets GOMP_SPINCOUNT=3000 before anything loads torch: a waiting OpenMP thread spins about 30 us
    before it sleeps (the decode loop's many small kernels then find their team awake; docs/contention.md), and a
    value the person set is kept."""
    code, value, err = env_after_import("rstar2_mini", "GOMP_SPINCOUNT")
    assert code == 0 and value == "3000", err
    code, value, err = env_after_import("rstar2_mini", "GOMP_SPINCOUNT", GOMP_SPINCOUNT="0")
    assert code == 0 and value == "0", err


def test_the_main_command_keeps_few_onednn_kernels():
    """rstar2_mini caps oneDNN's primitive cache at 128 before anything loads torch: every new GEMM shape of the
    update (its micro-batches' token counts vary) kept a compiled kernel in the default cache of 1,024, and the
    resident size between updates grew with them (docs/memory.md). A value the person set is kept."""
    code, value, err = env_after_import("rstar2_mini", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    assert code == 0 and value == "128", err
    code, value, err = env_after_import("rstar2_mini", "ONEDNN_PRIMITIVE_CACHE_CAPACITY",
                                        ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024")
    assert code == 0 and value == "1024", err


def test_the_main_command_keeps_few_matmul_descriptors_in_torchs_own_cache():
    """torch's oneDNN bridge (ideep) keeps its own least-recently-used cache of matmul descriptors, 1,024 by default
    (LRU_CACHE_CAPACITY): over updates with varying micro-batch shapes oneDNN objects stayed alive with it past the
    primitive cache's cap, and the resident size between updates grew ~150 MB an update. rstar2_mini caps it at
    128 before anything loads torch (docs/memory.md); a value the person set is kept."""
    code, value, err = env_after_import("rstar2_mini", "LRU_CACHE_CAPACITY")
    assert code == 0 and value == "128", err
    code, value, err = env_after_import("rstar2_mini", "LRU_CACHE_CAPACITY", LRU_CACHE_CAPACITY="1024")
    assert code == 0 and value == "1024", err
