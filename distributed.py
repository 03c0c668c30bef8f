"""distributed.py - one node, several GPUs: the policy sharded with FSDP2 under torchrun (paper scale, section 4).

    torchrun --nproc-per-node 8 rstar2_mini.py --stage all --preset paper --model /path/to/model

The paper trains a 14B model on 64 GPUs; one 8-GPU node is this project's paper-scale target. The fp32 weights,
gradients and AdamW state of 14B parameters take 224 GB, more than one GPU holds, so every rank keeps 1/N of
them (torch's FSDP2 `fully_shard`, one unit per decoder layer, bf16 compute and fp32 gradient reduction on GPUs):

    rank 0:   rollouts (vLLM engines, the sandbox, GRPO-RoC), evaluations, logs, checkpoints
              --broadcast the step's kept trajectories and the RoC random state-->   every rank
    all:      its token-balanced share of each mini-batch (rank_shares) -> log-probs -> loss -> backward
              (FSDP's reduce-scatter sums the ranks' gradients into each shard) -> clip -> AdamW on its shard
    all -> 0: the full weights gathered on rank 0 (full_state) -> weight sync to the engines / checkpoint

Every forward pass gathers the sharded weights, a collective that all ranks must join in the same order, so a
rank with fewer micro-batches than another runs empty passes (my_micro_batches) and the model is run without
the shared-prefix shortcut (which makes one or two passes depending on the data).

In a single process (no torchrun) DIST.world is 1 and every rank helper here is the identity or does nothing
(micro-batches are still packed by tokens: pack_micro_batches): the CPU path reads as if ranks did not exist.
sft.py and rstar2_mini.py both use it.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import sys
from dataclasses import dataclass


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    cpu_group: object = None  # GPUs: a gloo group, so ranks waiting for rank 0 wait on the CPU (see from_rank0)
    device: str = "cpu"       # where the ranks train: "cuda" (NCCL) or "cpu" (gloo)
    waits: int = 0            # wait_for_rank0's counter: the same sequence on every rank


DIST = Dist()  # set by init_distributed(); like nanoGPT's ddp_rank / ddp_world_size
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


def init_distributed(device: str = "cpu") -> None:
    """Join torchrun's process group (NCCL on GPUs, gloo on CPU ranks); nothing to do in a single process.
    `device` is model.training_device's answer: a run that expects GPUs and has none stopped before this."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return
    import torch
    import torch.distributed as dist

    gpu = device == "cuda"
    if not dist.is_initialized():
        if gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # Collectives start only when every rank is there: the long phases of rank 0 alone (rollouts, scans,
        # evaluations) are waited out in wait_for_rank0 first, so this timeout only bounds a real hang.
        dist.init_process_group("nccl" if gpu else "gloo", timeout=COLLECTIVE_TIMEOUT)
    DIST.rank, DIST.world, DIST.device = dist.get_rank(), dist.get_world_size(), device
    if gpu:  # an NCCL wait spins a kernel on the GPU that rank 0's vLLM engines share
        DIST.cpu_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)


def close_distributed() -> None:
    """All ranks leave together. Rank 0 may still be writing the final checkpoint (177 GB at 14B): the others wait
    for it on the store first (wait_for_rank0), then meet in a barrier (on GPUs over the gloo group)."""
    if DIST.world > 1:
        import torch.distributed as dist

        barrier()
        dist.destroy_process_group()


def exit_rank(code: int):
    """End this process with exit status `code`; a torchrun rank skips Python's interpreter teardown.

    After fully_shard, destroy_process_group does not free the gloo process group: something in torch still holds
    it, and its worker threads outlive it (they are still in /proc/self/task after a model with only its root
    sharded is deleted and collected). Such a thread releases the last collective's tensors after the collective
    has returned; a tensor owned by Python needs the GIL to go, and if the interpreter has begun finalizing by
    then, the thread is unwound inside a destructor and the rank aborts: "terminate called without an active
    exception" (gdb on the core: ProcessGroupGloo::runLoop -> ~AsyncBarrierWork -> ~AsyncAllgatherCoalescedWork ->
    decref_pyobject -> take_gil -> pthread_exit -> std::terminate; torch PR 179291 describes the same teardown).
    On a busy 2-core host tests/fsdp_memory_ranks.py aborted so in 2 of 115 runs (docs/design.md). os._exit
    leaves the process before the teardown: what a run writes is closed by then (checkpoints and metrics by their
    `with` blocks), so only the standard streams are flushed here."""
    if DIST.world > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


