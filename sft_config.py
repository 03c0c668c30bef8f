"""sft_config.py - every hyperparameter of the non-reasoning SFT cold start (arXiv 2508.20722, section 4.1).

One dataclass, with the paper's value where the paper gives one. It has a module of its own so that both sides of
the SFT read it without importing each other: sft_data.py (the data mix: direct_share, verify_share, fix_share,
name_share, math_share; each a probability in [0, 1], checked on construction) and sft.py (the optimization,
held-out early stopping, checkpoints). `python sft.py --help` lists the command-line flags made from it;
rstar2_mini.py fills it from the recipe's `sft_*` settings.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SFTConfig:
    n_examples: int = 240            # generated examples (paper: 165K function-call + 30K instruction + 27K chat)
    direct_share: float = 0.05       # share answered without the tool (instruction following / answer format);
                                     # 0.1 gave more answers without a call on the math problems (README)
    verify_share: float = 0.15       # tool examples that run a second, different program to check the first
    fix_share: float = 0.1           # tool examples whose first program fails (real traceback), then is fixed
    name_share: float = 0.7          # programs whose last line prints a nested expression are rewritten to
                                     # `result = expr` + `print(result)` (a 135M model miscounts closing
                                     # parentheses: "unmatched ')'" was its most common error, README)
    math_share: float | None = None  # None: the preset's mix (chores_math.CHORES, a quarter everyday-math chores);
                                     # a share: tool examples drawn from chores_math.MATH_CHORES (three more kinds)
                                     # with this probability, else from EVERYDAY_CHORES (0.5: docs/design.md)
    extra_chores: str = ""           # chores_math.EXTRA_CHORES added twice each to the preset's mix, comma-
                                     # separated ("dotted_sum": sums written a^2 + ... + b^2; docs/design.md)
    data_jsonl: str | None = None    # extra chat examples {"messages": [...]} (real function-calling sets on GPU)
    epochs: int = 1                  # paper: 3 (over 222K examples); one pass over a small varied set here
    lr: float = 2e-4                 # paper: 5e-6 for a 14B model; a 135M model needs a larger step
                                     # (bench/measure_sft.py at T=1: 5e-5 gave 6% valid tool calls, 2e-4 26%)
    min_lr_ratio: float = 0.1        # cosine decay to lr * min_lr_ratio (paper: not stated)
    warmup_steps: int = 3            # linear warm-up, optimizer steps
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0           # global gradient-norm clip
    batch_size: int = 8              # examples per optimizer step (paper: not stated)
    micro_batch_tokens: int = 1024   # rows x longest forwarded row per forward/backward (padded; with the
                                     # prompt run once, the rows' part after it); gradients
                                     # accumulate up to batch_size. Peak memory follows it; with the prompt run
                                     # once per batch, smaller micro-batches cost little (bench_sft_step.py)
    logprob_chunk_tokens: int = 256  # tokens whose 49K-wide logits exist at once (models.chunked_logprobs; <= 0:
                                     # all of a micro-batch's at once)
    activation_checkpointing: bool = False  # keep one hidden state per decoder layer and token, run each layer
                                     # again in backward (models.layers_checkpointed; the paper preset: on)
    max_steps: int | None = None     # cap on optimizer steps (None: epochs decide)
    max_tokens: int = 1024           # longer examples are dropped (paper: not stated for SFT)
    heldout_examples: int = 16       # generated with another seed; early stopping watches their loss
    eval_every: int = 8              # optimizer steps between held-out evaluations
    patience: int = 2                # stop after this many evaluations without improvement ...
    min_delta: float = 0.01          # ... of at least this much (relative), so the data is never memorised
    share_prefix: bool = True        # run the common system prompt once per batch (exact, much faster)
    bf16: bool | None = None         # bf16 autocast over fp32 master weights; None: on a GPU and on CPUs with
                                     # bf16 matrix units (AVX512-BF16 / AMX: 1.7-1.9x faster steps, README)
    save_every: int = 0              # optimizer steps between checkpoints a killed run continues from (run_dir);
                                     # 0: an eighth of the planned steps (at most 8 saves a run: each writes the
                                     # weights and the AdamW state, 1.5 GB for the 135M model)
    seed: int = 0

    def __post_init__(self):
        # A share is the probability of one branch of a draw (`rng.random() < share`): outside [0, 1] every
        # draw would silently take the same branch.
        for name in ("direct_share", "verify_share", "fix_share", "name_share", "math_share"):
            share = getattr(self, name)
            if share is not None and not 0.0 <= share <= 1.0:
                raise ValueError(f"{name}={share}: a share is a probability, between 0 and 1")
        if self.extra_chores:   # an unknown chore name: one clear line now, not a KeyError while drafting
            from chores_math import chore_mix
            chore_mix(self.extra_chores)
            if self.math_share is not None:
                raise ValueError("extra_chores adds to the preset's mix, which math_share replaces: set one of them")
