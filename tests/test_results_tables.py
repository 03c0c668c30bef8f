"""bench/results.py's held-out table by wording: counts over the problems a run evaluated, rebuilt from its config."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tasks

ROOT = Path(__file__).resolve().parent.parent


def test_wordings_count_each_runs_heldout_problems_by_their_template(tmp_path):
    problems = tasks.heldout_problems(44, seed=1234, levels=(1,))
    # right after RL: every third problem and every binomial "Compute n choose k."; right before: none but the first
    after = [float(i % 3 == 0 or p.question.startswith("Compute ") and " choose " in p.question)
             for i, p in enumerate(problems)]
    before = [float(i == 0) for i in range(len(problems))]
    stage = tmp_path / "run" / "stage1"
    stage.mkdir(parents=True)
    (stage / "config.json").write_text(json.dumps({"eval_problems": 44, "levels": [1], "families": []}))
    rows = [{"step": 0, "heldout_acc": 0.1, "heldout_acc_by_problem": before},
            {"step": 1, "reward": 0.5, "step_time_s": 1.0},
            {"step": 1, "reward": 0.5, "step_time_s": 1.0, "heldout_acc": 0.3, "heldout_acc_by_problem": after}]
    (stage / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    out = subprocess.run([sys.executable, str(ROOT / "bench" / "results.py"), "--run", f"s0={stage / 'metrics.jsonl'}",
                          "--wordings", "--out", str(tmp_path / "docs")], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])["wordings"]["s0"][0]

    expected = {}   # brute force: each problem's question with every digit run read as one N
    for p, b, a in zip(problems, before, after):
        key = f"{p.family} | {re.sub('[0-9]+', 'N', p.question)}"
        n_b, n_a, n = expected.get(key, (0, 0, 0))
        expected[key] = (n_b + b, n_a + a, n + 1)
    assert {k: tuple(v) for k, v in got.items()} == expected
    assert sum(v[2] for v in got.values()) == 44
    cnk = [v for k, v in got.items() if "Compute N choose N." in k]
    assert cnk and all(v[1] == v[2] for v in cnk)       # all right after, as constructed
    assert "binomial | Compute N choose N." in out.stdout   # the printed table names it


def test_seed_spread_of_validation_and_test_is_the_standard_error_over_seeds(tmp_path):
    """Three seeds' last evaluations -> mean ± standard error over seeds (stdev / sqrt(n), by statistics.stdev),
    for the validation set (heldout_*) and the test split (test_*) alike; a run without a test evaluation (older
    versions) leaves the test figure out instead of counting it as zero."""
    import statistics

    finals = {"s0": (0.40, 0.35), "s1": (0.45, 0.30), "s2": (0.50, 0.41)}
    args = []
    for name, (val, test) in finals.items():
        stage = tmp_path / name / "stage1"
        stage.mkdir(parents=True)
        rows = [{"step": 0, "heldout_acc": 0.1, "test_acc": 0.12},
                {"step": 1, "reward": 0.5, "step_time_s": 1.0, "heldout_acc": val, "test_acc": test}]
        (stage / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        args += ["--run", f"preset={stage / 'metrics.jsonl'}"]
    old = tmp_path / "old" / "stage1"
    old.mkdir(parents=True)
    (old / "metrics.jsonl").write_text(json.dumps({"step": 0, "heldout_acc": 0.1}) + "\n" + json.dumps(
        {"step": 1, "reward": 0.5, "step_time_s": 1.0, "heldout_acc": 0.3}) + "\n")
    args += ["--run", f"older={old / 'metrics.jsonl'}"]
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "results.py"), *args, "--out", str(tmp_path / "docs")],
                         capture_output=True, text=True, check=True)
    runs = json.loads(out.stdout.strip().splitlines()[-1])["runs"]
    for split, k in (("heldout", 0), ("test", 1)):
        xs = [v[k] for v in finals.values()]
        assert runs["preset"][f"{split}_after_mean"] == pytest.approx(statistics.mean(xs), abs=1e-12)
        assert runs["preset"][f"{split}_after_se"] == pytest.approx(statistics.stdev(xs) / 3 ** 0.5, abs=1e-12)
    assert runs["older"]["test_after_mean"] is None and runs["older"]["heldout_after_se"] is None
    assert "| preset | 3 | 0.450 ± 0.029 | 0.353 ± 0.032 |" in out.stdout
