"""Tests for classroom.py: blanking keeps the signature, docstring and comments and removes the code; grading the
reference gives full marks, grading a fresh blank copy gives zero on every exercise, a deliberately wrong variant
of each exercise is caught by that exercise's tests (named below), and every grading test calls its own
exercise's code and no other exercise's (so one exercise's grade never depends on another's); errors are for
people; a test that makes no progress is stopped and the rest are still graded.

Three real gradings (a pytest process each, a few seconds on an idle laptop) and a few runs on a tiny
synthetic project (no torch) for the stop-and-continue machinery."""
import ast
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

import pytest

import classroom as C

ROOT = Path(C.__file__).resolve().parent
MODULES = sorted({f.split(":")[0] for e in C.EXERCISES for f in e.functions})

# Deliberately wrong versions: (exercise, file, exact reference code, wrong code, a test that must catch it).
# Each is a mistake a student could make; the reference code must occur exactly once. The first of each
# exercise runs in every suite; the rest with CLASSROOM_ALL_WRONG=1 (a grading run per round of one per exercise).
R, S, E = "tests/test_grpo_roc.py::", "tests/test_scheduler.py::", "tests/test_eval.py::"
WRONG = [
    ("advantages", "grpo_roc.py", "std = r.std(unbiased=False)", "std = r.std()",   # torch's sample std
     R + "test_group_advantages_hand_values"),
    ("roc", "grpo_roc.py", "kept_neg = rng.sample(neg, n_neg_keep)",                # negatives filtered by penalty
     "kept_neg = sorted(neg, key=lambda i: penalties[i])[:n_neg_keep]",
     R + "test_roc_statistics_match_inverse_penalty_weighting_and_uniform_negatives"),
    ("loss", "grpo_roc.py", "loss = torch.where(m, per_token, 0.0).sum() / num_tokens",   # a sequence mean
     "loss = (torch.where(m, per_token, 0.0).sum(-1) / m.sum(-1).clamp(min=1)).mean()",
     R + "test_policy_loss_matches_naive_loop_value_and_gradient"),
    ("tool-call", "scheduler.py", "    if name != TOOL_NAME:\n", "    if False:\n",   # any function name accepted
     S + "test_a_bad_call_becomes_an_error_text"),
    ("scheduler", "scheduler.py", "best = max(fits, key=lambda i: (free[i], -i))", "best = fits[0]",   # first fit
     S + "test_requests_go_to_the_engine_with_most_free_capacity"),
    ("answer", "eval.py", "start = text.rfind(ANSWER_OPEN)", "start = -1",         # a box anywhere in the text
     E + "test_extract_answer"),
    # ---- more, with CLASSROOM_ALL_WRONG=1
    ("advantages", "grpo_roc.py", "return [len(group) > 0 and max(group) != min(group) for group in groups_rewards]",
     "return [sum(g) not in (0, len(g)) for g in groups_rewards]",                   # right for 0/1 rewards only
     R + "test_drop_uninformative_over_random_groups"),
    ("advantages", "grpo_roc.py", "return ((r - r.mean()) / (std + ADV_EPS)).float()",
     "return (r - r.mean()).float()", R + "test_group_advantages_hand_values"),     # not normalized
    ("roc", "grpo_roc.py", "ring_times = {i: rng.expovariate(1.0 / (penalties[i] + ROC_EPS)) for i in pos}",
     "ring_times = {i: rng.random() for i in pos}", R + "test_zero_penalty_positives_come_first"),   # uniform
    ("roc", "grpo_roc.py", "n_neg_target = (len(neg) * keep) // n", "n_neg_target = round(len(neg) * keep / n)",
     R + "test_downsample_exact_counts_for_every_split_of_2g"),                     # the released code's round
    ("roc", "grpo_roc.py", "kept_neg = rng.sample(neg, n_neg_keep)", "kept_neg = random.sample(neg, n_neg_keep)",
     R + "test_downsample_is_reproducible_from_the_rng"),                           # not the given rng
    ("roc", "grpo_roc.py", "p_err = 0.5 if tool_calls == 0 else", "p_err = 0.0 if tool_calls == 0 else",
     R + "test_roc_penalty_hand_values"),                                           # no call counted as clean
    ("loss", "grpo_roc.py", "torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)",
     "torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_low)", R + "test_policy_loss_hand_values_positive_advantage"),
    ("loss", "grpo_roc.py", "per_token = -torch.minimum(unclipped, clipped)", "per_token = -clipped",   # no min
     R + "test_policy_loss_hand_values_positive_advantage"),
    ("loss", "grpo_roc.py", "num_tokens = max(count, 1)", "num_tokens = logprobs.numel()",   # padding counted
     R + "test_policy_loss_matches_naive_loop_value_and_gradient"),
    ("loss", "grpo_roc.py", "log_ratio = torch.where(m, logprobs.float() - old_logprobs.detach().float(), 0.0)",
     "log_ratio = logprobs.float() - old_logprobs.detach().float()",                # NaN under the mask leaks
     R + "test_masked_tokens_get_zero_gradient_even_with_nan_and_inf"),
    ("tool-call", "scheduler.py", "body = found[-1].strip()", "body = found[0].strip()",   # the first call
     S + "test_parse_tool_call_reads_a_good_call"),
    ("tool-call", "scheduler.py", "    if not isinstance(stdin, str):\n", "    if False:\n",   # input unchecked
     S + "test_a_bad_call_becomes_an_error_text"),
    ("tool-call", "scheduler.py", "result = await pool.run(call.code, call.stdin, timeout_s=cfg.tool_timeout_s)",
     "result = await pool.run(call.code, call.stdin)",                              # no time limit
     S + "test_run_tool_runs_good_calls_and_hands_bad_ones_back_as_text"),
    ("scheduler", "scheduler.py", "and req.need <= free[i] and (cap <= 0 or self.engines[i].num_requests() < cap)]",
     "and req.need <= free[i]]", S + "test_pick_engine_follows_the_rule_on_random_loads"),   # no request cap
    ("scheduler", "scheduler.py", "best = max(fits, key=lambda i: (free[i], -i))",
     "best = max(fits, key=lambda i: (free[i], i))", S + "test_pick_engine_follows_the_rule_on_random_loads"),
    ("scheduler", "scheduler.py", "- self.cfg.prefix_affinity * self.engines[i].capacity_tokens",
     "- self.cfg.prefix_affinity * max(e.capacity_tokens for e in self.engines)",   # not its own capacity
     S + "test_pick_engine_follows_the_rule_on_random_loads"),
    ("answer", "eval.py", "    i = matches[-1].end()", "    i = matches[0].end()", E + "test_extract_answer"),
    ("answer", "eval.py", "            i += 2\n            continue", "            i += 1\n            continue",
     E + "test_extract_answer"),                                                    # "\\}" read as an escape
    ("answer", "eval.py", 'return Fraction(number[0].replace(",", ""))',             # a float is not exact
     'return Fraction(float(number[0].replace(",", "")))', E + "test_plain_number_exact_values"),
]
ROUNDS = [[w for w in WRONG if [v for v in WRONG if v[0] == w[0]].index(w) == k]
          for k in range(max(sum(w[0] == e.name for w in WRONG) for e in C.EXERCISES))]