@contextlib.contextmanager
def without_torchrun_env():
    """Hide torchrun's variables (RANK, WORLD_SIZE, MASTER_PORT ...) while rank 0 starts vLLM: its engine
    processes inherit the environment and would otherwise read themselves as members of our process group (vLLM
    issues #1865, #7939: hangs under torchrun). Not verified here: no GPU was available."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
             "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k in names or k.startswith("TORCHELASTIC_")}
    try:
        yield
    finally:
        os.environ.update(saved)


def shard_policy(model, bf16: bool):
    """FSDP2: every decoder layer is a unit whose weights are gathered just for its forward and backward, and so are
    the input embeddings and the output head (one unit when they share their weight). Left in the root unit, they
    would stay gathered in bf16 from the forward to the end of the backward (torch keeps the root unsharded after
    forward): 2 x 1.6 GB at 14B, V x H each (memory_plan.py counts each unit: gathered bf16 weights, their
    gradient, the fp32 reduce-scatter buffers)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head.weight is embed.weight:   # tied (SmolLM2, Qwen2.5-1.5B): one unit, gathered once a forward
        fully_shard([embed, head], mp_policy=mp)
    else:
        fully_shard(embed, mp_policy=mp)
        fully_shard(head, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def pack_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Greedy packing of trajectories (sorted by length) into micro-batches of at most max_tokens padded tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def rank_shares(items: list[int], lengths: list[int]) -> list[list[int]]:
    """Split a batch between the ranks by tokens: longest first, each to the least loaded rank. Every rank
    computes the same split from the same data, so no rank needs to be told its share."""
    if DIST.world == 1:
        return [list(items)]
    shares, load = [[] for _ in range(DIST.world)], [0] * DIST.world
    for i in sorted(items, key=lambda i: (-lengths[i], i)):
        r = min(range(DIST.world), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    return shares


def my_micro_batches(per_rank: list[list[int]], lengths: list[int], max_tokens: int) -> list:
    """This rank's micro-batches (item indices packed by pack_micro_batches), given every rank's items, padded with
    None up to the busiest rank's count (a None is an empty pass: it joins the collectives and adds a zero
    gradient). In a single process: all the items, packed."""
    packed = [[[items[j] for j in mb] for mb in pack_micro_batches([lengths[i] for i in items], max_tokens)]
              for items in per_rank]
    mine = packed[DIST.rank]
    return mine + [None] * (max(len(p) for p in packed) - len(mine))


def all_ranks_sum(values: list[float]) -> list[float]:
    return all_ranks_reduce(values, "sum")


def all_ranks_max(values: list[float]) -> list[float]:
    return all_ranks_reduce(values, "max")


def all_ranks_reduce(values: list[float], op: str) -> list[float]:
    """Element-wise sum or max of every rank's values (in a single process: the values)."""
    if DIST.world == 1:
        return values
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=DIST.device)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t.tolist()


def wait_for_rank0(poll=datetime.timedelta(minutes=5)) -> None:
    """Every rank but 0 waits here, without a deadline, until rank 0 arrives. Rank 0 alone runs rollouts, difficulty
    scans (stage 3's takes hours at paper scale) and evaluations while the others wait; a collective would time
    out (COLLECTIVE_TIMEOUT), so they wait on a key in torchrun's store, polled every `poll`, and the collective
    that follows starts with every rank present. If rank 0 dies, torchrun stops the others."""
    if DIST.world == 1:
        return
    import torch.distributed as dist

    DIST.waits += 1
    key, store = f"rstar2/rank0_ready/{DIST.waits}", dist.distributed_c10d._get_default_store()
    if DIST.rank == 0:
        store.set(key, "1")
        return
    while True:
        try:
            store.wait([key], poll)
            return
        except dist.DistStoreError:  # the poll ran out: rank 0 is still busy, wait again (a lost store raises)
            continue


def from_rank0(obj):
    """Rank 0's object on every rank (pickled; the other ranks pass anything). The other ranks wait here while
    rank 0 runs rollouts (wait_for_rank0), then receive it: on GPUs over the gloo group, on the CPU."""
    if DIST.world == 1:
        return obj
    import torch.distributed as dist

    wait_for_rank0()
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=DIST.cpu_group)
    return box[0]


