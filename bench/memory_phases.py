"""Peak resident memory of a CPU run, phase by phase: the real command (rstar2_mini.main) with a sampler thread
reading the process's resident size every 0.2 s and marks where each phase starts (each log line, each decode
loop of the engine, each update).

    python bench/memory_phases.py --stage 1 --steps 1 --out runs/mem --set eval_problems=0   # any arguments of
                                                                                           # rstar2_mini.py
Each line printed: the phase's start (seconds), the peak resident memory until the next mark, the mark; the last
line is one JSON object with the peaks of the engine's decode loops, of the updates and of the whole run.
(With an SFT checkpoint in OUT/sft the run starts from it; without one the SFT runs first, and its peak is the
run's until the first RL mark.)
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

import engines  # noqa: E402
import rstar2_mini  # noqa: E402

started = time.time()
marks: list[tuple[float, str]] = []
samples: list[tuple[float, float]] = []


def sample() -> None:
    process = psutil.Process()
    while True:
        samples.append((time.time() - started, process.memory_info().rss / 1e9))
        time.sleep(0.2)


def marked(fn, before: str, after: str | None = None):
    """fn, with a mark before it runs (and after, when `after` is given)."""
    def wrapper(*args, **kwargs):
        marks.append((time.time() - started, before))
        try:
            return fn(*args, **kwargs)
        finally:
            if after:
                marks.append((time.time() - started, after))
    return wrapper


def log(msg: str) -> None:
    marks.append((time.time() - started, msg.splitlines()[0][:100]))
    plain_log(msg)


plain_log = rstar2_mini.log
rstar2_mini.log = log
rstar2_mini.policy_update = marked(rstar2_mini.policy_update, "update", "after the update")
engines.TransformersEngine.decode_loop = marked(engines.TransformersEngine.decode_loop, "engine decode loop",
                                                "after the decode loop")
threading.Thread(target=sample, daemon=True).start()
try:
    code = rstar2_mini.main(sys.argv[1:])
finally:
    marks.append((time.time() - started, "end"))
    peaks = []
    for (t0, mark), (t1, _) in zip(marks, marks[1:]):
        inside = [gb for t, gb in samples if t0 <= t <= t1]
        peaks.append((mark, max(inside) if inside else None))
        print(f"{t0:8.1f} s  {peaks[-1][1] or 0:5.2f} GB  {mark}")

    def peak_of(name: str):
        values = [gb for mark, gb in peaks if mark == name and gb is not None]
        return round(max(values), 2) if values else None

    print(json.dumps({"decode_loop_peak_gb": peak_of("engine decode loop"), "update_peak_gb": peak_of("update"),
                      "run_peak_gb": round(max(gb for _, gb in samples), 2), "args": sys.argv[1:]}))
sys.exit(code)