def copy_with(base: Path, name: str, variants) -> Path:
    """A student copy of every exercise holding the reference code, changed by the variants."""
    copy = C.make_student_copy(base / name, C.EXERCISES)
    sources = {m: (ROOT / m).read_text() for m in MODULES}
    for _, module, old, new, _ in variants:
        assert sources[module].count(old) == 1, (module, old)
        sources[module] = sources[module].replace(old, new)
    for m, text in sources.items():
        (copy / m).write_text(text)
    return copy


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """A fresh blank copy and the reference (a blank copy with the project's modules put back)."""
    base = tmp_path_factory.mktemp("classroom")
    return {"blank": C.make_student_copy(base / "blank", C.EXERCISES), "reference": copy_with(base, "reference", [])}


# ---- the exercise table

def test_every_exercise_names_real_functions_tests_and_a_handout():
    assert len(C.EXERCISES) >= 5 and len(C.BY_NAME) == len(C.EXERCISES)
    named = [t for e in C.EXERCISES for t in e.tests]
    assert len(named) == len(set(named))                                  # no test grades two exercises
    for e in C.EXERCISES:
        for item in e.functions:
            module, qualname = item.split(":")
            C.find_function(ast.parse((ROOT / module).read_text()), qualname)
        for test in e.tests:
            file, name = test.split("::")
            assert any(isinstance(n, ast.FunctionDef) and n.name == name
                       for n in ast.parse((ROOT / file).read_text()).body), test
        handout = (ROOT / e.handout).read_text()
        for item in e.functions:   # the handout says what to write and what grades it
            assert item.split(":")[1].split(".")[-1] in handout, (e.name, item)
        for test in e.tests:
            assert test.split("::")[1] in handout, (e.name, test)
        assert e.name in (ROOT / C.HANDOUTS / "README.md").read_text()