def barrier() -> None:
    """Every rank waits for the others (on GPUs over the gloo group: no kernel spins while rank 0 works)."""
    if DIST.world > 1:
        import torch.distributed as dist

        wait_for_rank0()  # the ranks most often wait for rank 0's files (checkpoints) and rollouts here
        dist.barrier(group=DIST.cpu_group)


def full_state(model, optimizer=None) -> tuple[dict | None, dict | None]:
    """(weights, optimizer state) in full on rank 0, None elsewhere: a collective. In a single process the
    weights are None (the model itself is whole: save and sync it directly)."""
    if DIST.world == 1:
        return None, optimizer.state_dict() if optimizer is not None else None
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    opt = get_optimizer_state_dict(model, optimizer, options=options) if optimizer is not None else None
    return (weights, opt) if DIST.rank == 0 else (None, None)


def gathered_weights(model, dtype):
    """The full weights for a weight sync, one tensor at a time: a generator of (name, tensor on the CPU) on rank 0,
    of nothing elsewhere, that every rank must run through (each tensor is a collective). Each rank casts its shard
    to `dtype` (the engines' bf16) before the all-gather, so the gather moves half the bytes of fp32 and rank 0
    holds one tensor, not the whole fp32 model: full_state's 59 GB of host memory at 14B (rank 0's peak is then
    one of vllm_engine's buckets, ~1 GiB). In a single process: the model's own tensors, cast."""
    import torch

    with torch.no_grad():
        for name, t in model.state_dict().items():
            t = t.detach().to(dtype) if dtype is not None else t.detach()
            if hasattr(t, "full_tensor"):   # an FSDP2 shard: the all-gather every rank joins
                t = t.full_tensor()
            if DIST.rank == 0:
                yield name, t.cpu()
            del t


