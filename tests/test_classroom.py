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

# One deliberately wrong version per exercise: (exercise, file, exact reference code, wrong code, a test that
# must catch it). Each is a mistake a student could make; the reference code must occur exactly once.
WRONG = [
    ("advantages", "grpo_roc.py", "std = r.std(unbiased=False)", "std = r.std()",   # sample std, as torch's default
     "tests/test_grpo_roc.py::test_group_advantages_hand_values"),
    ("roc", "grpo_roc.py", "kept_neg = rng.sample(neg, n_neg_keep)",                # negatives filtered by penalty
     "kept_neg = sorted(neg, key=lambda i: penalties[i])[:n_neg_keep]",
     "tests/test_grpo_roc.py::test_roc_statistics_match_inverse_penalty_weighting_and_uniform_negatives"),
    ("loss", "grpo_roc.py", "loss = torch.where(m, per_token, 0.0).sum() / num_tokens",   # a sequence mean
     "loss = (torch.where(m, per_token, 0.0).sum(-1) / m.sum(-1).clamp(min=1)).mean()",
     "tests/test_grpo_roc.py::test_policy_loss_matches_naive_loop_value_and_gradient"),
    ("tool-call", "scheduler.py", "    if name != TOOL_NAME:\n", "    if False:\n",    # any function name accepted
     "tests/test_scheduler.py::test_a_bad_call_becomes_an_error_text"),
    ("scheduler", "scheduler.py", "best = max(fits, key=lambda i: (free[i], -i))", "best = fits[0]",   # first fit
     "tests/test_scheduler.py::test_requests_go_to_the_engine_with_most_free_capacity"),
    ("answer", "eval.py", "start = text.rfind(ANSWER_OPEN)", "start = -1",         # a box anywhere in the text
     "tests/test_eval.py::test_extract_answer"),
]


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """A fresh blank copy, the reference (a blank copy with the project's modules put back) and a copy holding
    every wrong variant."""
    base = tmp_path_factory.mktemp("classroom")
    blank = C.make_student_copy(base / "blank", C.EXERCISES)
    reference = C.make_student_copy(base / "reference", C.EXERCISES)
    wrong = C.make_student_copy(base / "wrong", C.EXERCISES)
    sources = {m: (ROOT / m).read_text() for m in MODULES}
    for m, text in sources.items():
        (reference / m).write_text(text)
    for _, module, old, new, _ in WRONG:
        assert sources[module].count(old) == 1, (module, old)
        sources[module] = sources[module].replace(old, new)
    for m, text in sources.items():
        (wrong / m).write_text(text)
    return {"blank": blank, "reference": reference, "wrong": wrong}


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


def test_a_wrong_variant_is_caught_by_its_exercise(copies):
    scores = {s.exercise.name: s for s in C.grade(copies["wrong"])}
    for exercise, _, _, _, catcher in WRONG:
        s = scores[exercise]
        assert s.passed < s.total, exercise
        assert s.results[catcher].status == "failed", (exercise, catcher)
        assert "NotImplementedError" not in s.results[catcher].text and catcher.split("::")[1] in s.results[catcher].text
    summary = json.loads(C.as_json(copies["wrong"], list(scores.values())))
    assert summary["exercises"]["roc"]["tests"][WRONG[1][4]] == "failed"


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