# ---- blank

def comments_in(source: str, first: int, last: int) -> list[str]:
    return [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type == tokenize.COMMENT and first <= t.start[0] <= last]


def without_code(source: str, qualnames) -> str:
    """The module with every named function cut after its docstring (all the functions here have one)."""
    tree, lines = ast.parse(source), source.splitlines(keepends=True)
    functions = [C.find_function(tree, q) for q in qualnames]
    for fn in sorted(functions, key=lambda fn: fn.lineno, reverse=True):
        lines[fn.body[0].end_lineno:fn.end_lineno] = []
    return "".join(lines)


def test_blank_keeps_signature_docstring_and_comments_and_removes_the_code(copies):
    blank = copies["blank"]
    for module in MODULES:
        original, blanked = (ROOT / module).read_text(), (blank / module).read_text()
        qualnames = [f.split(":")[1] for e in C.EXERCISES for f in e.functions if f.startswith(module + ":")]
        for qualname in qualnames:
            old = C.find_function(ast.parse(original), qualname)
            new = C.find_function(ast.parse(blanked), qualname)
            assert ast.dump(new.args) == ast.dump(old.args)
            assert (new.returns and ast.dump(new.returns)) == (old.returns and ast.dump(old.returns))
            assert [ast.dump(d) for d in new.decorator_list] == [ast.dump(d) for d in old.decorator_list]
            assert ast.get_docstring(new, clean=False) == ast.get_docstring(old, clean=False)
            # nothing of the code is left: the docstring, then raise NotImplementedError
            assert len(new.body) == 2 and isinstance(new.body[1], ast.Raise), qualname
            assert new.body[1].exc.func.id == "NotImplementedError"
            # every comment of the code is kept (the equations), in order
            kept = comments_in(blanked, new.body[0].end_lineno + 1, new.end_lineno)
            assert kept == comments_in(original, *C.code_lines(old)), qualname
        assert "p_format = 1 if no <answer>" in blanked or module != "grpo_roc.py"
        # everything else in the module is untouched
        assert without_code(blanked, qualnames) == without_code(original, qualnames)
    for other in ("rstar2_mini.py", "sandbox.py", "sft.py", "tests/test_grpo_roc.py", "docs/exercises/roc.md"):
        assert (blank / other).read_bytes() == (ROOT / other).read_bytes()
    marker = json.loads((blank / C.MARKER).read_text())
    assert marker["exercises"] == [e.name for e in C.EXERCISES]
    assert "expovariate" in (copies["reference"] / "grpo_roc.py").read_text()
    assert "expovariate" not in (blank / "grpo_roc.py").read_text()


def test_blank_only_the_chosen_exercises(tmp_path):
    dest = C.make_student_copy(tmp_path / "hw", C.chosen(["loss"]))
    text = (dest / "grpo_roc.py").read_text()
    assert "rng.expovariate" in text and "torch.clamp(ratio" not in text
    assert (dest / "scheduler.py").read_bytes() == (ROOT / "scheduler.py").read_bytes()
    assert json.loads((dest / C.MARKER).read_text())["exercises"] == ["loss"]


