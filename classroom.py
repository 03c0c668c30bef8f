"""classroom.py - classroom assignments: blank out one paper idea, let the project's own tests grade it.

Each exercise is one idea of rStar2-Agent (arXiv 2508.20722) that fits in an afternoon: the functions that
implement it, the handout that explains it (docs/exercises/<name>.md) and the tests that grade it (pytest node
ids from tests/). The teacher's guide is docs/exercises/README.md.

    python classroom.py list                                   # the exercises
    python classroom.py blank ~/hw1                            # a student copy, every exercise blanked
    python classroom.py blank ~/hw1 --exercise roc --exercise loss
    python classroom.py grade ~/hw1-alice                      # score per exercise, first failure explained

How data flows:

    blank:  this project --copy--> DEST; in each exercise function the code after the docstring (found with
            the ast module) becomes its comments (the equations stay) and `raise NotImplementedError(...)`;
            DEST/classroom-copy.json records which exercises were handed out
    grade:  COPY --copy to a temporary folder; tests/, pytest.ini and this file replaced by the grader's own
            (so a student's edits to the tests do not count)--> one pytest run over the exercises' test files,
            with this file as a pytest plugin that keeps only the named tests and logs each outcome
            --> a named test passes when every case of it passes; score = passed named tests / named tests

The grading tests of one exercise call no function of another exercise (tests/test_classroom.py checks it),
so each score depends only on that exercise's code. A test that makes no progress for --timeout seconds is
stopped, counted as failed, and the run goes on with the tests left. grade also names the .py files that
differ from the grader's outside the exercise functions: a note for the teacher, not part of the score.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tokenize
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent
MARKER = "classroom-copy.json"            # written into every student copy by `blank`
HANDOUTS = Path("docs") / "exercises"
NOT_COPIED = (".git", ".venv*", "__pycache__", ".pytest_cache", "runs", "out", "*.egg-info", MARKER)
GRADER_FILES = ("tests", "pytest.ini", "classroom.py")   # always the grader's own when grading
REPORT_ENV, SELECT_ENV = "CLASSROOM_REPORT", "CLASSROOM_SELECT"   # set only for the pytest run that grades
TRACE_ENV = "CLASSROOM_TRACE"             # also record which exercise functions each test calls
COLLECT_TIMEOUT_S = 300.0                 # the no-progress limit before the first test starts (imports torch)
EXPLAIN_LINES = 30                        # lines of pytest's short traceback shown for a first failure


# ----------------------------------------------------------------------------------------------------------------
# The exercises

@dataclass(frozen=True)
class Exercise:
    name: str
    title: str
    paper: str                    # the section of arXiv 2508.20722v1 to read
    functions: tuple[str, ...]    # "module.py:function" or "module.py:Class.method"
    tests: tuple[str, ...]        # pytest node ids (a parametrized test counts once: all its cases must pass)
    hours: float                  # an estimate of the work for a student who has read the section (not measured)

    @property
    def handout(self) -> Path:
        return HANDOUTS / f"{self.name}.md"


def node_ids(file: str, *names: str) -> tuple[str, ...]:
    return tuple(f"{file}::{name}" for name in names)


EXERCISES = [
    Exercise(
        "advantages", "Group advantages and dropping uninformative groups", "2.2 and 2.2.3",
        ("grpo_roc.py:group_advantages", "grpo_roc.py:drop_uninformative"),
        node_ids("tests/test_grpo_roc.py",
                 "test_group_advantages_hand_values",
                 "test_group_advantages_never_nan",
                 "test_group_advantages_match_the_formula_over_random_groups",
                 "test_drop_uninformative",
                 "test_drop_uninformative_over_random_groups"),
        hours=1),
    Exercise(
        "roc", "Resample-on-Correct: the RoC penalty and asymmetric down-sampling", "2.2.3",
        ("grpo_roc.py:roc_penalty", "grpo_roc.py:roc_downsample"),
        node_ids("tests/test_grpo_roc.py",
                 "test_roc_penalty_hand_values",
                 "test_roc_penalty_matches_the_equation_on_a_grid",
                 "test_roc_penalty_rejects_bad_counts",
                 "test_downsample_exact_counts_for_every_split_of_2g",
                 "test_downsample_general_keep_and_fill",
                 "test_downsample_validation",
                 "test_downsample_is_reproducible_from_the_rng",
                 "test_topk_keeps_lowest_penalty_positives_and_breaks_ties_at_random",
                 "test_zero_penalty_positives_come_first",
                 "test_roc_statistics_match_inverse_penalty_weighting_and_uniform_negatives",
                 "test_roc_first_pick_ratio_is_the_inverse_penalty_ratio",
                 "test_mode_none_is_a_uniform_subset_blind_to_rewards"),
        hours=3),
    Exercise(
        "loss", "The clipped token-level policy loss with clip-higher and masking", "2.2",
        ("grpo_roc.py:policy_loss",),
        node_ids("tests/test_grpo_roc.py",
                 "test_policy_loss_hand_values_positive_advantage",
                 "test_policy_loss_hand_values_negative_advantage",
                 "test_policy_loss_clip_range_is_configurable",
                 "test_policy_loss_matches_naive_loop_value_and_gradient",
                 "test_masked_tokens_get_zero_gradient_even_with_nan_and_inf",
                 "test_num_tokens_makes_micro_batches_add_up_to_the_batch_token_mean",
                 "test_policy_loss_no_kl_no_entropy_and_edge_cases",
                 "test_policy_loss_accepts_bf16_logprobs"),
        hours=3),
    Exercise(
        "tool-call", "Parsing a tool call; a bad call comes back as an error text", "2.1",
        ("scheduler.py:parse_tool_call", "scheduler.py:run_tool"),
        node_ids("tests/test_scheduler.py",
                 "test_parse_tool_call_reads_a_good_call",
                 "test_parse_tool_call_without_a_complete_call_is_none",
                 "test_parse_tool_call_round_trips_any_code_and_input",
                 "test_a_bad_call_becomes_an_error_text",
                 "test_run_tool_runs_good_calls_and_hands_bad_ones_back_as_text"),
        hours=2),
    Exercise(
        "scheduler", "The load-balanced rollout scheduler's placement rule", "3.2",
        ("scheduler.py:Scheduler.pick_engine", "scheduler.py:Scheduler.near_best"),
        node_ids("tests/test_scheduler.py",
                 "test_requests_go_to_the_engine_with_most_free_capacity",
                 "test_a_continuation_waits_for_the_engine_holding_its_prefix_without_blocking_the_others",
                 "test_pick_engine_follows_the_rule_on_random_loads",
                 "test_kv_routing_serves_every_request_on_the_freest_engine_without_overfilling"),
        hours=2),
    Exercise(
        "answer", "A strict answer check for the reward: the final boxed answer, exact numbers", "2.2",
        ("eval.py:answer_region", "eval.py:braced_group", "eval.py:last_boxed", "eval.py:plain_number"),
        node_ids("tests/test_eval.py",
                 "test_extract_answer",
                 "test_answer_format_ok",
                 "test_reward",
                 "test_plain_number_exact_values",
                 "test_plain_number_is_none_for_anything_else",
                 "test_plain_numbers_compare_exactly"),
        hours=2),
]
BY_NAME = {e.name: e for e in EXERCISES}


class ClassroomError(Exception):
    """A mistake in how the command was called; main() prints it and exits with status 2."""


def chosen(names) -> list[Exercise]:
    """The exercises named (all when none), in table order; an unknown name is an error."""
    if not names:
        return list(EXERCISES)
    wanted = [n.strip() for name in names for n in name.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in BY_NAME]
    if unknown:
        raise ClassroomError(f"unknown exercise {', '.join(map(repr, unknown))}; the exercises are: "
                             f"{', '.join(BY_NAME)} (python classroom.py list)")
    return [e for e in EXERCISES if e.name in wanted]


# ----------------------------------------------------------------------------------------------------------------
# blank: remove the code of a function, keep its signature, docstring and comments

def find_function(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The def of "function" or "Class.method" at the top of a module."""
    scope, node = tree.body, None
    for part in qualname.split("."):
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            raise LookupError(qualname)
        scope = node.body
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise LookupError(qualname)
    return node