def load_optimizer_state(model, optimizer, state: dict | None) -> None:
    """The inverse of full_state's optimizer part. Under torchrun only rank 0 holds the full state (the fp32
    AdamW moments are 8 bytes x P: 118 GB at 14B; load_trainer_state reads it there alone, memory-mapped); the
    other ranks pass None and torch's state-dict API broadcasts each rank its shard from rank 0."""
    if DIST.world == 1:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    # torch sizes each rank's shards from its own (empty) state, which it creates with a zero step of the
    # optimizer only where no parameter holds a gradient: drop any left over from an earlier update
    optimizer.zero_grad(set_to_none=True)
    wait_for_rank0()
    set_optimizer_state_dict(model, optimizer, state if DIST.rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def load_trainer_state(path) -> dict:
    """A checkpoint's trainer_state.pt on every rank, read from disk by rank 0 alone and memory-mapped (pages are
    read as they are used, and freed with the dict). Its small part (step, cursor, random states, ...) reaches
    every rank; its optimizer state stays on rank 0 ("optimizer" is None elsewhere; load_optimizer_state
    broadcasts the shards)."""
    import torch

    state = torch.load(path, weights_only=False, mmap=True) if DIST.rank == 0 else None
    if DIST.world == 1:
        return state
    small = from_rank0({k: v for k, v in state.items() if k != "optimizer"} | {"has_optimizer": state.get(
        "optimizer") is not None} if DIST.rank == 0 else None)
    has_optimizer = small.pop("has_optimizer")
    return small | {"optimizer": state["optimizer"] if DIST.rank == 0 else ({} if has_optimizer else None)}


def sharded_policy_from_rank0(path, device: str, bf16: bool):
    """The fp32 master weights, sharded over the ranks, read from disk by rank 0 alone (a 14B model is 59 GB in
    fp32: on every rank of a node that is 0.5 TB of host RAM). Every rank builds the model on the meta device (no
    memory), shards it (shard_policy) and allocates its shards; then load_weights_from_rank0 fills them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        policy = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)), dtype=torch.float32)
    policy = shard_policy(policy, bf16=bf16)
    policy.to_empty(device=device)
    load_weights_from_rank0(policy, path)
    return policy


def load_weights_from_rank0(policy, path) -> None:
    """A checkpoint's weights into a sharded policy: rank 0 reads the file, and its full state dict is broadcast
    shard by shard (torch's set_model_state_dict, broadcast_from_rank0); the buffers a state dict leaves out
    (RoPE's inv_freq) are broadcast from rank 0's copy. Used at start-up and when an interrupted SFT continues."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    import model as models

    full = models.load_model(path, dtype=torch.float32, device="cpu") if DIST.rank == 0 else None
    if full is not None:
        policy.generation_config = full.generation_config
    wait_for_rank0()
    set_model_state_dict(policy, full.state_dict() if full is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    own = dict(full.named_buffers()) if full is not None else {}
    with torch.no_grad():
        for name, buf in policy.named_buffers():
            if DIST.rank == 0:
                buf.copy_(own[name])
            dist.broadcast(buf, src=0)
    del full, own


def moved_tensor(t, device):
    """A copy of `t` on `device` (a new storage, also when it is already there). To the host: pinned when `t` is on a
    GPU, so that the way back is a DMA copy. A DTensor (an FSDP2 shard, an AdamW moment of one) keeps its mesh and
    placements with its local tensor moved (DTensor.from_local would move it back to the mesh's device)."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return DTensor(moved_tensor(t._local_tensor, device), t._spec, requires_grad=False)
    if device.type == "cpu":
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda).copy_(t)
    return t.to(device, copy=True)


def local_bytes(t) -> int:
    """Bytes this rank holds of `t` (a DTensor: its local shard)."""
    local = getattr(t, "_local_tensor", t)
    return local.numel() * local.element_size()


def move_trainer(model, optimizer, to: str) -> dict:
    """The trainer's sharded state between its GPU and host memory (paper scale: the rollouts and the update take
    turns on the GPUs, docs/memory.md "Phases"). to="host": every rank's fp32 weight shards and AdamW moments are
    copied to (pinned) host memory, the gradients dropped (set to None: the update has stepped) and the CUDA
    caching allocator's free blocks handed back, so that vLLM's KV cache can use the GPU; to="device": back to
    DIST.device before the update. FSDP2 takes module.to()/._apply() (torch 2.13, _fully_shard.FSDPModule._apply:
    reshard, move, re-pad each shard); the parameters keep their identity (DTensors are swapped in place), so the
    optimizer's references stay valid (torch refuses to swap a parameter that has weak references: nothing may
    hold one while the state moves). Both ways copy into new storage even on CPU ranks, where the test checks
    that training goes on exactly as without the round trip. Returns {"bytes": moved, "s": seconds}."""
    import gc
    import time

    import torch

    t0 = time.perf_counter()
    if to not in ("host", "device"):
        raise ValueError(f"move_trainer: to must be 'host' or 'device', not {to!r}")
    target = torch.device(DIST.device if to == "device" else "cpu")
    if to == "host" and optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    moved = 0

    def move(t):
        nonlocal moved
        moved += local_bytes(t)
        return moved_tensor(t, target)

    with torch.no_grad():
        model._apply(move)     # parameters and buffers (the grads are None on the way out)
        for state in (optimizer.state.values() if optimizer is not None else ()):
            for k, v in list(state.items()):
                if torch.is_tensor(v) and v.dim() > 0:   # AdamW's m and v (its step count stays a scalar)
                    state[k] = move(v)
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return {"bytes": moved, "s": round(time.perf_counter() - t0, 3)}


def is_sharded(model) -> bool:
    """Whether shard_policy has already made `model` an FSDP2 module."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def clip_gradients(model, max_norm: float) -> float:
    """g <- g * min(1, max_norm / ||g||), the norm over all parameters (under FSDP: over every rank's shard)."""
    import torch

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if hasattr(norm, "full_tensor"):  # a DTensor: each rank holds part of the sum of squares
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return float(norm)