def test_changes_outside_the_exercise_functions_are_listed(tmp_path):
    copy = C.make_student_copy(tmp_path / "hw", C.chosen(["loss"]))
    assert C.changed_elsewhere(copy, ["loss"]) == []
    module = copy / "grpo_roc.py"
    handed_out = module.read_text()
    module.write_text(module.read_text().replace('raise NotImplementedError("exercise loss', 'return 0.0  # ("'))
    assert C.changed_elsewhere(copy, ["loss"]) == []                     # the exercise's own code: expected
    module.write_text(module.read_text() + "\n\ndef helper():\n    return 1\n")
    (copy / "sandbox.py").write_text((copy / "sandbox.py").read_text().replace("Tool call success", "ok"))
    (copy / "mine.py").write_text("x = 1\n")
    assert C.changed_elsewhere(copy, ["loss"]) == ["grpo_roc.py", "mine.py (added)", "sandbox.py"]
    # the body of a function of an exercise not handed out is not the student's to change
    module.write_text(handed_out.replace("p_err + p_format   # p_total", "0.0   # p_total"))
    (copy / "sandbox.py").write_text((ROOT / "sandbox.py").read_text())
    (copy / "mine.py").unlink()
    assert C.changed_elsewhere(copy, ["loss"]) == ["grpo_roc.py"]


# ---- grade

def test_grading_the_reference_gives_full_marks_and_each_test_calls_only_its_own_exercise(copies):
    scores = C.grade(copies["reference"], trace=True)
    assert [s.exercise.name for s in scores] == [e.name for e in C.EXERCISES]
    for s in scores:
        assert s.passed == s.total, (s.exercise.name, s.first_failure())
        for test, outcome in s.results.items():
            # a test that never calls the exercise's code could not fail; one that calls another exercise's code
            # would make this grade depend on that exercise
            assert outcome.calls and outcome.calls <= set(s.exercise.functions), (test, outcome.calls)
    assert "first failing" not in C.report(copies["reference"], scores, 1.0)


def test_grading_a_fresh_blank_copy_gives_zero_on_every_exercise(copies):
    scores = C.grade(copies["blank"])
    for s in scores:
        assert s.passed == 0, s.exercise.name
        test, outcome = s.first_failure()
        assert test == s.exercise.tests[0]
        assert f"NotImplementedError: exercise {s.exercise.name}: write" in outcome.text
    text = C.report(copies["blank"], scores, 1.0)
    assert re.search(rf"^total +0/{sum(len(e.tests) for e in C.EXERCISES)} ", text, re.M)
    assert "handout: docs/exercises/roc.md" in text


@pytest.mark.parametrize("round_", range(len(ROUNDS)))
def test_a_wrong_variant_is_caught_by_its_exercise(round_, tmp_path):
    if round_ > 0 and not os.environ.get("CLASSROOM_ALL_WRONG"):
        pytest.skip("more wrong variants: set CLASSROOM_ALL_WRONG=1")
    variants = ROUNDS[round_]
    assert round_ > 0 or [v[0] for v in variants] == [e.name for e in C.EXERCISES]   # one of each, always
    copy = copy_with(tmp_path, "wrong", variants)
    scores = {s.exercise.name: s for s in C.grade(copy, [v[0] for v in variants])}
    for exercise, _, old, new, catcher in variants:
        s = scores[exercise]
        assert s.passed < s.total, (exercise, new)
        assert s.results[catcher].status == "failed", (exercise, new, catcher)
        text = s.results[catcher].text
        assert "NotImplementedError" not in text and catcher.split("::")[1] in text
    summary = json.loads(C.as_json(copy, list(scores.values())))
    assert all(summary["exercises"][v[0]]["tests"][v[4]] == "failed" for v in variants)


