"""Replay a real rollout phase's decode iterations through the CPU engine's decoder alone: what the loop around
the engine costs, and where the phase's time goes.

A run with `--set engine_trace=1` writes every decode iteration of each step's rollout phase to
engine_trace.jsonl (engines.TransformersEngine.trace: busy rows, own columns its decode attention read, tokens
forwarded and of them prefilled, rows admitted as copies, milliseconds). This script runs the same iterations
again through slot_engine.SlotDecoder.forward and engines.sample_rows, with nothing else on the machine: no
sandbox, no event loop, no grading beside it. Each iteration keeps its shape: its decoding rows at the columns it
read, its prefilled tokens split over the rows it admitted (all of them from column 0: a continuation's kept KV
is not rebuilt), random token ids (the cost does not depend on them). Then

  * real / replay: the loop's cost over the decoder alone at the same shapes (the tool calls' processes, the
    event loop's Python and the grader share the two cores with the decode thread);
  * a least-squares split of the replay's milliseconds per iteration,
        ms = fixed + per_row x rows + per_row_kcolumn x rows x columns read / 1000 + per_prefilled x tokens,
    into the phase's seconds of each term: the fixed cost (the weights read once an iteration, Python), the
    rows' GEMMs and sampling, decode attention over their columns, and the prefills.

    python rstar2_mini.py --stage 1 --steps 2 --out runs/trace --set engine_trace=1 ...   # a run that traces
    python bench/bench_replay.py --model runs/rstar2/sft/model --trace runs/trace/stage1/engine_trace.jsonl

--against OTHER: another run's trace of the same steps (say, the same command at an earlier revision), replayed
beside this one, the two alternating every 25 iterations, so that a slow spell of the host hits both: the decoder's
seconds for each run's iterations of each step, and their ratio (what a change to the engine's admission or the
loop's shapes saved, with the cost of the iterations themselves held equal).

The model must be the run's policy at those steps (its SFT checkpoint for the first steps: the weights only set
the cost through their shapes, so a later checkpoint of the same run times the same). The last line printed is
one JSON object.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TERMS = ("fixed", "rows", "attention", "prefill")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="the run's model directory (its SFT checkpoint)")
    parser.add_argument("--trace", required=True, help="a run's engine_trace.jsonl (--set engine_trace=1)")
    parser.add_argument("--against", default=None, help="another run's engine_trace.jsonl, replayed alternating")
    args = parser.parse_args()
    if not os.path.exists(os.path.join(args.model, "config.json")):
        sys.exit(f"error: {args.model} is not a model directory (no config.json)")
    for path in (args.trace, args.against):
        if path is not None and not os.path.exists(path):
            sys.exit(f"error: no trace at {path}: run the command with --set engine_trace=1")
    return args


def read_trace(path: str) -> list[dict]:
    steps = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                step = json.loads(line)
                step["iterations"][0]["ms"]
            except (ValueError, KeyError, IndexError, TypeError):
                sys.exit(f"error: {path}, line {n}: not a step of engine_trace.jsonl")
            steps.append(step)
    return steps


def iteration_shape(it: dict):
    """(each row's first column, [(tokens, has_prefix)] of each row) of one traced iteration, as
    SlotDecoder.forward takes them: decoding rows at the columns read, prefilled tokens split evenly over the
    rows admitted with a prefill (copies forward nothing)."""
    decoding = it["tokens"] - it["prefill"]
    admitted = it["rows"] - decoding - it.get("copies", 0)
    per = [it["prefill"] // admitted + (i < it["prefill"] % admitted) for i in range(admitted)] if admitted else []
    starts = [max(it["read"], 1) - 1] * decoding + [0] * admitted
    rows = [(1, True)] * decoding + [(n, True) for n in per]
    return starts, rows


def replay_step(decoder, prefix, P: int, its: list[dict]) -> list[float]:
    """Milliseconds of each traced iteration through the decoder alone (and the sampler over its busy rows)."""
    import torch

    import engines

    gens = [torch.Generator().manual_seed(i) for i in range(decoder.slots)]
    out = []
    for it in its:
        starts, rows = iteration_shape(it)
        width = max(it["read"], 1)
        if decoder.cache is None or decoder.cache.columns < width or (decoder.dtype == torch.bfloat16
                                                                       and decoder.cache.columns != width):
            decoder.cache = None   # bf16 reads every column of the buffer: a buffer as wide as the iteration read
            decoder.cache = decoder.new_cache(width)
        decoder.cache.lens[:len(rows)] = starts
        positions = [P + c for start, (n, _) in zip(starts, rows) for c in range(start, start + n)]
        started = time.perf_counter()
        logits = decoder.forward(list(range(100, 100 + len(positions))), positions, rows, prefix)
        logits = torch.cat([logits, logits[-1:].expand(it["rows"] - len(rows), -1)]) if it["rows"] > len(rows) \
            else logits
        engines.sample_rows(logits, [0.8] * it["rows"], [1.0] * it["rows"], gens[:it["rows"]])
        out.append(1000 * (time.perf_counter() - started))
    return out


def alternating(decoder, prefix, P: int, a: list[dict], b: list[dict], chunk: int = 25) -> tuple[float, float]:
    """Seconds of the decoder on iterations a and on iterations b, replayed 25 at a time in turn."""
    sums = [0.0, 0.0]
    for k in range(0, max(len(a), len(b)), chunk):
        for arm, its in enumerate((a, b)):
            if its[k:k + chunk]:
                sums[arm] += sum(replay_step(decoder, prefix, P, its[k:k + chunk])) / 1000
    return sums[0], sums[1]


def time_split(its: list[dict], ms: list[float]) -> dict:
    """Least squares of ms over [1, rows, rows x read / 1000, prefill]: each term's coefficient and its seconds
    summed over the iterations."""
    import torch

    X = torch.tensor([[1.0, it["rows"], it["rows"] * it["read"] / 1000, it["prefill"]] for it in its],
                     dtype=torch.float64)
    coef = torch.linalg.lstsq(X, torch.tensor(ms, dtype=torch.float64)[:, None]).solution[:, 0]
    seconds = (X.sum(0) * coef / 1000).tolist()
    return {"ms_fixed": round(float(coef[0]), 2), "ms_per_row": round(float(coef[1]), 3),
            "ms_per_row_kcolumn": round(float(coef[2]), 3), "ms_per_prefilled_token": round(float(coef[3]), 3),
            **{f"{term}_s": round(s, 1) for term, s in zip(TERMS, seconds)}}


def main():
    args = parse_args()
    import torch

    import engines
    import model as models
    from slot_engine import SlotDecoder

    steps = read_trace(args.trace)
    others = {step["step"]: step for step in read_trace(args.against)} if args.against else {}
    dtype = models.engine_dtype(None)
    model = models.load_model(args.model, dtype=dtype)
    prefix_ids = engines.shared_prompt_prefix(models.load_tokenizer(args.model))
    slots = max(it["rows"] for step in steps + list(others.values()) for it in step["iterations"])
    decoder = SlotDecoder(model, slots, "cpu")
    report = {"host": models.cpu_kind(), "threads": torch.get_num_threads(),
              "dtype": str(dtype).removeprefix("torch."), "trace": args.trace, "steps": []}
    all_its, all_ms = [], []
    with torch.inference_mode():
        decoder.refresh()
        prefix = decoder.prefix_kv(prefix_ids)
        for step in steps:
            its = step["iterations"]
            ms = replay_step(decoder, prefix, len(prefix_ids), its)
            real = sum(it["ms"] for it in its) / 1000
            row = {"step": step["step"], "rollout_time_s": step["rollout_time_s"], "iterations": len(its),
                   "rows_mean": round(sum(it["rows"] for it in its) / len(its), 2),
                   "prefilled_tokens": sum(it["prefill"] for it in its), "real_s": round(real, 1),
                   "replay_s": round(sum(ms) / 1000, 1), "real_over_replay": round(real * 1000 / sum(ms), 3),
                   **time_split(its, ms)}
            print(json.dumps(row), flush=True)
            report["steps"].append(row)
            all_its += its
            all_ms += ms
        ab = []   # (this run's decoder seconds, the other run's) of each step both traced
        for step in steps:
            if step["step"] in others:
                this, other = alternating(decoder, prefix, len(prefix_ids), step["iterations"],
                                          others[step["step"]]["iterations"])
                ab.append((this, other))
                print(json.dumps({"step": step["step"], "replay_s": round(this, 1), "against_replay_s": round(other, 1),
                                  "against_over_this": round(other / this, 3)}), flush=True)
        decoder.cache = None
    real = sum(it["ms"] for it in all_its) / 1000
    report |= {"real_s": round(real, 1), "replay_s": round(sum(all_ms) / 1000, 1),
               "real_over_replay": round(real * 1000 / sum(all_ms), 3), **time_split(all_its, all_ms)}
    if ab:
        this, other = sum(a for a, _ in ab), sum(b for _, b in ab)
        report |= {"against": args.against, "alternating_replay_s": round(this, 1),
                   "alternating_against_replay_s": round(other, 1), "against_over_this": round(other / this, 3)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
