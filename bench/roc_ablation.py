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

--jobs N runs N of a chunk's runs at once, each on cores/N torch threads (OMP_NUM_THREADS, unless set), its output
in RUN/ablation.log; the next chunk starts when all of this one's have ended. On 2 AVX2 cores, two stage-1 runs at
once on one thread each took 225-329 s a step each (a step every 113-165 s for the pair), where one run on both
cores took 128-199 s a step (RESULTS.md, "Two more steps did not help"): about as fast or faster, and the arms of a
seed finish together.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
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
    ap.add_argument("--jobs", type=int, default=1, help="runs of a chunk at once, each on cores/jobs threads")
    args = ap.parse_args()
    if args.jobs < 1:
        ap.error(f"--jobs must be at least 1 (got {args.jobs})")
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
    env = dict(os.environ)
    if args.jobs > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.jobs)))

    def advance(arm: str, seed: int, run: Path, target: int) -> bool:
        """One chunk of one run: continue it from its latest checkpoint to `target` steps. True if it succeeded."""
        cmd = [sys.executable, str(ROOT / "rstar2_mini.py"), "--stage", "1", "--out", str(run), "--seed",
               str(seed), "--steps", str(target), "--resume", "--set", f"roc_mode={arm}", "--set", "scan_every=0"]
        for kv in args.set:
            cmd += ["--set", kv]
        print("+ " + " ".join(cmd), flush=True)
        if args.jobs == 1:
            return subprocess.run(cmd, env=env).returncode == 0
        with open(run / "ablation.log", "a") as log:   # runs at once: one log each, not one interleaved terminal
            ok = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode == 0
        print(f"{run.name}: {'at' if ok else 'stopped before'} step {target} (its output: {run / 'ablation.log'})",
              flush=True)
        return ok

    for target in targets:
        todo = [(arm, seed, run, target) for (arm, seed), run in runs.items() if steps_done(run) < target]
        if args.jobs == 1:   # one at a time: stop at the first run that fails
            ok = []
            for job in todo:
                ok.append(advance(*job))
                if not ok[-1]:
                    break
        else:
            with ThreadPoolExecutor(args.jobs) as pool:   # the chunk ends when all its runs have ended
                ok = list(pool.map(lambda job: advance(*job), todo))
        for (_, _, run, _), good in zip(todo, ok):
            if not good:
                print(f"error: {run} stopped with an error (see above or its ablation.log); the same command "
                      f"continues from its last checkpoint", file=sys.stderr)
        if not all(ok):
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
