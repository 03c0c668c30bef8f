"""Benchmark one RL step end to end (rollouts + update, the CPU preset's shape), today's code against a baseline
revision, in one run.

Each arm is the real command, `rstar2_mini.py --stage 1 --steps N`, run from its own tree (the baseline is
exported from git into a temporary folder) on the same SFT model, seed and problems: 8 problems x 8 rollouts
with the sandbox, RoC, the update of the kept trajectories, the weight sync. The arms alternate (baseline,
current, baseline, current, ...) so a disturbance of the machine hits both. Read from each run's metrics.jsonl:
rollout time, step time, generated tokens per second, update tokens per second, peak memory, the engine-vs-
trainer log-prob mismatch.

    python bench/bench_rl_step.py --model runs/rstar2/sft/model            # an SFT checkpoint (tool calls)
    python bench/bench_rl_step.py --model M --baseline 11474cd --rounds 2 --steps 1 --set engine_batch=32

The rollouts of the two arms are not token-identical in bf16 (the engines' arithmetic differs in its last bits);
the step's shape is: same problems, same lengths budget. The last line printed is one JSON object; with it the
decode shape's fp32 and bf16 matmul rates on this CPU, timed before the arms run, each arm's rollout-phase share of
the rate of the dtype its engine runs in (bench/roofline.py; precision=auto: bf16 where the CPU has bf16 units),
and, where the arm records its occupancy (rollout_rows_mean, ...: the current engine), the rollout phase's share
of its floor: iterations x the per-iteration floor at the mean rows and columns, plus the prefilled tokens (prompts
past the shared prefix, tool responses) at the cold GEMM rate, over the phase's time (roofline.phase_floor_s, at
the cold GEMM rate and STREAM bandwidth; a current arm that does not record prefilled tokens counts none); the
update's share of its floor:
6 x parameters FLOPs a token the update forwards (forward and backward) at the cold GEMM rate of 1024 rows (the
trainer's micro-batch shape) / the update's time. The tokens forwarded are the kept trajectories' tokens with
the shared system prompt counted once a mini-batch, as rl_update.policy_update runs it, not once a trajectory
(the pi_old forward of the later mini-batches, a third of their cost, is not counted: the floor is a low one).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "050bc57"   # the engine before slot KV (issue 54): padded batch, whole-KV re-index at every exit

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--model", required=True, help="an SFT checkpoint directory (the bundled base model makes "
                                                    "almost no tool calls, so its steps are not the recipe's)")
parser.add_argument("--baseline", default=BASELINE, help="git revision of the baseline arm")
parser.add_argument("--rounds", type=int, default=1, help="runs of each arm (alternating)")
parser.add_argument("--steps", type=int, default=1, help="RL steps per run")
parser.add_argument("--set", action="append", default=[], help="Config overrides for both arms")
parser.add_argument("--set-current", action="append", default=[], help="Config overrides for the current arm")
args = parser.parse_args()
model = Path(args.model).resolve()
if not (model / "config.json").exists():
    sys.exit(f"error: {model} is not a model directory (no config.json)")


sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import model as models  # noqa: E402
import roofline  # noqa: E402

import torch  # noqa: E402

policy = models.load_model(model)
engine_batch = int(next((s.split("=", 1)[1] for s in args.set if s.startswith("engine_batch=")), 64))
rates = roofline.decode_rates(policy, engine_batch)   # GFLOPS of the decode shape on this CPU, fp32 and bf16
engine_dtype = torch.bfloat16 if models.bf16_is_fast("cpu") else torch.float32
engine_rate = rates[str(engine_dtype).removeprefix("torch.")]
engine_model = policy.to(engine_dtype)
cold_rate = roofline.cold_gemm_gflops(engine_model, engine_batch, engine_dtype,   # as the engine runs them
                                      prepack=__import__("slot_engine").prepack_measures_faster(engine_dtype))
update_rate = roofline.cold_gemm_gflops(engine_model, 1024, engine_dtype)
bandwidth = roofline.stream_gbs()
prefix = len(__import__("engines").shared_prompt_prefix(models.load_tokenizer(model)))


def export(rev: str, dest: Path) -> Path:
    """The tracked files of `rev`, extracted into dest (git archive: nothing of the working tree)."""
    archive = dest / "tree.tar"
    try:
        subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), rev], check=True,
                       capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        sys.exit(f"error: git archive {rev}: {e.stderr.strip()}")
    tree = dest / f"tree-{rev}"
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    return tree


def run_arm(tree: Path, out: Path, extra: list[str]) -> list[dict]:
    """One run of stage 1 from `tree`, on the SFT model (linked in as the run's SFT checkpoint)."""
    (out / "sft").mkdir(parents=True)
    os.symlink(model, out / "sft" / "model")
    cmd = [sys.executable, str(tree / "rstar2_mini.py"), "--stage", "1", "--out", str(out), "--steps",
           str(args.steps), "--set", "eval_problems=0", "--set", "save_every=1000"]
    for item in args.set + extra:
        cmd += ["--set", item]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True,
                          env={**os.environ, "RSTAR2_DATA_DIR": os.environ.get("RSTAR2_DATA_DIR", str(ROOT / "data"))})
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "stage1" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step_time_s" in r]
    cfg = json.loads((out / "stage1" / "config.json").read_text())
    for r in rows:
        r["wall_s"] = round(time.perf_counter() - started, 1)
        # the system prompt runs once a mini-batch, not once a kept trajectory (floor_shares)
        repeats = max(r["groups_kept"] * cfg["group_size"] - cfg["minibatches"], 0)
        r["update_tokens"] = r["train_tokens"] - repeats * prefix
    return rows