def code_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[int, int]:
    """First and last line (1-based, inclusive) of a function's code after its docstring."""
    first = fn.body[0]
    has_docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
        and isinstance(first.value.value, str)
    if has_docstring and len(fn.body) == 1:
        raise ValueError(f"{fn.name} has no code after its docstring")
    start = fn.body[1].lineno if has_docstring else first.lineno
    if start == fn.lineno:
        raise ValueError(f"{fn.name} is written on one line; it cannot be blanked")
    return start, fn.end_lineno


def blank_functions(source: str, qualnames: list[str], exercise: str) -> str:
    """source with the code of each function replaced by its comments and a NotImplementedError."""
    tree = ast.parse(source)
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string
    lines = source.splitlines(keepends=True)
    spans = []
    for qualname in qualnames:
        fn = find_function(tree, qualname)
        start, end = code_lines(fn)
        spans.append((start, end, " " * fn.body[0].col_offset, qualname.split(".")[-1]))
    for start, end, indent, name in sorted(spans, reverse=True):   # bottom up: earlier line numbers stay valid
        kept = [f"{indent}{comments[n]}\n" for n in range(start, end + 1) if n in comments]
        kept.append(f'{indent}raise NotImplementedError("exercise {exercise}: write {name} '
                    f'(handout: {(HANDOUTS / exercise).as_posix()}.md)")\n')
        lines[start - 1:end] = kept
    blanked = "".join(lines)
    ast.parse(blanked)   # still valid Python
    return blanked


