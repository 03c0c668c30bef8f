"""curriculum.py - each stage's data by difficulty (arXiv 2508.20722, section 4.3: stages move to harder data as
the policy learns; stage 3 keeps the problems the latest policy does not solve 8/8).

The CPU preset trains on the built-in generator (tasks.py), whose problems come in cells (family, level). A stage
scans the cells, trains on those the policy has been right on, and deals each step's problems over them:

    difficulty_scan(sample, cfg, step)   -> {(family, level): (right, rollouts)}    fresh train problems per cell
    choose_cells(...)                    -> the cells found right (+ scan.jsonl)    rstar2_mini.train_stage, step 0
    deal_cells(cells, rates, n, rng)     -> n cells for one step's draw             cell_sampling = learnability
    update_cell_rates(rates, counts)     -> each cell's decayed recent rate
    hard_subset(sample, cfg, problem_at) -> stage 3's problems: not solved hard_samples / hard_samples

`sample(problems, n, use, step, round)` is the loop's rollouts (rstar2_mini.sampler): n graded trajectories per
problem, from the random stream of that use ("scan", "hard"), step and round. The scans choose families; that is
this project's departure from the paper at laptop scale (docs/design.md, "Where the CPU preset departs").

Three rules, each measured (docs/design.md, "Each stage's problems"):
  * a cell with no right answer after one pass is scanned again (scan_rounds): a family solved 1 time in 8 at
    T = 1 is missed by one pass of 8 rollouts 34% of the time ((7/8)^8), by two passes 12%;
  * a cell found right stays in the stage's mix, even when the scan found it always right: a family the SFT
    model solves is not left out while training on the others erases it; when it starts to fail, its groups
    turn mixed and the update restores it (all-equal groups cost rollouts, no update);
  * rescans (every scan_every steps) look only at the cells not yet found, for families the policy has
    learned to solve sometimes.
"""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Callable

import tasks
from config import Config
from run_files import log

Sample = Callable[..., list]    # (problems, n, use, step, round) -> [[Trajectory] * n per problem], graded


def cell_name(cell) -> str:
    """A (family, level) cell as logs and checkpoints name it: "gcd_lcm/L1"."""
    return f"{cell[0]}/L{cell[1]}"


def stage_cells(cfg: Config) -> list:
    """Every (family, level) cell of the stage: families x levels."""
    return [(family, level) for family in (cfg.families or tasks.FAMILIES) for level in cfg.levels]


def difficulty_scan(sample: Sample, cfg: Config, step: int, cells=None) -> dict:
    """{(family, level): (right, rollouts)} for `cells` (default: all of the stage's): scan_problems fresh train
    problems per cell x scan_samples rollouts each, at the training temperature (the sampler the stage's groups
    will come from); the cells with no right answer yet get another pass of new problems, scan_rounds passes in
    all."""
    counts = {cell: (0, 0) for cell in (cells if cells is not None else stage_cells(cfg))}
    todo, rounds = list(counts), max(1, cfg.scan_rounds)
    for pass_ in range(rounds):
        if not todo:
            break
        first = (step * rounds + pass_) * cfg.scan_problems  # every pass sees new problems
        problems = [tasks.problem_at(first + i, seed=cfg.seed + 4099, split="train", cells=[cell])
                    for cell in todo for i in range(cfg.scan_problems)]
        groups = sample(problems, cfg.scan_samples, "scan", step, pass_)
        for k, cell in enumerate(todo):
            rewards = [t.reward > 0 for group in groups[k * cfg.scan_problems:(k + 1) * cfg.scan_problems]
                       for t in group]
            right, n = counts[cell]
            counts[cell] = (right + sum(rewards), n + len(rewards))
        todo = [cell for cell in todo if counts[cell][0] == 0]
    return counts


def choose_cells(sample: Sample, cfg: Config, stage: str, step: int, run_dir: Path, found: list) -> tuple[list, dict]:
    """A difficulty scan of the cells not in `found` (those right at an earlier scan of the stage), one log line
    and a line of run_dir/scan.jsonl. Returns `found` and the newly right cells, in the stage's cell order, and
    the scan's counts {"family/Llevel": [right, rollouts]}."""
    every = stage_cells(cfg)
    t0 = time.time()
    counts = difficulty_scan(sample, cfg, step, [c for c in every if c not in found])
    seconds = time.time() - t0
    new = [c for c, (right, _) in counts.items() if right > 0]
    found = [c for c in every if c in found or c in new]
    name = {c: cell_name(c) for c in every}
    rate = {c: f"{right}/{n}" for c, (right, n) in counts.items()}
    log(f"[stage {stage}] difficulty scan at step {step} ({len(counts)} cells, {cfg.scan_problems} x "
        f"{cfg.scan_samples} per pass, {seconds:.0f} s): "
        + (f"right in {', '.join(f'{name[c]} {rate[c]}' for c in new)}" if new else "no new cell is ever right")
        + (f"; training on {', '.join(name[c] for c in found)}" if found else
           "; training on every cell (none has been right: dynamic sampling drops the all-wrong groups)"))
    with (run_dir / "scan.jsonl").open("a") as f:
        f.write(json.dumps({"step": step, "rates": {name[c]: right / n for c, (right, n) in counts.items()},
                            "rollouts": {name[c]: n for c, (_, n) in counts.items()},
                            "cells": [name[c] for c in (found or every)],
                            "scan_time_s": round(seconds, 1)}) + "\n")
    return found, {name[c]: [right, n] for c, (right, n) in counts.items()}


