"""run_files.py - what an RL or SFT stage leaves in its run directory, and the refusal to mix two runs in one.

    rstar2_mini.py --out runs/rstar2 --stage 1
      -> prepare_run_dir: runs/rstar2/stage1/config.json (or a UsageError: the folder holds another run)
      -> every step: a metrics.jsonl line (rstar2_mini.log_step, with peak_memory_gb), write_samples ->
         samples/step_XXXX.md, and at each checkpoint plot_curves -> curves.png (checkpoints.py writes the rest)

Nothing here knows about models or rollouts: plain files, atomic where a kill could leave half of one.
"""
from __future__ import annotations

import dataclasses
import json
import os
import resource
from pathlib import Path

from config import Config, UsageError
from distributed import DIST


def log(msg: str) -> None:
    """One line of the run's story on stdout; under torchrun, rank 0 speaks for all."""
    if DIST.rank == 0:
        print(msg, flush=True)




# ----------------------------------------------------------------------------------------------------------
# The run directory and its config; peak memory


def peak_memory_gb() -> float:
    """Peak resident memory of this process since the last reset_peak_memory() (Linux VmHWM; ru_maxrss elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB -> GB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def reset_peak_memory() -> None:
    """Start a new peak (so an RL stage does not report the SFT stage's peak): Linux clear_refs value 5."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def stage_dir(cfg: Config, stage: str) -> Path:
    return Path(cfg.out) / ("sft" if stage == "sft" else f"stage{stage}")


def comparable(cfg_dict: dict) -> dict:
    """The config fields that define a run (resuming with other values would mix two runs)."""
    ignore = {"steps", "resume", "out", "save_every", "samples_per_step", "sandbox_isolation", "engine_trace"}
    return {k: v for k, v in cfg_dict.items() if k not in ignore}


def saved_setting(saved: dict, key: str):
    """A setting from a run's config.json; one the run predates (a Config field added since) held its default."""
    if key in saved:
        return saved[key]
    field = Config.__dataclass_fields__.get(key)
    return field.default if field is not None and field.default is not dataclasses.MISSING else None


def prepare_run_dir(cfg: Config, stage: str) -> Path:
    """Create the stage directory, or refuse one that holds another run (nothing already written is lost)."""
    d = stage_dir(cfg, stage)
    saved = d / "config.json"
    mine = dataclasses.asdict(cfg) | {"stage": stage}
    started = (d / "metrics.jsonl").exists() or (d / "checkpoints").exists()  # a config alone: nothing ran yet
    if saved.exists() and started:
        try:
            theirs = json.loads(saved.read_text())
        except json.JSONDecodeError as e:
            raise UsageError(f"{saved} is not valid JSON ({e}); move {d} away or pick another --out")
        if not cfg.resume:
            raise UsageError(f"{d} already holds a run; pass --resume to continue it or --out NEW_DIR to start "
                             f"another")
        diff = {k: (saved_setting(theirs, k), v) for k, v in comparable(mine).items()
                if json.dumps(saved_setting(theirs, k)) != json.dumps(v)}
        if diff:
            shown = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(diff.items()))
            raise UsageError(f"{d} holds another run ({shown}); resume with its settings or use another --out")
    d.mkdir(parents=True, exist_ok=True)
    write_json_atomic(saved, mine)
    return d


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------------
# Curves: one PNG a person can look at instead of reading metrics.jsonl


def first_row(path: Path) -> dict:
    """The first JSON line of `path` (metrics.jsonl's step 0: the held-out evaluation before RL), or {}."""
    if not path.exists():
        return {}
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    return json.loads(rows[0]) if rows else {}


def keep_lines_up_to(path: Path, step: int) -> None:
    """Drop the JSON lines of `path` whose "step" is past `step` (-1: all of them, for a fresh stage)."""
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    path.write_text("".join(r + "\n" for r in rows if json.loads(r).get("step", 0) <= step))


def plot_curves(metrics_path: Path, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step" in r]
    if not rows:
        return
    panels = [("reward", "reward (all rollouts)"), ("heldout_acc", "held-out accuracy"),
              ("tool_error_rate", "tool error rate"), ("tool_calls_per_traj", "tool calls / trajectory"),
              ("response_len", "response length (tokens)"), ("loss", "loss"),
              ("clip_frac", "clip fraction"), ("groups_dropped_frac", "groups dropped (fraction)"),
              ("step_time_s", "step time (s)"), ("reward_kept", "reward (kept after RoC)"),
              ("tool_error_rate_pos_kept", "tool error rate, kept correct"),
              ("tool_error_rate_pos_all", "tool error rate, all correct"),
              ("logprob_diff_mean", "|engine - trainer| log-prob"),
              ("cells_trained", "generator cells trained on (scan)")]
    fig, axes = plt.subplots(3, 5, figsize=(20, 9))
    for ax, (key, title) in zip(axes.flat, panels):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", ms=3)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    # the training rollouts' rate right per generator cell, at the steps that drew it (select_step_batch)
    ax, by_cell = axes.flat[len(panels)], {}
    for r in rows:
        for name, (right, n) in (r.get("rollouts_by_cell") or {}).items():
            by_cell.setdefault(name, []).append((r["step"], right / n))
    for name, pts in sorted(by_cell.items()):
        ax.plot(*zip(*pts), marker="o", ms=2, lw=1, label=name)
    ax.set_title("reward by cell (rollouts drawn)", fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.grid(alpha=0.3)
    if by_cell:
        ax.legend(fontsize=6, ncol=2)
    for ax in axes.flat[len(panels) + 1:]:
        ax.set_axis_off()
    fig.suptitle(f"{metrics_path.parent}", fontsize=10)
    # fixed margins: tight_layout measures every tick label (a plot took 2.2-2.9 s with it, 1.3-1.5 s without)
    fig.subplots_adjust(left=0.04, right=0.99, bottom=0.06, top=0.92, wspace=0.25, hspace=0.45)
    tmp = out_png.with_name(out_png.stem + ".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, out_png)


# ----------------------------------------------------------------------------------------------------------
# Samples: a few trajectories a step, readable


def write_samples(run_dir: Path, step: int, kept, tokenizer, k: int) -> None:
    """A few trajectories per step as readable markdown: what the model wrote, what the tool answered."""
    if k <= 0 or not kept:
        return
    d = run_dir / "samples"
    d.mkdir(exist_ok=True)
    lines = [f"# step {step}\n"]
    for traj, adv in kept[:k]:
        lines.append(f"## {traj.problem_id}  reward={traj.reward:.0f}  advantage={adv:+.2f}  "
                     f"turns={traj.turns}  tool calls={traj.tool_calls} (errors {traj.tool_errors})  "
                     f"finish={traj.finish_reason}\n")
        lines.append("```text\n" + tokenizer.decode(traj.input_ids) + "\n```\n")
    (d / f"step_{step:04d}.md").write_text("\n".join(lines))
