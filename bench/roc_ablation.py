"""The RoC ablation (arXiv 2508.20722, section 2.2.3 and Figure 9): stage 1 with GRPO-RoC against "GRPO with tool"
(roc_mode=none), from the same SFT checkpoint, on the same problems and budget, for several seeds.

    python bench/roc_ablation.py --sft runs/rstar2/sft --steps 30 --chunk 10 --seeds 0,1 --out runs/ablation \
        [--set families=digit_sum,range_sum ...]

Each arm and seed is one run directory, OUT/{roc,none}-s{seed}, into which the SFT directory is copied. The runs
advance in chunks, alternating the arms: `rstar2_mini.py --stage 1 --resume --steps K` for K = chunk, 2 chunk, ...,
steps. Both arms therefore have the same number of steps whenever the ablation is stopped, and the same command
continues it. Each chunk ends with a held-out evaluation (a point on the held-out curve). Both arms scan the
families once, at step 0, as the CPU preset does (`scan_every=0`, passed explicitly; a later `--set scan_every=K`
overrides it): the two arms of a seed start from the same model with the same seed, so their scans draw the same
problems (their rollouts can still differ by a few: seed 1 in RESULTS.md saw products 2/8 in one arm and 1/8 in
the other) and chose the same cells in every run measured.
At the end, bench/results.py draws both arms' curves (OUT/ablation-*.png): tool errors in correct rollouts, response
length, reward, held-out pass@1 per family; and OUT/ablation-figure9.png shows the paper's Figure 9 quantities for
each arm (the mean over seeds at every step and its trailing 5-step mean), with a table of their means over blocks
of `--chunk` steps and the paired difference RoC - no RoC over every (seed, step) both arms ran. `--report` draws
all this from the runs as they are, without advancing them. The last line printed is one JSON object with each run's
last step and the Figure 9 numbers.

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
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from checkpoints import latest_checkpoint  # noqa: E402
ARMS = {"roc": "RoC", "none": "no RoC"}   # roc_mode -> the name in the plots
FIGURE9 = {"tool_error_rate_pos_all": "tool error rate in correct rollouts (all 2G)",   # the paper's Figure 9
           "response_len": "response length (tokens)"}


def steps_done(run: Path) -> int:
    """The step of the run's latest checkpoint (0 when it has none)."""
    ckpt = latest_checkpoint(run / "stage1")
    return int(ckpt.name.split("_")[-1]) if ckpt is not None else 0


def read_metrics(run: Path) -> list[dict]:
    """The run's stage-1 metrics.jsonl: the step-0 held-out line, then one line per RL step."""
    return [json.loads(x) for x in (run / "stage1" / "metrics.jsonl").read_text().splitlines()]


def step_values(rows: list[dict], key: str) -> dict[int, float]:
    """step -> a run's `key` at that RL step, for the steps that have one (none: no correct rollout that step)."""
    return {r["step"]: r[key] for r in rows if r.get("step", 0) > 0 and r.get(key) is not None}


def arm_curve(per_seed: list[dict[int, float]]) -> dict[int, float]:
    """step -> the mean over the arm's seeds that have that step."""
    steps = sorted({t for values in per_seed for t in values})
    return {t: statistics.mean(v[t] for v in per_seed if t in v) for t in steps}


def trailing_mean(ys: list[float], window: int) -> list[float]:
    """m_i = mean(y_{i-window+1} .. y_i): the curve with its step-to-step noise averaged out."""
    return [statistics.mean(ys[max(0, i - window + 1):i + 1]) for i in range(len(ys))]