def is_inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def copy_tree(src: Path, dest: Path) -> None:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(*NOT_COPIED), symlinks=True, dirs_exist_ok=True)


def source_commit(root: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def make_student_copy(dest: Path, exercises: list[Exercise], source: Path = ROOT) -> Path:
    """Copy the project to dest and blank the exercises' functions there. Returns dest."""
    dest = Path(dest).expanduser().resolve()
    if (source / MARKER).exists():
        raise ClassroomError(f"{source} is itself a student copy ({MARKER}); run blank from the full project")
    if is_inside(dest, source):
        raise ClassroomError(f"{dest} is inside the project {source}; choose a folder outside it")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ClassroomError(f"{dest} already exists and is not an empty folder; choose a new one")
    by_file: dict[str, list[tuple[str, str]]] = {}
    for ex in exercises:
        for item in ex.functions:
            module, qualname = item.split(":")
            by_file.setdefault(module, []).append((qualname, ex.name))
    blanked = {}
    for module, items in by_file.items():   # everything is checked before anything is written
        text = (source / module).read_text()
        for ex_name in dict.fromkeys(name for _, name in items):
            try:
                text = blank_functions(text, [q for q, name in items if name == ex_name], ex_name)
            except LookupError as e:
                raise ClassroomError(f"exercise {ex_name}: {module} defines no function {e.args[0]}; "
                                     f"the exercise table in classroom.py is out of date") from None
        blanked[module] = text
    copy_tree(source, dest)
    for module, text in blanked.items():
        (dest / module).write_text(text)
    marker = {"exercises": [e.name for e in exercises],
              "functions": {e.name: list(e.functions) for e in exercises},
              "made_from": source_commit(source)}
    (dest / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return dest


# ----------------------------------------------------------------------------------------------------------------
# grade: the named tests, one pytest run, this file as its plugin

@dataclass
class Outcome:
    status: str                   # "passed" | "failed" | "skipped"
    text: str = ""                # why: the failing frames and the exception (or the skip reason)
    calls: set[str] = field(default_factory=set)   # with trace: the exercise functions its cases called
    case: str = ""                # the case this outcome is from ("test_x[3-4]" of a parametrized test)


def outside_functions(source: str, qualnames: list[str]) -> str:
    """A module's text with the named functions cut after their docstrings: what a student should not change."""
    tree, lines = ast.parse(source), source.splitlines(keepends=True)
    functions = sorted((find_function(tree, q) for q in qualnames), key=lambda fn: fn.lineno, reverse=True)
    for fn in functions:
        lines[fn.body[0].end_lineno:fn.end_lineno] = []
    return "".join(lines)


def changed_elsewhere(copy: Path, handed_out: list[str], grader: Path = ROOT) -> list[str]:
    """The top-level .py files of a copy that differ from the grader's outside the handed-out exercises'
    function bodies (added helper functions included). The tests ran with them as they are; this only tells
    the teacher where to look."""
    functions: dict[str, list[str]] = {}
    for ex in chosen(handed_out):
        for item in ex.functions:
            module, qualname = item.split(":")
            functions.setdefault(module, []).append(qualname)
    changed = []
    names = ({p.name for p in copy.glob("*.py")} | {p.name for p in grader.glob("*.py")}) - {"classroom.py"}
    for name in sorted(names):
        mine, theirs = copy / name, grader / name
        if not mine.exists() or not theirs.exists():
            changed.append(f"{name} ({'removed' if theirs.exists() else 'added'})")
            continue
        a, b = mine.read_text(errors="replace"), theirs.read_text(errors="replace")
        if name in functions:
            try:
                a, b = outside_functions(a, functions[name]), outside_functions(b, functions[name])
            except (SyntaxError, LookupError, ValueError):
                pass                           # compared whole: a syntax error or a renamed function is a change
        if a != b:
            changed.append(name)
    return changed


@dataclass
class Score:
    exercise: Exercise
    results: dict[str, Outcome] = field(default_factory=dict)   # named test -> outcome (all its cases)

    @property
    def passed(self) -> int:
        return sum(o.status == "passed" for o in self.results.values())

    @property
    def total(self) -> int:
        return len(self.exercise.tests)

    def first_failure(self) -> tuple[str, Outcome] | None:
        return next(((t, o) for t, o in self.results.items() if o.status != "passed"), None)


def read_marker(copy: Path) -> dict:
    if not copy.exists():
        raise ClassroomError(f"{copy} does not exist")
    if not copy.is_dir():
        raise ClassroomError(f"{copy} is not a folder")
    marker = copy / MARKER
    if not marker.exists():
        raise ClassroomError(f"{copy} is not a student copy (it has no {MARKER}); "
                             f"make one with: python classroom.py blank DEST")
    try:
        data = json.loads(marker.read_text())
        return {"exercises": list(data["exercises"]), "made_from": data.get("made_from")}
    except (ValueError, KeyError, TypeError):
        raise ClassroomError(f"{marker} is damaged; it should list the exercises handed out") from None


def belongs_to(case: str, test: str) -> bool:
    """Whether a collected case ("f.py::test_x[3-4]") is the named test ("f.py::test_x") or one of its cases."""
    return case == test or (case.startswith(test) and case[len(test)] == "[")


def run_pytest(tree: Path, tests: list[str], timeout_s: float, verbose: bool, trace: bool) -> dict[str, Outcome]:
    """Outcome of every case of the named tests, from as many pytest runs as stops for no progress need."""
    cases: dict[str, Outcome] = {}
    collect_errors: dict[str, str] = {}
    stalled: list[str] = []            # tests that made no progress: failed, and left out of the next run
    while True:
        left = [t for t in tests if t not in stalled and not any(belongs_to(c, t) for c in cases)]
        files = sorted({t.split("::")[0] for t in left} - set(collect_errors))
        if not left or not files:
            break
        stuck = one_pytest_run(tree, files, left, timeout_s, verbose, trace, cases, collect_errors)
        if stuck is None:
            break
        if stuck == "collection":   # importing a test file (so a student module) never ended
            reason = "stopped: importing it (or the modules it tests) made no progress"
            collect_errors.update({f: reason for f in files})
            break
        stalled.append(next((t for t in left if belongs_to(stuck, t)), stuck))
        cases[stuck] = Outcome("failed", f"stopped: no progress for {timeout_s:g} s (an endless loop? a wait that "
                                         f"never ends?)")
    results = {}
    for test in tests:
        mine = [replace(o, case=c) for c, o in cases.items() if belongs_to(c, test)]
        file = test.split("::")[0]
        if not mine:
            results[test] = Outcome("failed", f"{file} could not be collected:\n{collect_errors[file]}"
                                    if file in collect_errors else "no such test was collected (is the exercise "
                                    "table in classroom.py out of date?)")
        else:
            results[test] = next((o for o in mine if o.status == "failed"),
                                 next((o for o in mine if o.status == "skipped"), mine[0]))
            results[test].calls = set().union(*(o.calls for o in mine))
    return results


def one_pytest_run(tree: Path, files: list[str], tests: list[str], timeout_s: float, verbose: bool, trace: bool,
                   cases: dict[str, Outcome], collect_errors: dict[str, str]) -> str | None:
    """One pytest process; fills cases and collect_errors from its log. Returns the case (or "collection")
    that made no progress for timeout_s seconds, after stopping the process, else None."""
    log, output = tree.parent / "report.jsonl", tree.parent / "pytest-output.txt"
    log.write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    env.update({REPORT_ENV: str(log), SELECT_ENV: json.dumps(tests), "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONPATH": str(tree) + os.pathsep + env.get("PYTHONPATH", "")})
    if trace:
        env[TRACE_ENV] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "classroom", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", "--tb=no", *files]
    with open(output, "w") as out:
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    current, last_event, offset, events = "collection", time.monotonic(), 0, 0
    try:
        while True:
            finished = proc.poll() is not None
            with open(log, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk[:chunk.rfind(b"\n") + 1]   # a line still being written waits for the next look
            offset += len(complete)
            for line in complete.decode().splitlines():
                event = json.loads(line)
                last_event, events = time.monotonic(), events + 1
                if event["kind"] == "start":
                    current = event["nodeid"]
                elif event["kind"] == "collect":
                    collect_errors[event["nodeid"]] = event["text"]
                elif event["kind"] == "report":
                    merge_report(cases, event)
                    cases[event["nodeid"]].calls.update(event.get("calls", ()))
                    if event["when"] == "teardown":
                        current = None
            if finished:
                if verbose:
                    print(output.read_text(), end="")
                if events == 0 and proc.returncode not in (0, 1, 5):
                    tail = "\n".join(output.read_text().splitlines()[-15:])
                    raise ClassroomError(f"pytest could not run (exit status {proc.returncode}):\n{tail}")
                return None
            if time.monotonic() - last_event > (timeout_s if events else max(timeout_s, COLLECT_TIMEOUT_S)):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return current or "collection"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def merge_report(cases: dict[str, Outcome], event: dict) -> None:
    """A case fails when any of its phases (setup, call, teardown) fails, and is skipped when one is skipped."""
    before = cases.get(event["nodeid"])
    if event["outcome"] == "failed":
        if before is None or before.status != "failed":
            cases[event["nodeid"]] = Outcome("failed", event["text"])
    elif event["outcome"] == "skipped":
        if before is None or before.status == "passed":
            cases[event["nodeid"]] = Outcome("skipped", event["text"])
    elif before is None:
        cases[event["nodeid"]] = Outcome("passed")


def grade(copy: Path, names=None, timeout_s: float = 120.0, verbose: bool = False, trace: bool = False,
          grader: Path = ROOT) -> list[Score]:
    """Run the named tests of the chosen exercises (default: those handed out) on a student copy.
    trace=True also records which exercise functions each test calls (Outcome.calls; tests/test_classroom.py
    checks with it that every grading test calls its own exercise's code and no other exercise's)."""
    copy = Path(copy).expanduser().resolve()
    marker = read_marker(copy)
    if importlib.util.find_spec("pytest") is None:
        raise ClassroomError(f"pytest is not installed for {sys.executable}; pip install -r requirements.txt")
    exercises = chosen(names) if names else chosen(marker["exercises"])
    missing = [e.name for e in exercises if e.name not in marker["exercises"]]
    if missing:
        raise ClassroomError(f"{copy} was not given exercise {', '.join(missing)}; it holds: "
                             f"{', '.join(marker['exercises'])}")
    with tempfile.TemporaryDirectory(prefix="classroom-grade-") as tmp:
        tree = Path(tmp) / "copy"
        copy_tree(copy, tree)
        for name in GRADER_FILES:            # the grader's tests, never the student's
            target = tree / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
            if (grader / name).is_dir():
                copy_tree(grader / name, target)
            else:
                shutil.copy2(grader / name, target)
        tests = [t for e in exercises for t in e.tests]
        results = run_pytest(tree, tests, timeout_s, verbose, trace)
    return [Score(e, {t: results[t] for t in e.tests}) for e in exercises]


def explain(text: str) -> str:
    lines = text.rstrip().splitlines()
    if len(lines) > EXPLAIN_LINES:
        lines = lines[:EXPLAIN_LINES] + [f"... ({len(lines) - EXPLAIN_LINES} more lines)"]
    return "\n".join("    " + line for line in lines)


def report(copy: Path, scores: list[Score], seconds: float, changed=()) -> str:
    width = max(len("exercise"), *(len(s.exercise.name) for s in scores))
    paper = max(len("section"), *(len(s.exercise.paper) for s in scores))
    out = [f"grading {copy}", "", f"{'exercise':<{width}}  score  {'section':<{paper}}  title"]
    for s in scores:
        out.append(f"{s.exercise.name:<{width}}  {s.passed:>2}/{s.total:<2}  {s.exercise.paper:<{paper}}  "
                   f"{s.exercise.title}")
    out.append(f"{'total':<{width}}  {sum(s.passed for s in scores):>2}/{sum(s.total for s in scores):<2}"
               f"  ({seconds:.0f} s)")
    if changed:
        out.append(f"note: changed outside the exercise functions, and tested as they are (diff -r against a "
                   f"fresh blank copy shows how): {', '.join(changed)}")
    for s in scores:
        failure = s.first_failure()
        if failure:
            test, outcome = failure
            case = outcome.case[len(test):] if outcome.case.startswith(test) else ""
            out += ["", f"{s.exercise.name}: first failing test {test}{f', case {case}' if case else ''} "
                        f"({outcome.status})", explain(outcome.text),
                    f"    handout: {s.exercise.handout.as_posix()}"]
    return "\n".join(out)


def as_json(copy: Path, scores: list[Score], changed=()) -> str:
    return json.dumps({"copy": str(copy), "changed_elsewhere": list(changed), "exercises": {
        s.exercise.name: {"passed": s.passed, "total": s.total,
                          "tests": {t: o.status for t, o in s.results.items()},
                          "first_failure": s.first_failure()[0] if s.first_failure() else None}
        for s in scores}})


# ----------------------------------------------------------------------------------------------------------------
# The pytest plugin (active only in the run that `grade` starts: `-p classroom` with CLASSROOM_REPORT set)

CALLS: set[str] = set()   # with CLASSROOM_TRACE: the exercise functions called by the current test
FAILURES: dict[tuple[str, str], str] = {}   # (node id, phase) -> explanation, made where the exception is at hand


def _log(event: dict) -> None:
    with open(os.environ[REPORT_ENV], "a") as f:
        f.write(json.dumps(event) + "\n")


def pytest_configure(config):
    """With CLASSROOM_TRACE, wrap every exercise function (before the tests import them) to note its calls."""
    if REPORT_ENV not in os.environ or TRACE_ENV not in os.environ:
        return
    import importlib

    for ex in EXERCISES:
        for item in ex.functions:
            module, qualname = item.split(":")
            owner = importlib.import_module(module.removesuffix(".py"))
            *path, name = qualname.split(".")
            for part in path:
                owner = getattr(owner, part)
            original = getattr(owner, name)

            def traced(*args, _original=original, _item=item, **kwargs):
                CALLS.add(_item)
                return _original(*args, **kwargs)   # a coroutine function's coroutine is returned as it is
            setattr(owner, name, traced)


def pytest_collection_modifyitems(config, items):
    if REPORT_ENV not in os.environ:
        return
    wanted = json.loads(os.environ[SELECT_ENV])
    keep = [item for item in items if any(belongs_to(item.nodeid, t) for t in wanted)]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


def pytest_collectreport(report):
    """A test file that cannot be imported: the part of pytest's report from the test file's own frame on."""
    if REPORT_ENV in os.environ and report.failed:
        lines = report.longreprtext.replace(os.getcwd() + os.sep, "").splitlines()
        start = next((i for i, line in enumerate(lines) if line.startswith("tests" + os.sep)), 0)
        _log({"kind": "collect", "nodeid": report.nodeid, "text": "\n".join(lines[start:])})


def pytest_runtest_logstart(nodeid, location):
    if REPORT_ENV in os.environ:
        CALLS.clear()
        _log({"kind": "start", "nodeid": nodeid})


def comment_above(filename: str, lineno: int) -> list[str]:
    """The nearest block of whole-line comments above a line of a test, within its function: in this project's
    tests that is where the expected values are worked out by hand."""
    import linecache

    block: list[str] = []
    for n in range(lineno - 1, 0, -1):
        line = linecache.getline(filename, n).strip()
        if line.startswith("#"):
            block.insert(0, line)
        elif block or line.startswith(("def ", "async def ", "@")):
            break
    return block


def explain_exception(excinfo) -> str:
    """The frames of the project (tests and modules; not pytest's, not the libraries'), the hand-worked comment
    above the failing line of the test, and the exception as pytest's assertion rewriting words it. Much
    cheaper than pytest's own report, which parses each file again for every failure."""
    import traceback

    here = os.getcwd() + os.sep
    lines, test_frame = [], None
    for frame in traceback.extract_tb(excinfo.tb):
        if frame.filename.startswith(here) and "site-packages" not in frame.filename:
            lines.append(f"{frame.filename[len(here):]}:{frame.lineno} in {frame.name}")
            if frame.line:
                lines.append(f"    {frame.line}")
            if frame.filename[len(here):].startswith("tests" + os.sep):
                test_frame = frame
    notes = comment_above(test_frame.filename, test_frame.lineno) if test_frame else []
    return "\n".join(lines + (["the test says:"] + [f"    {c}" for c in notes] if notes else [])
                     + excinfo.exconly().splitlines())


def pytest_runtest_makereport(item, call):
    if REPORT_ENV in os.environ and call.excinfo is not None and call.excinfo.typename != "Skipped":
        FAILURES[item.nodeid, call.when] = explain_exception(call.excinfo)


def pytest_runtest_logreport(report):
    if REPORT_ENV not in os.environ:
        return
    text = ""
    if report.failed:
        text = FAILURES.pop((report.nodeid, report.when), "") or report.longreprtext
    elif report.skipped and isinstance(report.longrepr, tuple):
        text = f"skipped: {report.longrepr[2]}"
    event = {"kind": "report", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome, "text": text}
    if report.when == "teardown" and TRACE_ENV in os.environ:
        event["calls"] = sorted(CALLS)
    _log(event)


# ----------------------------------------------------------------------------------------------------------------
# Command line

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="classroom.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the exercises: functions, tests, handouts")
    p = sub.add_parser("blank", help="make a student copy with the exercises' function bodies removed")
    p.add_argument("dest", type=Path, help="a new (or empty) folder for the student copy")
    p.add_argument("--exercise", "-e", action="append", metavar="NAME",
                   help="an exercise to hand out (repeat it, or a comma list); default: all")
    p = sub.add_parser("grade", help="grade a student copy with this project's tests")
    p.add_argument("copy", type=Path, help="a folder made by `classroom.py blank`")
    p.add_argument("--exercise", "-e", action="append", metavar="NAME",
                   help="grade only this exercise (repeat it, or a comma list); default: those handed out")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds without progress after which a test is stopped and failed (default 120)")
    p.add_argument("--json", action="store_true", help="also print the scores as one JSON line, last")
    p.add_argument("--verbose", action="store_true", help="show pytest's own output")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            for e in EXERCISES:
                print(f"{e.name}: {e.title} (paper section {e.paper}; an estimated {e.hours:g} h of work)\n"
                      f"  handout:   {e.handout.as_posix()}\n  functions: {', '.join(e.functions)}\n"
                      f"  graded by {len(e.tests)} tests in {', '.join(sorted({t.split('::')[0] for t in e.tests}))}")
        elif args.command == "blank":
            exercises = chosen(args.exercise)
            dest = make_student_copy(args.dest, exercises)
            print(f"student copy: {dest}")
            for e in exercises:
                print(f"  {e.name}: {', '.join(e.functions)} blanked; handout {e.handout.as_posix()}")
            print(f"grade it with: python {Path(__file__).name} grade {dest}")
        else:
            if args.timeout <= 0:
                raise ClassroomError(f"--timeout must be > 0, got {args.timeout:g}")
            start = time.monotonic()
            scores = grade(args.copy, args.exercise, args.timeout, args.verbose)
            copy = args.copy.expanduser().resolve()
            marker = read_marker(copy)
            changed = changed_elsewhere(copy, marker["exercises"])
            print(report(copy, scores, time.monotonic() - start, changed))
            here = source_commit(ROOT)
            if changed and marker["made_from"] and here and marker["made_from"] != here:
                print(f"note: the copy was made from commit {marker['made_from'][:12]}, the grader is at "
                      f"{here[:12]}: some of those differences may be the project's own")
            if args.json:
                print(as_json(copy, scores, changed))
    except ClassroomError as e:
        print(f"classroom.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
