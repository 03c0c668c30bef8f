"""bench/results.py's held-out table by wording: counts over the problems a run evaluated, rebuilt from its config."""
import json
import re
import subprocess
import sys
from pathlib import Path

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
