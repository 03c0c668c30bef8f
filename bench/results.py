"""Tables and plots for RESULTS.md: the models compared (eval.py results) and the RL runs compared (metrics.jsonl).

    python bench/results.py \
        --eval base=runs/results/base/result.json --eval sft=runs/results/sft/result.json \
        --eval "RL RoC=runs/results/roc/result.json" --eval "RL no RoC=runs/results/noroc/result.json" \
        --run "RoC=runs/cpu-s0/stage1/metrics.jsonl" --run "no RoC=runs/cpu-s0-noroc/stage1/metrics.jsonl" \
        --out docs

Writes docs/results-models.png (accuracy, valid tool calls, tool errors in correct trajectories, response length
per model), docs/results-training.png (training curves of the runs, overlaid; their held-out curve only when no
eval result is given, so that every held-out number comes from one source) and docs/results-families.png
(held-out pass@1 per generator family for each model, from the eval results; without any, before and after each
run), and prints the markdown tables. `--wordings` also prints each run's held-out problems right before and after
RL by family and wording (the question with its numbers as N): which phrasings a run learned. Without eval
results, a table gives each run name's validation and test pass@1 after RL as mean ± standard error over seeds.
Several files may share a name (seeds): curves are drawn per file; tables give the mean and (min..max), the
model plot the mean as a bar and each seed as a dot, the family plot the mean.
The last line printed is one JSON object with every number (with eval results given, its "runs" part holds each
run's steps and wall time only: the held-out numbers are the eval results').
"""
import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODEL_METRICS = [("pass@1", "accuracy (pass@1)"), ("valid_tool_call_share", "valid tool call share"),
                 ("tool_error_rate_correct", "tool error rate, correct trajectories"),
                 ("response_len", "mean response length (tokens)")]
RUN_METRICS = [("reward", "training reward (all 2G rollouts)"),
               ("tool_error_rate_pos_all", "tool error rate, correct rollouts (all 2G)"),
               ("response_len", "response length (tokens)"),
               ("groups_dropped_frac", "groups dropped (all-equal reward)"),
               ("cells_trained", "generator cells trained on (scan)"),
               ("logprob_diff_mean", "engine vs trainer log-prob, mean abs diff (x 1e-6)"),
               ("heldout_acc", "held-out pass@1 (T = 0.6)")]
SCALE = {"logprob_diff_mean": 1e6}   # drawn in these units, so that no axis offset text runs into the title


def named_paths(items: list[str]) -> list[tuple[str, Path]]:
    out = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            raise SystemExit(f"error: expected NAME=PATH, got {item!r}")
        out.append((name, Path(path)))
    return out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}" if isinstance(x, float) and x < 10 else f"{x:.0f}"


def spread(values: list) -> str:
    """One value as is; several (seeds) as "mean (min..max)"."""
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return fmt(values[0] if values else None)
    return f"{fmt(statistics.mean(values))} ({fmt(min(values))}..{fmt(max(values))})"


def wording(question: str) -> str:
    """The template a generated question came from: its numbers written as N."""
    return re.sub(r"[0-9]+", "N", question)


