"""The policy update of one RL step (rl_update.policy_update) against an earlier commit's, in one run: the CPU
preset's update on a batch shaped like its steps, the same weights, the same batch, arms alternating.

Today's update takes pi_old of the first mini-batch from that mini-batch's own forward (the weights are pi_old's
until its optimizer step): one forward pass fewer over half the kept rows at the preset's two mini-batches, over
all of them at the paper's one. The baseline (default: the commit before that change) runs a no-grad pass over
every row first. Both must end at the same weights, bitwise.

The batch: `--rows` trajectories of the real system prompt and a real question, then model turns and tool
responses of the lengths a stage-1 step of the main command keeps (about 141 model and 78 tool tokens a
trajectory, 24 trajectories: metrics.jsonl's model_tokens_kept and inserted_tokens_kept); token values are
random (the time does not depend on them). The first update of each arm is a warm-up.

    python bench/bench_update.py                                  # the bundled model, 3 timed updates an arm
    python bench/bench_update.py --model runs/rstar2/sft/model --minibatches 1 --updates 4

The last line printed is one JSON object: seconds per update of each arm, the speed-up, and whether the weights
ended equal.
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import git_baseline  # noqa: E402
import model as models  # noqa: E402
import rl_update  # noqa: E402
import rstar2_mini as R  # noqa: E402
import scheduler  # noqa: E402
import tasks  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model", default=models.DEFAULT_MODEL, help="a model directory (default: the bundled model)")
p.add_argument("--baseline", default="946aa0e", help="the commit whose rl_update.py is the baseline")
p.add_argument("--rows", type=int, default=24, help="kept trajectories in the batch")
p.add_argument("--model-tokens", type=int, default=141, help="mean model tokens a trajectory")
p.add_argument("--tool-tokens", type=int, default=78, help="mean tool-response tokens a trajectory")
p.add_argument("--minibatches", type=int, default=None, help="default: the CPU preset's")
p.add_argument("--updates", type=int, default=3, help="timed updates an arm (after one warm-up)")
args = p.parse_args()

import torch  # noqa: E402


def shaped_batch(tokenizer, rng: random.Random) -> list:
    """Kept (trajectory, advantage) pairs: the system prompt and a question, then one or two model turns with a
    tool response between, lengths around the means asked for."""
    questions = [q.question for q in tasks.heldout_problems(8, levels=(1,))]
    kept = []
    for i in range(args.rows):
        prompt = scheduler.render_prompt(tokenizer, questions[i % len(questions)])
        model_n = max(8, int(rng.gauss(args.model_tokens, args.model_tokens / 3)))
        tool_n = max(4, int(rng.gauss(args.tool_tokens, args.tool_tokens / 3)))
        words = lambda k: [rng.randrange(100, 20000) for _ in range(k)]  # noqa: E731
        segments = [scheduler.Segment(words(model_n // 2), 1), scheduler.Segment(words(tool_n), 0),
                    scheduler.Segment(words(model_n - model_n // 2), 1)]
        kept.append((scheduler.Trajectory(f"q{i // 4}", prompt, segments), rng.choice([-1.0, -0.5, 0.5, 1.0])))
    return kept


def main() -> None:
    path = models.resolve_model(args.model)
    tokenizer = models.load_tokenizer(path)
    cfg = R.parse_args(["--stage", "1"] + ([] if args.minibatches is None else
                                           ["--set", f"minibatches={args.minibatches}"]))   # the main command's
    kept = shaped_batch(tokenizer, random.Random(0))
    baseline = git_baseline.module_at(args.baseline, "rl_update.py", "rl_update_baseline")
    model = models.load_model(path, dtype=torch.float32)
    arms = {}
    for name, module in (("baseline", baseline), ("today", rl_update)):
        m = copy.deepcopy(model)
        optimizer, schedule = R.make_optimizer(m, cfg)
        arms[name] = (module, R.Runtime(m, tokenizer, engines=[], pool=None, loop=None), optimizer, schedule, [])
    print(f"{args.rows} trajectories, {sum(len(t.input_ids) for t, _ in kept)} tokens "
          f"({sum(t.num_model_tokens for t, _ in kept)} model tokens), minibatches={cfg.minibatches}, "
          f"bf16 units: {models.bf16_is_fast('cpu')}, threads: {torch.get_num_threads()}", flush=True)
    for k in range(args.updates + 1):
        for name in (("baseline", "today") if k % 2 == 0 else ("today", "baseline")):
            module, rt, optimizer, schedule, times = arms[name]
            started = time.perf_counter()
            module.policy_update(rt, cfg, optimizer, schedule, kept, random.Random(k))
            if k:
                times.append(time.perf_counter() - started)
                print(f"update {k} {name}: {times[-1]:.2f} s", flush=True)
    base, today = (sum(arms[n][4]) / len(arms[n][4]) for n in ("baseline", "today"))
    equal = all(torch.equal(a, b) for a, b in zip(arms["baseline"][1].model.parameters(),
                                                   arms["today"][1].model.parameters()))
    print(json.dumps({"baseline": args.baseline, "minibatches": cfg.minibatches, "rows": args.rows,
                      "baseline_s": round(base, 2), "today_s": round(today, 2), "speedup": round(base / today, 3),
                      "weights_equal": equal, "bf16_units": models.bf16_is_fast("cpu")}))


if __name__ == "__main__":
    main()
