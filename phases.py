"""phases.py - at paper scale the rollouts and the update take turns on the GPUs (docs/memory.md "Phases").

On one 8-GPU node every GPU holds one vLLM engine (rank 0's) and one FSDP2 trainer rank. Both at once leave a 14B
model's engines KV for about one full-length rollout (memory_plan.py), so, as verl and OpenRLHF do, they take turns:

    rollouts     the trainer's shards and AdamW moments wait in pinned host memory (distributed.move_trainer);
                 the engines' KV cache takes the GPUs
    for_update   rank 0 puts the engines to sleep (vLLM sleep mode, level 2: weights and KV released), every rank
                 waits for that (barrier), then moves its state back to its GPU
    update       policy_update (rl_update.py)
    for_rollouts rank 0 wakes the engines' weights; every rank gathers the weights one tensor at a time in bf16
                 (distributed.gathered_weights) and rank 0 streams them to the engines in buckets
                 (scheduler.sync_weights; the engines empty their cache after it); every rank moves its state to
                 host memory and waits (barrier), and rank 0 wakes the KV cache

Turns.on is the same on every rank (the config and the world size decide it), so every rank takes the same
barriers. In-process engines (the CPU path, CPU ranks over gloo) have no sleep mode: the trainer's state still
goes to host memory and back (a copy), which is how the CPU tests run this path (tests/test_phases.py). Without
the offload (the CPU preset) for_update has the CPU engine let go of its fused copies of the weights, which the
update makes stale (TransformersEngine.release_operands)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from distributed import DIST, barrier, gathered_weights, move_trainer


@dataclass
class Turns:
    on: bool = False                 # cfg.offload_trainer under torchrun
    trainer_on_device: bool = True
    sync_dtype: object = None        # the engines' dtype: the weights are gathered in it (bf16 on GPUs)
    timings: dict = field(default_factory=dict)   # the latest switch's seconds (merged into the step's metrics)


def turns_for(cfg, sync_dtype=None) -> Turns:
    return Turns(on=bool(cfg.offload_trainer) and DIST.world > 1, sync_dtype=sync_dtype)


def trainer_to_host(turns: Turns, model, optimizer=None) -> None:
    """The trainer's state to host memory (before vLLM starts, and after each weight sync)."""
    if turns.on and turns.trainer_on_device:
        turns.timings["trainer_to_host_s"] = move_trainer(model, optimizer, "host")["s"]
        turns.trainer_on_device = False


def for_update(turns: Turns, engines: list, model, optimizer) -> None:
    """Engines asleep (rank 0), then the trainer's state back on every rank's GPU."""
    import vllm_engine

    if not turns.on:   # in-process engines: their copies of the weights go stale at the first optimizer step
        for engine in engines if DIST.rank == 0 else ():
            getattr(engine, "release_operands", lambda: None)()
    if not turns.on or turns.trainer_on_device:
        return
    if DIST.rank == 0:
        turns.timings["engine_sleep_s"] = round(vllm_engine.sleep_engines(engines, level=2), 3)
    barrier()   # no rank fills its GPU before the engine beside it has let go
    turns.timings["trainer_to_device_s"] = move_trainer(model, optimizer, "device")["s"]
    turns.trainer_on_device = True


def sync_for_rollouts(turns: Turns, engines: list, model, optimizer, whole=None) -> None:
    """The new weights into the engines, then (offload) the trainer's state to host memory on every rank and, once
    all are there, the engines' KV cache awake. Under torchrun the weights are gathered one tensor at a time in
    the engines' dtype (distributed.gathered_weights: a collective every rank runs through) and streamed to the
    engines in buckets by rank 0, whose engines' weights wake first; in one process `whole` (the model) is sent."""
    import scheduler
    import vllm_engine

    t0 = time.perf_counter()
    weights = whole if DIST.world == 1 else gathered_weights(model, turns.sync_dtype)
    if DIST.rank == 0:
        if turns.on:
            turns.timings["engine_wake_weights_s"] = round(vllm_engine.wake_engines(engines, ["weights"]), 3)
        scheduler.sync_weights(engines, weights)
    for _ in weights if DIST.world > 1 else ():   # what rank 0's engines did not take (all of it elsewhere)
        pass
    turns.timings["sync_s"] = round(time.perf_counter() - t0, 3)
    if not turns.on:
        return
    trainer_to_host(turns, model, optimizer)
    barrier()   # every rank's state has left its GPU before the KV cache takes it
    if DIST.rank == 0:
        turns.timings["engine_wake_kv_s"] = round(vllm_engine.wake_engines(engines, ["kv_cache"]), 3)