def wording_counts(metrics_path: Path) -> dict[str, list]:
    """{"family | wording": [right before RL, right after, problems]} over a run's held-out set, rebuilt from the
    run's config.json as rstar2_mini.train_stage builds it (so the same problems in every seed). "Right" sums
    pass@1 over the problems: a count with one sample a problem."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import tasks

    cfg = json.loads((metrics_path.parent / "config.json").read_text())
    problems = tasks.heldout_problems(cfg["eval_problems"], seed=1234, levels=tuple(cfg["levels"]),
                                      families=cfg.get("families") or None)
    evaluated = [r["heldout_acc_by_problem"] for r in read_jsonl(metrics_path) if "heldout_acc_by_problem" in r]
    if len(evaluated) < 2 or len(evaluated[0]) != len(problems):
        raise SystemExit(f"error: {metrics_path} holds no held-out evaluation of its {len(problems)} problems "
                         f"before and after RL")
    counts: dict[str, list] = {}
    for p, before, after in zip(problems, evaluated[0], evaluated[-1]):
        c = counts.setdefault(f"{p.family} | {wording(p.question)}", [0.0, 0.0, 0])
        c[0], c[1], c[2] = c[0] + before, c[1] + after, c[2] + 1
    return counts


def print_wordings(by_name: dict[str, list[dict]]) -> None:
    """One row per wording of each family that some run got right before or after RL (its wordings never right
    included): before -> after / problems, per run."""
    columns = [(name, i) for name, seeds in by_name.items() for i in range(len(seeds))]
    solved = {k.split(" | ")[0] for seeds in by_name.values() for c in seeds for k, v in c.items() if v[0] or v[1]}
    keys = sorted({k for seeds in by_name.values() for c in seeds for k in c if k.split(" | ")[0] in solved})
    print("| family | wording | " + " | ".join(f"{n} ({i + 1})" if len(by_name[n]) > 1 else n
                                              for n, i in columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for key in keys:
        cells = []
        for name, i in columns:
            b, a, n = by_name[name][i].get(key, (0, 0, 0))
            cells.append(f"{b:g} -> {a:g} / {n}")
        print("| " + " | ".join(key.split(" | ", 1)) + " | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eval", action="append", default=[], help="NAME=result.json written by eval.py --out")
    ap.add_argument("--run", action="append", default=[], help="NAME=metrics.jsonl of an RL stage (repeat for seeds)")
    ap.add_argument("--wordings", action="store_true", help="also print each --run's held-out problems right "
                    "before and after RL, by family and wording")
    ap.add_argument("--out", default="docs")
    ap.add_argument("--prefix", default="results", help="plots are written as PREFIX-models.png, PREFIX-training.png")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"models": {}, "runs": {}}

    # ---- models: eval.py results; several under one name (seeds) give the mean and the spread (min..max)
    evals = [(name, json.loads(p.read_text())) for name, p in named_paths(args.eval)]
    by_name: dict[str, list[dict]] = {}
    for name, r in evals:
        by_name.setdefault(name, []).append(r)
    if evals:
        print("| model | seeds | " + " | ".join(title for _, title in MODEL_METRICS) + " |")
        print("|---|---|" + "---|" * len(MODEL_METRICS))
        for name, rs in by_name.items():
            cells = [spread([r.get(k) for r in rs]) for k, _ in MODEL_METRICS]
            print(f"| {name} | {len(rs)} | " + " | ".join(cells) + " |")
            report["models"][name] = {k: [r.get(k) for r in rs] for k, _ in MODEL_METRICS} | {
                "problems": rs[0].get("problems"), "samples": rs[0].get("samples_per_problem")}
        fig, axes = plt.subplots(1, len(MODEL_METRICS), figsize=(4 * len(MODEL_METRICS), 3.6))
        for ax, (key, title) in zip(axes, MODEL_METRICS):
            for i, rs in enumerate(by_name.values()):
                values = [r.get(key) or 0.0 for r in rs]
                mean = statistics.mean(values)
                ax.bar(i, mean, color=f"C{i}")
                if len(values) > 1:   # one dot per seed over the mean's bar
                    ax.plot([i] * len(values), values, "k.", ms=5)
                ax.text(i, max(values), fmt(mean), ha="center", va="bottom", fontsize=8)
            ax.set_xticks(range(len(by_name)), list(by_name), rotation=20, fontsize=8)
            ax.set_title(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(out / f"{args.prefix}-models.png", dpi=90)
        plt.close(fig)
        families = {name: [r.get("pass@1_by_family") for r in rs] for name, rs in by_name.items()}
        if any(d for ds in families.values() for d in ds):
            plot_families(families, out / f"{args.prefix}-families.png", report)

    # ---- runs: training curves, and the first-vs-last held-out numbers per run
    runs = named_paths(args.run)
    if runs:
        # with eval results given, held-out numbers come from them alone (a run may have evaluated another set)
        metrics = [(k, t) for k, t in RUN_METRICS if not (evals and k == "heldout_acc")]
        fig, axes = plt.subplots(2, (len(metrics) + 1) // 2, figsize=(4 * ((len(metrics) + 1) // 2), 6.4))
        axes = axes.flatten()
        names = list(dict.fromkeys(n for n, _ in runs))
        per_name: dict[str, list[dict]] = {n: [] for n in names}
        for name, path in runs:
            every = read_jsonl(path)
            rows = [r for r in every if r.get("step", 0) > 0]
            colour = f"C{names.index(name)}"
            for ax, (key, title) in zip(axes, metrics):
                pts = [(r["step"], r[key] * SCALE.get(key, 1)) for r in (every if key == "heldout_acc" else rows)
                       if r.get(key) is not None]
                if pts:
                    ax.plot(*zip(*pts), color=colour, marker="o", ms=3, alpha=0.8,
                            label=name if path == [p for n, p in runs if n == name][0] else None)
                ax.set_title(title, fontsize=9)
                ax.set_xlabel("RL step", fontsize=8)
                ax.grid(alpha=0.3)
            last = rows[-1] if rows else {}
            item = {"steps": last.get("step"), "wall_s": sum(r.get("step_time_s", 0) for r in rows)}
            if not evals:   # the run's own first and last evaluations: validation (heldout_*) and test (test_*)
                item |= {"heldout_before": every[0].get("heldout_acc"), "heldout_after": last.get("heldout_acc"),
                         "test_before": every[0].get("test_acc"), "test_after": last.get("test_acc"),
                         "families_before": every[0].get("heldout_acc_by_family"),
                         "families_after": last.get("heldout_acc_by_family")}
            per_name[name].append(item)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{args.prefix}-training.png", dpi=90)
        plt.close(fig)
        for name, items in per_name.items():
            report["runs"][name] = {"seeds": len(items), "runs": items}
            if not evals:   # the spread over seeds: mean ± stdev / sqrt(seeds)
                for split in ("heldout", "test"):
                    after = [i[f"{split}_after"] for i in items if i[f"{split}_after"] is not None]
                    report["runs"][name] |= {
                        f"{split}_after_mean": statistics.mean(after) if after else None,
                        f"{split}_after_stdev": statistics.stdev(after) if len(after) > 1 else None,
                        f"{split}_after_se": statistics.stdev(after) / len(after) ** 0.5 if len(after) > 1 else None}
        if not evals:
            print("| runs | seeds | validation pass@1 after RL | test pass@1 after RL |\n|---|---|---|---|")
            for name, r in report["runs"].items():
                cells = [fmt(r[f"{s}_after_mean"]) + (f" ± {r[f'{s}_after_se']:.3f}" if r[f"{s}_after_se"] else "")
                         for s in ("heldout", "test")]
                print(f"| {name} | {r['seeds']} | {cells[0]} | {cells[1]} |")
            print("(± one standard error over seeds: the seeds' standard deviation / sqrt(seeds))\n")
        if not evals:   # without eval results: each run's first and last held-out evaluation
            first = next(iter(per_name.values()))
            families = {"before RL": [i["families_before"] for i in first]}
            families.update({name: [i["families_after"] for i in items] for name, items in per_name.items()})
            plot_families(families, out / f"{args.prefix}-families.png", report)
        if args.wordings:
            report["wordings"] = {}
            for name, path in runs:
                report["wordings"].setdefault(name, []).append(wording_counts(path))
            print_wordings(report["wordings"])
    print(json.dumps(report))


def plot_families(by_name: dict[str, list[dict | None]], path: Path, report: dict) -> None:
    """Held-out pass@1 per generator family, one bar per name, averaged over its seeds (its list of
    {family: pass@1} dicts). Prints the markdown table; skipped when no result has per-family numbers."""
    def mean_by_family(dicts):
        dicts = [d for d in dicts if d]
        return {f: statistics.mean(d[f] for d in dicts if f in d) for f in sorted({f for d in dicts for f in d})}

    bars = {name: mean_by_family(dicts) for name, dicts in by_name.items()}
    families = sorted({f for v in bars.values() for f in v})
    if not families:
        return
    print("\n| held-out pass@1 | " + " | ".join(families) + " |\n|---|" + "---|" * len(families))
    for name, v in bars.items():
        print(f"| {name} | " + " | ".join(fmt(v.get(f)) for f in families) + " |")
    report["families"] = bars
    fig, ax = plt.subplots(figsize=(max(6, 2 + 0.35 * len(families) * len(bars)), 3.6))
    width = 0.8 / len(bars)
    for k, (name, v) in enumerate(bars.items()):
        ax.bar([i + k * width for i in range(len(families))], [v.get(f, 0.0) for f in families], width, label=name,
               color=f"C{k}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(families))], families, rotation=30, fontsize=8)
    ax.set_ylabel("held-out pass@1")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