# Correct solutions written differently from the reference: a sequential weighted draw instead of the race of
# exponential clocks, boolean indexing instead of torch.where. They must get full marks: graded on behaviour.
OTHER_SOLUTIONS = {
    "roc_penalty": """
    for name, value in (("tool_calls", tool_calls), ("tool_errors", tool_errors), ("answer_tags", answer_tags),
                        ("turns", turns)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0")
    if tool_errors > tool_calls:
        raise ValueError("tool errors cannot exceed tool calls")
    if answer_tags and not turns:
        raise ValueError("answer tags with 0 turns")
    p_err = tool_errors / tool_calls if tool_calls else 0.5
    return p_err + (min(1.0, (answer_tags - 1) / turns) if answer_tags else 1.0)
""",
    "roc_downsample": """
    if mode not in ("roc", "topk", "none"):
        raise ValueError("mode must be roc, topk or none")
    if len(rewards) != len(penalties):
        raise ValueError("one of the penalties per reward, please")
    if keep < 0:
        raise ValueError("keep < 0")
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError("rewards must be finite")
    if not all(math.isfinite(p) and p >= 0 for p in penalties):
        raise ValueError("penalties must be finite and >= 0")
    n = len(rewards)
    if keep >= n:
        return list(range(n))
    if mode == "none":
        return sorted(rng.sample(range(n), keep))
    neg = [i for i, r in enumerate(rewards) if r <= 0]
    pos = [i for i, r in enumerate(rewards) if r > 0]
    k_pos = min(keep - len(neg) * keep // n, len(pos))
    kept = rng.sample(neg, keep - k_pos)
    if mode == "topk":
        return sorted(kept + sorted(pos, key=lambda i: (penalties[i], rng.random()))[:k_pos])
    left = list(pos)
    for _ in range(k_pos):
        weights = [1 / (penalties[i] + ROC_EPS) for i in left]
        x = rng.random() * sum(weights)
        j = 0
        while j < len(left) - 1 and x >= weights[j]:
            x -= weights[j]
            j += 1
        kept.append(left.pop(j))
    return sorted(kept)
""",
    "policy_loss": """
    if logprobs.dim() != 2 or logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError("logprobs, old_logprobs and mask must be the same [B, T]")
    if advantages.dim() == 1 and advantages.shape[0] == logprobs.shape[0]:
        advantages = advantages[:, None].expand_as(logprobs)
    elif advantages.shape != logprobs.shape:
        raise ValueError("advantages must be [B] or [B, T]")
    if num_tokens is not None and num_tokens <= 0:
        raise ValueError("num_tokens must be positive")
    m = mask.bool()
    count = int(m.sum())
    rho = torch.exp(logprobs.float()[m] - old_logprobs.detach().float()[m])
    a = advantages.detach().float()[m]
    loss = -torch.minimum(rho * a, rho.clamp(1 - clip_low, 1 + clip_high) * a).sum() / (num_tokens or max(count, 1))
    if not return_stats:
        return loss
    with torch.no_grad():
        c = max(count, 1)
        high, low = (a > 0) & (rho > 1 + clip_high), (a < 0) & (rho < 1 - clip_low)
        return loss, {"clip_frac": float((high | low).sum()) / c, "clip_frac_low": float(low.sum()) / c,
                      "clip_frac_high": float(high.sum()) / c, "ratio_mean": float(rho.sum()) / c if count else 1.0,
                      "ratio_min": float(rho.min()) if count else 1.0, "ratio_max": float(rho.max()) if count else 1.0,
                      "approx_kl": float((rho - 1 - torch.log(rho)).sum()) / c, "num_tokens": count}
""",
}


def test_a_correct_solution_written_differently_gets_full_marks(tmp_path):
    copy = C.make_student_copy(tmp_path / "hw", C.chosen(["roc", "loss"]))
    module = copy / "grpo_roc.py"
    text = module.read_text()
    for name, body in OTHER_SOLUTIONS.items():   # in place of the blank's raise line (the comments stay)
        start = text.index("    raise NotImplementedError(", text.index(f"def {name}("))
        end = text.index("\n", start) + 1
        text = text[:start] + body.lstrip("\n") + text[end:]
    module.write_text(text)
    scores = C.grade(copy)
    assert [(s.exercise.name, s.passed, s.total) for s in scores] == [("roc", 12, 12), ("loss", 8, 8)], \
        [s.first_failure() for s in scores]


# ---- errors for people