def block_means(curve: dict[int, float], block: int) -> dict[str, float]:
    """The curve's means over steps 1..block, block+1..2 block, ..., each labelled by the steps it has ("11-20")."""
    groups: dict[int, list[int]] = {}
    for t in curve:
        groups.setdefault((t - 1) // block, []).append(t)
    return {(f"{g[0]}-{g[-1]}" if len(g) > 1 else f"{g[0]}"): statistics.mean(curve[t] for t in g)
            for g in groups.values()}


def figure9(runs: dict[tuple[str, int], Path], out: Path, block: int = 10, window: int = 5) -> dict:
    """The paper's Figure 9 for this ablation: per quantity, each arm's curve (the mean over seeds at each step) and
    its means over blocks of `block` steps, and the paired difference

        d_{s,t} = x_RoC(seed s, step t) - x_noRoC(seed s, step t),   mean d ± stdev(d) / sqrt(n)

    over the n (seed, step) pairs both arms have: the same seed and step means the same problems drawn. Steps follow
    one another, so the pairs are not independent and that standard error is a lower bound. Draws
    OUT/ablation-figure9.png and prints the table."""
    seeds = sorted({seed for _, seed in runs})
    metrics = {arm_seed: read_metrics(run) for arm_seed, run in runs.items()}
    report = {}
    fig, axes = plt.subplots(1, len(FIGURE9), figsize=(5 * len(FIGURE9), 3.6))
    print(f"\n| quantity | arm | means over blocks of {block} steps | all steps |\n|---|---|---|---|")
    for ax, (key, title) in zip(axes, FIGURE9.items()):
        values = {arm_seed: step_values(rows, key) for arm_seed, rows in metrics.items()}
        d = [values[("roc", s)][t] - values[("none", s)][t] for s in seeds
             for t in sorted(values[("roc", s)]) if t in values[("none", s)]]
        report[key] = {"difference": statistics.mean(d) if d else None, "pairs": len(d),
                       "difference_se": statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else None}
        for k, (arm, name) in enumerate(ARMS.items()):
            curve = arm_curve([values[(arm, s)] for s in seeds])
            steps, blocks = list(curve), block_means(curve, block)
            report[key][arm] = {"curve": curve, "blocks": blocks,
                                "all": statistics.mean(curve.values()) if curve else None}
            print(f"| {title} | {name} | " + ", ".join(f"{b}: {v:.3g}" for b, v in blocks.items())
                  + f" | {report[key][arm]['all'] or 0:.3g} |")
            ax.plot(steps, [curve[t] for t in steps], color=f"C{k}", alpha=0.3, lw=1)
            ax.plot(steps, trailing_mean([curve[t] for t in steps], window), color=f"C{k}", lw=2,
                    label=f"{name} ({len(seeds)} seed{'s' * (len(seeds) > 1)}; bold: {window}-step mean)")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("RL step", fontsize=8)
        ax.grid(alpha=0.3)
        if report[key]["pairs"] > 1:
            print(f"| {title} | RoC - no RoC | {report[key]['difference']:+.3g} ± {report[key]['difference_se']:.2g} "
                  f"over {report[key]['pairs']} (seed, step) pairs | |")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "ablation-figure9.png", dpi=90)
    plt.close(fig)
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sft", help="an SFT stage directory (holds model/), e.g. runs/rstar2/sft")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--chunk", type=int, default=10, help="steps each arm runs before the other arm's turn")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--out", default="runs/ablation")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE passed to rstar2_mini.py (both arms)")
    ap.add_argument("--jobs", type=int, default=1, help="runs of a chunk at once, each on cores/jobs threads")
    ap.add_argument("--report", action="store_true",
                    help="only draw the plots and print the tables of the runs in --out as they are")
    args = ap.parse_args()
    if args.jobs < 1:
        ap.error(f"--jobs must be at least 1 (got {args.jobs})")
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = {(arm, seed): Path(args.out) / f"{arm}-s{seed}" for seed in seeds for arm in ARMS}
    if args.report:
        missing = [str(run) for run in runs.values() if not (run / "stage1" / "metrics.jsonl").exists()]
        if missing:
            print(f"error: no stage-1 metrics in {', '.join(missing)}: nothing to report", file=sys.stderr)
            return 2
    else:
        sft = Path(args.sft or "")
        if not args.sft or not (sft / "model" / "config.json").exists():
            print(f"error: --sft {args.sft or '(not given)'} holds no SFT model (expected DIR/model/config.json); run "
                  f"`python rstar2_mini.py --stage sft --out DIR` first and pass --sft DIR/sft", file=sys.stderr)
            return 2
        for run in runs.values():
            if not (run / "sft" / "model" / "config.json").exists():
                shutil.copytree(sft, run / "sft", dirs_exist_ok=True)
        if not run_chunks(args, runs):
            return 1
    plots = [sys.executable, str(ROOT / "bench" / "results.py"), "--out", str(args.out), "--prefix", "ablation"]
    for (arm, seed), run in runs.items():
        plots += ["--run", f"{ARMS[arm]}={run / 'stage1' / 'metrics.jsonl'}"]
    subprocess.run(plots, check=True)
    last = {f"{arm}-s{seed}": read_metrics(run)[-1] for (arm, seed), run in runs.items()}
    print(json.dumps(last | {"figure9": figure9(runs, Path(args.out), block=args.chunk)}))
    return 0


def run_chunks(args, runs: dict[tuple[str, int], Path]) -> bool:
    """Advance every run to chunk, 2 chunk, ..., steps, a chunk at a time (the arms stay level). False if one failed."""
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
            return False
    return True


if __name__ == "__main__":
    sys.exit(main())
