"""bench/roc_ablation.py's schedule: the arms advance in alternating chunks, each run is continued from its own last
checkpoint, and a stopped ablation resumes where it stopped. rstar2_mini.py is replaced by a fake that writes the
checkpoint pointer and metrics lines a real stage-1 run writes (the real runs are hours long; the trainer's own
resume is tested in test_trainer.py)."""
import importlib.util
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_ablation():
    spec = importlib.util.spec_from_file_location("roc_ablation", ROOT / "bench" / "roc_ablation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def option(cmd, name):
    """The value after the last `name` in a command line (argparse: the last one wins)."""
    return [cmd[i + 1] for i, x in enumerate(cmd) if x == name][-1]


def sets(cmd):
    return [cmd[i + 1] for i, x in enumerate(cmd) if x == "--set"]


class FakeRuns:
    """Stands in for subprocess.run: a stage-1 command advances its run to --steps (a checkpoint per call, a metrics
    line per step); the plotting command does nothing. fail_at: the call number (1-based) that exits with 1."""

    def __init__(self, fail_at=None):
        self.calls, self.envs, self.outputs, self.fail_at = [], [], [], fail_at

    def __call__(self, cmd, check=False, env=None, stdout=None, stderr=None):
        if cmd[1].endswith("results.py"):
            return subprocess.CompletedProcess(cmd, 0)
        self.calls.append(cmd)
        self.envs.append(env)
        self.outputs.append(getattr(stdout, "name", None))
        if len(self.calls) == self.fail_at:
            return subprocess.CompletedProcess(cmd, 1)
        run, target = Path(option(cmd, "--out")) / "stage1", int(option(cmd, "--steps"))
        ckpts = run / "checkpoints"
        done = int((ckpts / "latest").read_text().split("_")[-1]) if (ckpts / "latest").exists() else 0
        assert (run.parent / "sft" / "model" / "config.json").exists(), "the SFT is copied in before the first chunk"
        run.mkdir(parents=True, exist_ok=True)
        with open(run / "metrics.jsonl", "a") as f:
            for step in range(done + 1, target + 1):
                f.write(json.dumps({"step": step}) + "\n")
        (ckpts / f"step_{target:06d}").mkdir(parents=True)
        (ckpts / f"step_{target:06d}" / "trainer_state.pt").write_bytes(b"")
        (ckpts / "latest").write_text(f"step_{target:06d}")
        return subprocess.CompletedProcess(cmd, 0)


def run_ablation(module, monkeypatch, tmp_path, fake, *extra):
    sft = tmp_path / "sft"
    (sft / "model").mkdir(parents=True, exist_ok=True)
    (sft / "model" / "config.json").write_text("{}")
    monkeypatch.setattr(module.subprocess, "run", fake)
    monkeypatch.setattr(sys, "argv", ["roc_ablation.py", "--sft", str(sft), "--out", str(tmp_path / "abl"),
                                      "--steps", "5", "--chunk", "2", "--seeds", "0,1", *extra])
    return module.main()


def schedule(calls):
    return [(Path(option(c, "--out")).name, int(option(c, "--steps"))) for c in calls]


def test_arms_alternate_in_chunks_and_a_user_setting_wins(monkeypatch, tmp_path, capsys):
    module, fake = load_ablation(), FakeRuns()
    assert run_ablation(module, monkeypatch, tmp_path, fake, "--set", "scan_every=3") == 0
    # Chunks of 2 up to 5 steps: every run reaches 2, then 4, then 5, the arms of a seed next to each other.
    runs = ["roc-s0", "none-s0", "roc-s1", "none-s1"]
    assert schedule(fake.calls) == [(r, k) for k in (2, 4, 5) for r in runs]
    for cmd in fake.calls:
        arm, seed = Path(option(cmd, "--out")).name.split("-s")
        assert option(cmd, "--seed") == seed and "--resume" in cmd
        # Both arms scan once at step 0 unless the user says otherwise: the user's --set comes last and wins.
        assert sets(cmd) == [f"roc_mode={arm}", "scan_every=0", "scan_every=3"]
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    figure9 = last.pop("figure9")
    assert sorted(last) == sorted(runs) and all(v["step"] == 5 for v in last.values())
    assert figure9["response_len"]["pairs"] == 0       # the fake's metrics lines carry no Figure 9 numbers


def test_a_stopped_ablation_resumes_where_it_stopped(monkeypatch, tmp_path, capsys):
    module = load_ablation()
    first = FakeRuns(fail_at=7)      # the second chunk of roc-s1 fails
    assert run_ablation(module, monkeypatch, tmp_path, first) == 1
    assert "the same command continues from its last checkpoint" in capsys.readouterr().err
    assert schedule(first.calls)[-1] == ("roc-s1", 4)
    again = FakeRuns()
    assert run_ablation(module, monkeypatch, tmp_path, again) == 0
    # The runs already at 4 steps are not run again for that chunk; the failed one is.
    assert schedule(again.calls) == [("roc-s1", 4), ("none-s1", 4),
                                     ("roc-s0", 5), ("none-s0", 5), ("roc-s1", 5), ("none-s1", 5)]
    for run in ("roc-s0", "none-s0", "roc-s1", "none-s1"):
        steps = [json.loads(x)["step"] for x in (tmp_path / "abl" / run / "stage1" / "metrics.jsonl").open()]
        assert steps == [1, 2, 3, 4, 5], run       # each step once: no chunk ran twice


class TogetherRuns(FakeRuns):
    """FakeRuns whose calls must run two at a time: each waits at a barrier for a second call in flight (a run
    started alone times out there). It records which chunk every call belongs to when it starts and ends."""

    def __init__(self):
        super().__init__()
        self.barrier, self.events, self.lock = threading.Barrier(2, timeout=20), [], threading.Lock()

    def __call__(self, cmd, check=False, env=None, stdout=None, stderr=None):
        if cmd[1].endswith("results.py"):
            return subprocess.CompletedProcess(cmd, 0)
        with self.lock:
            self.events.append(("start", int(option(cmd, "--steps"))))
        self.barrier.wait()
        with self.lock:
            done = super().__call__(cmd, check, env, stdout, stderr)
            self.events.append(("end", int(option(cmd, "--steps"))))
        return done


def test_jobs_run_a_chunks_runs_together_on_a_share_of_the_cores(monkeypatch, tmp_path, capsys):
    module, fake = load_ablation(), TogetherRuns()
    monkeypatch.setattr(module.os, "cpu_count", lambda: 4)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert run_ablation(module, monkeypatch, tmp_path, fake, "--jobs", "2") == 0
    # Every run reaches every chunk's target once, as with one job.
    runs = ["roc-s0", "none-s0", "roc-s1", "none-s1"]
    assert sorted(schedule(fake.calls)) == sorted((r, k) for k in (2, 4, 5) for r in runs)
    # A chunk's runs all end before the next chunk starts: the arms stay at equal steps.
    for i, (what, target) in enumerate(fake.events):
        if what == "start":
            assert all(t >= target for w, t in fake.events[i:] if w == "end"), fake.events
    # Two runs at a time on 4 cores: 2 torch threads each; each run's output goes to its own log file.
    assert all(env["OMP_NUM_THREADS"] == "2" for env in fake.envs)
    assert sorted(set(fake.outputs)) == sorted(str(tmp_path / "abl" / r / "ablation.log") for r in runs)


def test_missing_sft_is_a_clear_error(monkeypatch, tmp_path, capsys):
    module = load_ablation()
    monkeypatch.setattr(sys, "argv", ["roc_ablation.py", "--sft", str(tmp_path / "nothing"), "--out", str(tmp_path)])
    assert module.main() == 2
    assert "holds no SFT model" in capsys.readouterr().err


def write_metrics(run: Path, rows: list[dict]) -> None:
    """A stage-1 metrics.jsonl as a run writes it: the step-0 line (held-out only), then one line per step."""
    (run / "stage1").mkdir(parents=True, exist_ok=True)
    lines = [{"step": 0, "heldout_acc": 0.1}] + [{"step": i + 1, **r} for i, r in enumerate(rows)]
    (run / "stage1" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_figure9_numbers_are_the_paired_differences_written_out(tmp_path):
    module = load_ablation()
    err = {("roc", 0): [0.1, 0.0, None, 0.2], ("none", 0): [0.3, 0.1, 0.2, 0.2],
           ("roc", 1): [0.0, 0.1, 0.1, 0.0], ("none", 1): [0.2, 0.1, 0.3]}          # none-s1 ran 3 steps only
    length = {k: [200 + 10 * i + (5 if k[0] == "roc" else 0) for i in range(len(v))] for k, v in err.items()}
    runs = {}
    for (arm, seed), values in err.items():
        runs[(arm, seed)] = tmp_path / f"{arm}-s{seed}"
        write_metrics(runs[(arm, seed)], [{"tool_error_rate_pos_all": e, "response_len": n}
                                          for e, n in zip(values, length[(arm, seed)])])
    got = module.figure9(runs, tmp_path / "plots", block=2)
    # The pairs (seed, step) where both arms have a value, RoC minus no RoC, by hand:
    # seed 0: steps 1, 2, 4 (RoC's step 3 has no correct rollout): -0.2, -0.1, 0.0; seed 1: steps 1-3: -0.2, 0, -0.2
    d = [-0.2, -0.1, 0.0, -0.2, 0.0, -0.2]
    mean = sum(d) / 6
    se = (sum((x - mean) ** 2 for x in d) / 5) ** 0.5 / 6 ** 0.5
    tool = got["tool_error_rate_pos_all"]
    assert tool["pairs"] == 6
    assert tool["difference"] == pytest.approx(mean) and tool["difference_se"] == pytest.approx(se)
    # Each arm's curve is the mean over the seeds that have the step; blocks of 2 steps average that curve.
    assert tool["roc"]["curve"] == pytest.approx({1: 0.05, 2: 0.05, 3: 0.1, 4: 0.1})
    assert tool["none"]["curve"] == pytest.approx({1: 0.25, 2: 0.1, 3: 0.25, 4: 0.2})
    assert tool["roc"]["blocks"] == pytest.approx({"1-2": 0.05, "3-4": 0.1})
    assert got["response_len"]["difference"] == pytest.approx(5.0) and got["response_len"]["pairs"] == 7
    assert (tmp_path / "plots" / "ablation-figure9.png").stat().st_size > 0


def test_report_draws_the_runs_as_they_are_without_advancing_them(monkeypatch, tmp_path, capsys):
    module, fake = load_ablation(), FakeRuns()
    for arm in ("roc", "none"):
        for seed in (0, 1):
            write_metrics(tmp_path / "abl" / f"{arm}-s{seed}", [{"tool_error_rate_pos_all": 0.1, "response_len": 200}])
    assert run_ablation(module, monkeypatch, tmp_path, fake, "--report") == 0
    assert fake.calls == []                                   # no stage-1 run was started
    assert (tmp_path / "abl" / "ablation-figure9.png").exists()
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["roc-s0"]["step"] == 1 and last["figure9"]["tool_error_rate_pos_all"]["pairs"] == 2


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
