"""heldout.py - what a stage reports at its end: pass@1 before -> after RL on two evaluation sets (arXiv
2508.20722, section 5 reports average pass@1; here on the generator's held-out problems).

    evaluation_sets(cfg)  -> {"heldout": the validation set, "test": the test set}      (tasks.py's splits)
    rstar2_mini.heldout_accuracy, before RL and after the last step -> metrics.jsonl (heldout_*, test_*)
    heldout_report(...)   -> the run's last lines: each set's figure with its noise, test first

The validation set is the one the CPU preset's settings were chosen on; the test set, of its own seed and stream and
disjoint from everything else by canonical parameters, is looked at only to report (docs/design.md, "The test
split"). Both are fixed, so every run and every seed is scored on the same problems.
"""
from __future__ import annotations

import tasks
from config import Config


def evaluation_sets(cfg: Config) -> dict:
    """{"heldout": the validation set, "test": the test set} as the config sizes them (an empty one left out).
    The test split is disjoint from training, the scans, the SFT's chores and the validation set (tasks.py) and
    is looked at only to report: no setting of this project was chosen on it (docs/design.md)."""
    families = cfg.families or None
    sets = {"heldout": tasks.heldout_problems(cfg.eval_problems, levels=cfg.levels, families=families),
            "test": tasks.heldout_test_problems(cfg.eval_problems if cfg.test_problems < 0 else cfg.test_problems,
                                                levels=cfg.levels, families=families)}
    return {split: problems for split, problems in sets.items() if problems}


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word[:-1]}ies" if word.endswith("y") else f"{n} {word}s"


def heldout_report(stage: str, sets: dict, before: dict, after: dict, trained: set, samples: int,
                   temperature: float) -> list[str]:
    """The run's last lines: pass@1 before -> after RL on the test set, then on the validation set over all
    families, the families trained on and the others, and per family, each with its noise. sets: evaluation_sets;
    before/after: their heldout_accuracy rows (per-problem pass@1 in <split>_acc_by_problem); the change's noise
    is the paired standard error over problems (eval.mean_and_se of after_i - before_i), which leaves out how
    hard each problem is. A set the before-row lacks (a resumed run of an older version) is left out."""
    import eval as grader

    def line(split, label, keep, width=44):
        problems, b, a = sets[split], before[f"{split}_acc_by_problem"], after[f"{split}_acc_by_problem"]
        idx = [i for i, p in enumerate(problems) if keep(p)]
        if not idx:
            return None
        (mb, sb), (ma, sa) = grader.mean_and_se(b[i] for i in idx), grader.mean_and_se(a[i] for i in idx)
        md, sd = grader.mean_and_se(a[i] - b[i] for i in idx)
        pm = lambda se: "" if se is None else f" ± {se:.3f}"  # noqa: E731
        return f"  {label:<{width}} {mb:.3f}{pm(sb)} -> {ma:.3f}{pm(sa)}   change {md:+.3f}{pm(sd)}"

    shown = [split for split in ("test", "heldout") if split in sets and f"{split}_acc_by_problem" in before]
    rows = [f"[stage {stage}] pass@1 before -> after RL ({plural(samples, 'sample')} a problem at T = "
            f"{temperature}; ± one standard error over problems; a change's is paired):"]
    for split in shown:
        problems = sets[split]
        families = sorted({p.family for p in problems})
        other = [f for f in families if f not in trained]
        name = {"test": "test", "heldout": "validation"}[split]
        rows += [line(split, f"{name}: all {len(families)} families ({len(problems)} problems)", lambda p: True),
                 line(split, f"{name}: trained on ({plural(len(families) - len(other), 'family')})",
                      lambda p: p.family in trained),
                 line(split, f"{name}: the other {plural(len(other), 'family')}", lambda p: p.family not in trained)]
    if "heldout" in shown:
        families = sorted({p.family for p in sets["heldout"]})
        rows += [line("heldout", f"validation: {f}{' (trained on)' if f in trained else ''}",
                      lambda p, f=f: p.family == f) for f in families]
    rows.append("  (trained on: the families the difficulty scan found the SFT model right on, so their figures are "
                "conditional on that choice; the test split is never used to choose a setting)")
    return [r for r in rows if r is not None]