# Which found cell each drawn problem comes from (cfg.cell_sampling). "turn": dealt in turn (load_problem_source).
# "learnability": in proportion to the chance that a problem of the cell gives a group the update can use, so a
# step's rollouts go where they teach: a solved family's groups are all right and dropped, a family right 1 time
# in 16 is mixed in 40% of its groups, one right half the time in 96%. Sampling by success rate in this spirit
# is the learnability curriculum of Foster et al. (2025, arXiv 2502.12272), whose weight is p (1 - p); here it is
# the dynamic-sampling rule itself: a group of 2G rollouts trains when, after RoC keeps G, it still holds a right
# and a wrong answer. p is the cell's recent rate: the scan's counts, then each step's, the older ones weighted
# by CELL_RATE_DECAY a step. A cell not drawn for a while drifts back towards p = 1/2 and is looked at again, and
# CELL_FLOOR keeps solved cells in the mix (a family the policy starts to forget turns mixed and is drawn more).

CELL_RATE_DECAY = 0.5   # a step's counts weigh half the next step's: the rate follows a policy that learns
CELL_FLOOR = 0.05       # weight every found cell keeps whatever its rate (a cell right half the time: ~1)


def informative_chance(p: float, n: int, keep: int, mode: str = "roc") -> float:
    """P(a group of n rollouts, each right with probability p, is mixed after 2G -> G): the chance the step's
    dynamic sampling keeps it. With k right of n (binomial):
      roc / topk: the counts grpo_roc.roc_kept_counts keeps (the wrong ones floor((n - k) G / n), the right ones
                  the rest): mixed iff both are >= 1 (2G -> G: k >= 1 right and >= 2 wrong)
      none:       a uniform G-subset: mixed unless all G drawn are right or all wrong,
                  1 - C(k, G) / C(n, G) - C(n - k, G) / C(n, G)"""
    import grpo_roc

    total = 0.0
    for k in range(n + 1):
        if mode == "none":
            mixed = 1 - (math.comb(k, keep) + math.comb(n - k, keep)) / math.comb(n, keep)
        else:
            mixed = float(min(grpo_roc.roc_kept_counts(k, n - k, keep)) >= 1)
        total += math.comb(n, k) * p ** k * (1 - p) ** (n - k) * mixed
    return total


def deal_cells(cells: list, rates: dict, n: int, rng: random.Random, cfg: Config) -> list:
    """n cells for one step's draw, in the cells' order: weights w_c = informative_chance(p_c) + CELL_FLOOR with
    p_c = (right + 1/2) / (rollouts + 1) (smoothed: a cell with no counts has p = 1/2), drawn by systematic
    sampling: one uniform offset u, draw j takes the cell whose stretch of the cumulative shares holds (u + j) / n.
    Each cell comes n s_c times on average (s_c its share), and floor(n s_c) or ceil(n s_c) times in every deal."""
    weights = []
    for cell in cells:
        right, rollouts = rates.get(cell_name(cell), (0.0, 0.0))
        p = (right + 0.5) / (rollouts + 1)
        weights.append(informative_chance(p, cfg.group_size * cfg.oversample, cfg.group_size, cfg.roc_mode)
                       + CELL_FLOOR)
    total, u = sum(weights), rng.random()
    deal, edge, c = [], 0.0, 0
    for j in range(n):
        point = (u + j) / n * total
        while c < len(cells) - 1 and edge + weights[c] <= point:
            edge += weights[c]
            c += 1
        deal.append(cells[c])
    return deal


def update_cell_rates(rates: dict, step_counts: dict) -> dict:
    """Every cell's [right, rollouts] times CELL_RATE_DECAY, plus this step's counts (select_step_batch's
    rollouts_by_cell): right_c <- d right_c + r_c, rollouts_c <- d rollouts_c + n_c."""
    out = {name: [CELL_RATE_DECAY * right, CELL_RATE_DECAY * n] for name, (right, n) in rates.items()}
    for name, (right, n) in step_counts.items():
        old = out.get(name, [0.0, 0.0])
        out[name] = [old[0] + right, old[1] + n]
    return out


# ----------------------------------------------------------------------------------------------------------
# Stage 3's data: the problems the latest policy does not solve in all of 8 rollouts


def hard_subset(sample: Sample, cfg: Config, problem_at) -> list[int]:
    """Indices (into problem_at) of the scanned problems that the policy does not solve in all hard_samples tries."""
    candidates = [problem_at(i) for i in range(cfg.hard_scan)]
    groups = sample(candidates, cfg.hard_samples, "hard", 0, 0)
    hard = [i for i, g in enumerate(groups) if sum(t.reward for t in g) < cfg.hard_samples]
    log(f"[stage 3] hard subset: {len(hard)} of {len(candidates)} problems are not solved {cfg.hard_samples}/"
        f"{cfg.hard_samples} by the latest policy")
    return hard
