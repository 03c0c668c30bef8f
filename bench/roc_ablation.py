"""The RoC ablation (arXiv 2508.20722, section 2.2.3 and Figure 9): stage 1 with GRPO-RoC against "GRPO with tool"
(roc_mode=none), from the same SFT checkpoint, on the same problems and budget, for several seeds.

    python bench/roc_ablation.py --sft runs/rstar2/sft --steps 30 --chunk 10 --seeds 0,1 --out runs/ablation \
        [--set families=digit_sum,range_sum ...]

Each arm and seed is one run directory, OUT/{roc,none}-s{seed}, into which the SFT directory is copied. The runs
advance in chunks, alternating the arms: `rstar2_mini.py --stage 1 --resume --steps K` for K = chunk, 2 chunk, ...,
steps. Both arms therefore have the same number of steps whenever the ablation is stopped, and the same command
continues it. Each chunk ends with a held-out evaluation (a point on the held-out curve). Both arms scan the
families once, at step 0 (`scan_every=0`; a later `--set scan_every=K` overrides it): the two arms of a seed start
from the same model with the same seed, so their scans are identical and they train on the same cells, and the
CPU preset's rescans every 3 steps would cost a step's time each (10 scans in 30 steps). At the end,
bench/results.py draws both arms' curves: tool errors in correct rollouts, response length, reward, held-out
pass@1 per family. The last line printed is one JSON object with each run's last step.
"""
import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from checkpoints import latest_checkpoint  # noqa: E402
ARMS = {"roc": "RoC", "none": "no RoC"}   # roc_mode -> the name in the plots


def steps_done(run: Path) -> int:
    """The step of the run's latest checkpoint (0 when it has none)."""
    ckpt = latest_checkpoint(run / "stage1")
    return int(ckpt.name.split("_")[-1]) if ckpt is not None else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sft", required=True, help="an SFT stage directory (holds model/), e.g. runs/rstar2/sft")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--chunk", type=int, default=10, help="steps each arm runs before the other arm's turn")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--out", default="runs/ablation")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE passed to rstar2_mini.py (both arms)")
    args = ap.parse_args()
    sft = Path(args.sft)
    if not (sft / "model" / "config.json").exists():
        print(f"error: {sft} holds no SFT model (expected {sft / 'model' / 'config.json'}); run "
              f"`python rstar2_mini.py --stage sft --out DIR` first", file=sys.stderr)
        return 2
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = {(arm, seed): Path(args.out) / f"{arm}-s{seed}" for seed in seeds for arm in ARMS}
    for run in runs.values():
        if not (run / "sft" / "model" / "config.json").exists():
            shutil.copytree(sft, run / "sft", dirs_exist_ok=True)
    targets = list(range(args.chunk, args.steps, args.chunk)) + [args.steps]
    for target in targets:
        for (arm, seed), run in runs.items():
            if steps_done(run) >= target:
                continue
            cmd = [sys.executable, str(ROOT / "rstar2_mini.py"), "--stage", "1", "--out", str(run), "--seed",
                   str(seed), "--steps", str(target), "--resume", "--set", f"roc_mode={arm}", "--set", "scan_every=0"]
            for kv in args.set:
                cmd += ["--set", kv]
            print("+ " + " ".join(cmd), flush=True)
            if subprocess.run(cmd).returncode != 0:
                print(f"error: {run} stopped with an error (see above); the same command continues from its last "
                      f"checkpoint", file=sys.stderr)
                return 1
    plots = [sys.executable, str(ROOT / "bench" / "results.py"), "--out", str(args.out), "--prefix", "ablation"]
    for (arm, seed), run in runs.items():
        plots += ["--run", f"{ARMS[arm]}={run / 'stage1' / 'metrics.jsonl'}"]
    subprocess.run(plots, check=True)
    last = {f"{arm}-s{seed}": [json.loads(x) for x in (run / "stage1" / "metrics.jsonl").read_text().splitlines()][-1]
            for (arm, seed), run in runs.items()}
    print(json.dumps(last))
    return 0


if __name__ == "__main__":
    sys.exit(main())