def test_errors_are_for_people(tmp_path, capsys, copies):
    def error(*argv):
        assert C.main([str(a) for a in argv]) == 2
        return capsys.readouterr().err

    err = error("blank", tmp_path / "x", "-e", "rocc")
    assert "unknown exercise 'rocc'" in err and "the exercises are: advantages, roc, loss" in err
    assert "unknown exercise 'lost'" in error("grade", copies["blank"], "-e", "lost")
    assert not (tmp_path / "x").exists()
    assert "is not a student copy" in error("grade", tmp_path)
    assert "does not exist" in error("grade", tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    assert "is not a folder" in error("grade", tmp_path / "file")
    assert "not an empty folder" in error("blank", copies["blank"])
    assert "inside the project" in error("blank", ROOT / "tests" / "hw")
    with pytest.raises(C.ClassroomError, match="itself a student copy"):
        C.make_student_copy(tmp_path / "again", C.EXERCISES, source=copies["blank"])
    only_loss = C.make_student_copy(tmp_path / "loss-only", C.chosen(["loss"]))
    assert "was not given exercise roc" in error("grade", only_loss, "-e", "roc")
    assert "--timeout must be > 0" in error("grade", only_loss, "--timeout", "0")
    (only_loss / C.MARKER).write_text("{")
    assert "is damaged" in error("grade", only_loss)


def test_the_command_line_exits_non_zero_with_one_clear_line(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "classroom.py"), "grade", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().splitlines() == [f"classroom.py: error: {tmp_path} is not a student copy (it has no "
                                               f"{C.MARKER}); make one with: python classroom.py blank DEST"]
    listing = subprocess.run([sys.executable, str(ROOT / "classroom.py"), "list"], capture_output=True, text=True,
                             timeout=60)
    assert listing.returncode == 0 and all(f"{e.name}: {e.title}" in listing.stdout for e in C.EXERCISES)


# ---- the stop-and-continue machinery, on a tiny project without torch

def tiny_project(tmp_path, test_source: str) -> Path:
    tree = tmp_path / "copy"
    (tree / "tests").mkdir(parents=True)
    (tree / "tests" / "test_fake.py").write_text(textwrap.dedent(test_source))
    (tree / "broken.py").write_text("def f(:\n")
    (tree / "pytest.ini").write_text("[pytest]\npythonpath = .\n")
    (tree / "classroom.py").write_text((ROOT / "classroom.py").read_text())
    return tree


def test_a_test_without_progress_is_stopped_and_the_others_still_run(tmp_path):
    tree = tiny_project(tmp_path, """
        import time
        import pytest
        def test_first(): pass
        def test_hangs(): time.sleep(3600)
        @pytest.mark.parametrize("x", [1, 2, 3])
        def test_after(x): assert x != 2, "two is wrong"
        def test_skipped(): pytest.skip("no data here")
        def test_last(): pass
        def test_not_graded(): assert False
    """)
    names = ["test_first", "test_hangs", "test_after", "test_skipped", "test_last", "test_missing"]
    tests = [f"tests/test_fake.py::{n}" for n in names]
    results = C.run_pytest(tree, tests, timeout_s=2.0, verbose=False, trace=False)
    status = {t.split("::")[1]: o.status for t, o in results.items()}
    assert status == {"test_first": "passed", "test_hangs": "failed", "test_after": "failed",
                      "test_skipped": "skipped", "test_last": "passed", "test_missing": "failed"}
    assert "no progress for 2 s" in results[tests[1]].text
    assert "two is wrong" in results[tests[2]].text                      # the failing case, not the first one
    assert "no data here" in results[tests[3]].text
    assert "no such test" in results[tests[5]].text


def test_a_module_that_cannot_be_imported_fails_its_tests_with_the_reason(tmp_path):
    tree = tiny_project(tmp_path, """
        import broken
        def test_uses_broken(): assert broken.f
    """)
    results = C.run_pytest(tree, ["tests/test_fake.py::test_uses_broken"], 30.0, False, False)
    outcome = results["tests/test_fake.py::test_uses_broken"]
    assert outcome.status == "failed" and "could not be collected" in outcome.text and "SyntaxError" in outcome.text