KEYS = ("rollout_time_s", "step_time_s", "gen_tokens_per_s", "train_tokens_per_s", "peak_mem_gb",
        "logprob_diff_mean", "logprob_diff_max", "response_len", "rollout_iterations", "rollout_rows_mean",
        "rollout_columns_mean", "rollout_read_mean", "rollout_ms_per_iteration", "rollout_prefill_tokens",
        "rollout_prefill_s", "rollout_copied_tokens", "rollout_threads_mean", "train_tokens", "update_tokens",
        "problems_resampled")


def floor_shares(row: dict) -> dict:
    """The rollout phase's and the update's share of their floors (module docstring), for one step."""
    out = {}
    if row.get("rollout_iterations"):
        floor = roofline.phase_floor_s(engine_model, row["rollout_iterations"], row["rollout_rows_mean"],
                                       row["rollout_columns_mean"], prefix, row.get("rollout_prefill_tokens", 0),
                                       cold_rate, bandwidth, torch.finfo(engine_dtype).bits // 8)
        out["rollout_share_of_floor"] = round(floor["floor_s"] / row["rollout_time_s"], 3)
        out["rollout_decode_floor_s"] = round(floor["decode_floor_s"], 2)
        out["rollout_prefill_floor_s"] = round(floor["prefill_floor_s"], 2)
    update_s = row["step_time_s"] - row["rollout_time_s"]
    if row.get("update_tokens") and update_s > 0:
        out["update_share_of_floor"] = round(row["update_tokens"] * roofline.flops_per_token(engine_model) * 3
                                             / (update_rate * 1e9) / update_s, 3)
    return out

SHARES = ("rollout_share_of_floor", "rollout_decode_floor_s", "rollout_prefill_floor_s", "update_share_of_floor")

with tempfile.TemporaryDirectory(prefix="bench_rl_step-") as tmp:
    tmp = Path(tmp)
    trees = {"baseline": export(args.baseline, tmp), "current": ROOT}
    results = {"baseline": [], "current": []}
    for r in range(args.rounds):
        for arm in ("baseline", "current"):
            rows = run_arm(trees[arm], tmp / f"{arm}-{r}", args.set_current if arm == "current" else [])
            results[arm] += rows
            for row in rows:
                row.update(floor_shares(row))
                print(json.dumps({"arm": arm, "round": r, **{k: row.get(k) for k in KEYS + SHARES}}), flush=True)
            shutil.rmtree(tmp / f"{arm}-{r}")


def mean(arm: str, key: str):
    values = [row[key] for row in results[arm] if row.get(key) is not None]
    return float(f"{statistics.mean(values):.4g}") if values else None


summary = {f"{arm}_{k}": mean(arm, k) for arm in ("baseline", "current") for k in KEYS + SHARES}
summary |= {"step_speedup": round(summary["baseline_step_time_s"] / summary["current_step_time_s"], 3),
            "rollout_speedup": round(summary["baseline_rollout_time_s"] / summary["current_rollout_time_s"], 3),
            "update_speedup": round((summary["baseline_step_time_s"] - summary["baseline_rollout_time_s"])
                                    / (summary["current_step_time_s"] - summary["current_rollout_time_s"]), 3)
            if summary["current_step_time_s"] > summary["current_rollout_time_s"] else None,   # no update ran
            "gen_tokens_per_s_ratio": round(summary["current_gen_tokens_per_s"]
                                            / summary["baseline_gen_tokens_per_s"], 3),
            "host": models.cpu_kind(), "decode_matmul_gflops": rates, "cold_gemm_gflops": round(cold_rate, 1),
            "update_gemm_gflops": round(update_rate, 1), "stream_gbs": round(bandwidth, 1),
            **{f"{arm}_rollout_share_of_rate": round(roofline.share_of_rate(summary[f"{arm}_gen_tokens_per_s"], policy,
                                                                            engine_rate), 3)
               for arm in ("baseline", "current") if summary[f"{arm}_gen_tokens_per_s"]},
            "baseline": args.baseline, "model": str(model), "steps": args.steps, "rounds": args.rounds,
            "overrides": args.set, "current_overrides": args.set_current}
print(json.dumps(summary))
