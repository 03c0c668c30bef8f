"""eval.py's evaluation half: the benchmark protocol on the rollout scheduler (tiny model, real sandbox), its
summary numbers, the JSON/markdown it writes, and its errors for people."""
import json
import subprocess
import sys
from pathlib import Path

import eval as E
import scheduler

ROOT = Path(__file__).resolve().parent.parent


def graded(reward, tool_calls=0, tool_errors=0, ok=0, text=""):
    t = scheduler.Trajectory("p", [1, 2, 3])
    t.segments = [scheduler.Segment([4, 5], 1, [0.0, 0.0])]
    t.reward, t.tool_calls, t.tool_errors = reward, tool_calls, tool_errors
    t.response_text = t.model_text = text  # no tool responses here: the model's text is the whole response
    t.tool_statuses = {"ok": ok} if ok else {}
    return t


def test_summary_numbers_by_hand():
    class P:
        def __init__(self, answer):
            self.answer = answer

    right = "<answer> \\boxed{7} </answer>"
    groups = [[graded(1.0, 1, 0, 1, right), graded(0.0, 2, 2, 0, "<answer> \\boxed{8} </answer>")],
              [graded(0.0), graded(0.0, text="no answer")]]
    s = E.summarize([P("7"), P("3")], groups, ks=(2,))
    assert s["pass@1"] == 0.25                    # 1 right out of 4 samples
    assert s["pass@2"] == 0.5                     # problem 1 solved by one of its 2 samples, problem 2 never
    assert s["tool_calls_per_problem"] == 1.5     # 3 calls over 2 problems
    assert s["tool_error_rate"] == 2 / 3
    assert s["tool_error_rate_correct"] == 0.0    # the correct trajectory's call ran clean
    assert s["valid_tool_call_share"] == 0.25
    assert s["answer_format_share"] == 0.5
    assert s["maj@2"] in (0.0, 0.5)               # a 1-1 tie: the first answer seen wins
    assert s["mixed_outcome_share"] == 0.5        # problem 1: one right, one wrong; problem 2: both wrong
    assert s["pass@1_by_family"] is None          # these problems name no family


def test_pass_at_1_by_family_averages_each_familys_samples():
    class P:
        def __init__(self, family):
            self.answer, self.family = "7", family

    groups = [[graded(1.0), graded(0.0)], [graded(1.0), graded(1.0)], [graded(0.0), graded(0.0)]]
    s = E.summarize([P("product"), P("binomial"), P("product")], groups, ks=())
    assert s["pass@1_by_family"] == {"binomial": 1.0, "product": 0.25}   # product: 1 right of its 4 samples
    assert "| family | binomial | product |\n|---|---|---|\n| pass@1 | 1.000 | 0.250 |" in E.markdown_table("heldout", s)


def test_distinct_programs_count_each_problems_different_first_calls():
    def call(code, stdin=""):
        body = json.dumps({"name": scheduler.TOOL_NAME, "arguments": {"code": code, "input": stdin}})
        return f"<reason> r </reason>\n<tool_call>\n{body}\n</tool_call>"

    class P:
        answer = "1"

    groups = [[graded(0.0, text=call("print(1)") + call("print(2)")),    # only the first call counts
               graded(0.0, text=call("print(1)")),
               graded(0.0, text=call("print(1)", stdin="5")),             # same code, other input: different
               graded(0.0, text="<answer> \\boxed{1} </answer>")],        # no call: not a program
              [graded(0.0, text=call("x = 2\nprint(x)")), graded(0.0, text="<tool_call>\n{oops\n</tool_call>"),
               graded(0.0), graded(0.0)]]
    assert E.first_program(call("print(1)") + call("print(2)")) == "print(1)\n---\n"
    assert E.summarize([P(), P()], groups, ks=())["distinct_programs_per_problem"] == (2 + 1) / 2


def run_cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "eval.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_cli_evaluates_a_model_and_writes_results(tmp_path, tiny_model_dir):
    r = run_cli("--model", str(tiny_model_dir), "--data", "heldout", "--limit", "2", "--samples", "2",
                "--max-turns", "1", "--max-tokens", "8", "--show", "1", "--out", str(tmp_path),
                "--tool-state", "persistent")
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["tool_state"] == "persistent"  # (--tool-state: one Python session per trajectory)
    assert result["problems"] == 2 and result["samples_per_problem"] == 2
    assert 0.0 <= result["pass@1"] <= 1.0 and "pass@2" in result
    assert "| heldout | 2 x 2 |" in (tmp_path / "result.md").read_text()
    assert "gold=" in r.stdout  # --show printed a trajectory


def test_cli_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1", "answer": "2"}\nnot json\n')
    r = run_cli("--data", str(bad))
    assert r.returncode == 2 and "line 2" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("--data", "no-such-set")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = run_cli("--model", str(tmp_path / "missing"), "--data", "heldout", "--limit", "1")
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_a_run_directory_given_as_the_model_names_the_model_inside_it(tmp_path):
    """rstar2_mini's SFT output is runs/NAME/sft with the run's config.json beside model/: passing that directory
    (a config.json, no weights) gets one line pointing at model/, not a tokenizer traceback."""
    run = tmp_path / "sft"
    (run / "model").mkdir(parents=True)
    (run / "config.json").write_text('{"stage": "sft"}')
    (run / "model" / "config.json").write_text("{}")
    (run / "model" / "model.safetensors").write_bytes(b"")
    r = run_cli("--model", str(run), "--data", "heldout", "--limit", "1")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "no model weights" in r.stderr and str(run / "model") in r.stderr
