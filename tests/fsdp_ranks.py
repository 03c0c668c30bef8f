"""Run by tests/test_trainer.py under torchrun on 2 CPU ranks (gloo): the FSDP2 path of rstar2_mini.py.

    python -m torch.distributed.run --nproc-per-node 2 tests/fsdp_ranks.py update MODEL_DIR OUT
        one policy update of a fixed batch; rank 0 saves the full weights and the update's numbers to OUT
    python -m torch.distributed.run --nproc-per-node 2 tests/fsdp_ranks.py stage MODEL_DIR RUN_DIR STEPS
        RL steps with rollouts on rank 0 (coin reward), the update sharded over both ranks, checkpoints; a fifth
        argument "offload": the trainer's state in host memory between updates (phases.py)
    python -m torch.distributed.run --nproc-per-node 2 tests/fsdp_ranks.py sft MODEL_DIR CHATS_JSONL OUT_DIR
        SFT steps on a fixed chat file (sft_config), the model sharded; rank 0 saves the model to OUT_DIR
    python -m torch.distributed.run --nproc-per-node 2 tests/fsdp_ranks.py load MODEL_DIR OUT
        the policy read by rank 0 alone and broadcast (sharded_policy_from_rank0); one update; its optimizer state
        saved by rank 0 and loaded back by rank 0 alone (load_trainer_state, load_optimizer_state); each rank
        saves what it holds to OUT.rank{r}
    python -m torch.distributed.run --nproc-per-node 2 tests/fsdp_ranks.py gather MODEL_DIR OUT
        the weight sync's gather, one tensor at a time in bf16; rank 0 saves the (name, tensor) pairs
    python -m torch.distributed.run --nproc-per-node 2 tests/fsdp_ranks.py bf16_update MODEL_DIR OUT
        one policy update under FSDP2's bf16 mixed-precision policy (lr 0); rank 0 saves its full gradients
    python -m torch.distributed.run --nproc-per-node 2 tests/fsdp_ranks.py sft_grad MODEL_DIR CHATS_JSONL OUT
        one SFT batch packed by forwarded tokens, checkpointed and chunked: rank 0 saves its loss and gradients
    python -m torch.distributed.run --nproc-per-node 2 tests/fsdp_ranks.py sft_free MODEL_DIR CHATS_JSONL OUT_DIR
        rstar2_mini.run_sft_stage on the chat file; each rank saves how many of the SFT policy's parameters are
        still reachable after it returned (OUT_DIR/free.rank{r})
    python -m torch.distributed.run --nproc-per-node 2 tests/fsdp_ranks.py last_barrier SECONDS
        rank 0 busy for SECONDS before close_distributed, with a 3-second collective timeout
    python -m torch.distributed.run --nproc-per-node 2 tests/fsdp_ranks.py offload MODEL_DIR OUT
        two policy updates, with and without the trainer's state sent to host memory and back between them
        (distributed.move_trainer); rank 0 saves both runs' full weights, optimizer states and where the state
        lived to OUT
CPU ranks on purpose (gloo): the Configs here say device="cpu".
"""
import gc
import random
import sys
import weakref
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import distributed as D  # noqa: E402
import model as models  # noqa: E402
import rstar2_mini as R  # noqa: E402
import scheduler  # noqa: E402
import tasks  # noqa: E402


def update_config() -> R.Config:
    return R.Config(lr=1e-3, warmup_steps=1, weight_decay=0.0, minibatches=2, micro_batch_tokens=64,
                    temperature=1.0, grad_clip=1.0, precision="fp32", device="cpu")  # exact: not bf16 on bf16 CPUs


def fixed_batch(tokenizer) -> list:
    """Five trajectories of different lengths with advantages of both signs (tool tokens masked in one)."""
    prompt = scheduler.render_prompt(tokenizer, "What is 6*7?")[:20]
    kept = []
    for k, (n, adv) in enumerate([(9, 1.2), (4, -0.7), (13, 0.4), (6, -1.1), (11, 0.9)]):
        t = scheduler.Trajectory(problem_id=f"p{k}", prompt_ids=prompt)
        t.segments = [scheduler.Segment([(31 * k + 7 * j) % 900 + 10 for j in range(n)], 1),
                      scheduler.Segment([5, 6, 7], 0), scheduler.Segment([40 + k, 41, 42], 1)]
        kept.append((t, adv))
    return kept


def sft_config(chats: str):
    import sft

    return sft.SFTConfig(n_examples=0, data_jsonl=chats, heldout_examples=0, batch_size=5, lr=1e-3,
                         micro_batch_tokens=40, warmup_steps=1, max_steps=2, seed=0, bf16=False)  # exact


def chat_rows() -> list[dict]:
    """Seven chats of different lengths: a batch of 5 splits 3 / 2 between the ranks, so one rank pads."""
    return [{"messages": [{"role": "user", "content": f"Count to {k}."},
                          {"role": "assistant", "content": " ".join(str(j) for j in range(3 * k + 1))}]}
            for k in range(1, 8)]


def sft_steps(model_dir: str, chats: str, out: str) -> None:
    import sft

    # the recipe's path (rstar2_mini.run_sft_stage): rank 0 alone reads the weights, every rank gets its shards
    policy = D.sharded_policy_from_rank0(model_dir, "cpu", bf16=False)
    sft.run_sft(policy, models.load_tokenizer(model_dir), sft_config(chats), Path(out))


def sft_stage_then_free(model_dir: str, chats: str, out: str) -> None:
    """rstar2_mini.run_sft_stage on a fixed chat file, with the garbage collector off (only the run's own collects
    count): how many of its policy's parameters are still reachable once it has returned."""
    import gc
    import weakref

    import sft

    refs, real = [], R.sharded_policy_from_rank0

    def recording(*args, **kw):
        policy = real(*args, **kw)
        refs.extend(weakref.ref(p) for p in policy.parameters())
        return policy

    R.sharded_policy_from_rank0 = recording
    fixed = sft_config(chats)
    sft.SFTConfig = lambda **kw: fixed
    gc.disable()
    R.run_sft_stage(R.Config(out=out, device="cpu", precision="fp32", model=model_dir), Path(model_dir))
    alive = sum(r() is not None for r in refs)
    gc.enable()
    torch.save({"parameters": len(refs), "alive": alive}, f"{out}/free.rank{D.DIST.rank}")


def packed_sft_config(chats: str):
    """The paper preset's SFT on a small scale: micro-batches of at most 1000 forwarded tokens (rows x the longest
    row), checkpointed layers, log-probs 5 tokens at a time; fp32 (exact)."""
    import dataclasses

    return dataclasses.replace(sft_config(chats), micro_batch_tokens=1000, activation_checkpointing=True,
                               logprob_chunk_tokens=5)


def sft_gradients(model_dir: str, chats: str, out: str) -> None:
    """One SFT batch's loss and full gradients (sft.accumulate_gradients) on the sharded policy; rank 0 saves them
    with the forwarded tokens of every micro-batch of each rank and how many layer forwards ran checkpointed."""
    import sft

    tokenizer = models.load_tokenizer(model_dir)
    cfg = packed_sft_config(chats)
    examples = sft.load_chat_jsonl(chats, tokenizer)[:5]
    policy = D.sharded_policy_from_rank0(model_dir, "cpu", bf16=False)
    runs, real = [0], models.checkpointed_layer_forward

    def counting(*args, **kw):
        runs[0] += 1
        return real(*args, **kw)

    models.checkpointed_layer_forward = counting
    forwarded = [len(mb) * max(len(t.input_ids) for t in mb)
                 for mb in sft.my_micro_batches_of(examples, cfg.micro_batch_tokens, shared=False) if mb]
    loss = sft.accumulate_gradients(policy, examples, cfg, tokenizer.pad_token_id or 0)
    grads = {n: p.grad.full_tensor() for n, p in policy.named_parameters()}
    box = [None] * D.DIST.world
    torch.distributed.all_gather_object(box, {"forwarded": forwarded, "checkpointed_runs": runs[0]})
    if D.DIST.rank == 0:
        torch.save({"loss": loss, "grads": grads, "ranks": box}, out)


def bf16_update_config() -> R.Config:
    """One mini-batch, lr 0: the update's gradient stays in p.grad and the weights stay the oracle's."""
    import dataclasses

    return dataclasses.replace(update_config(), lr=0.0, minibatches=1, activation_checkpointing=True,
                               logprob_chunk_tokens=7)


def bf16_update(model_dir: str, out: str) -> None:
    """policy_update with FSDP2's bf16 mixed-precision policy (bf16 weights and compute, fp32 reduce-scatter,
    fp32 master weights), checkpointed layers and log-prob chunks, as on the GPUs; rank 0 saves the numbers and
    every parameter's full (clipped) gradient."""
    tokenizer = models.load_tokenizer(model_dir)
    policy = D.shard_policy(models.load_model(model_dir), bf16=True)
    cfg = bf16_update_config()
    optimizer, schedule = R.make_optimizer(policy, cfg)
    numbers = R.policy_update(R.Runtime(policy, tokenizer, engines=[], pool=None, loop=None), cfg, optimizer,
                              schedule, fixed_batch(tokenizer), random.Random(0))
    grads = {n: p.grad.full_tensor() for n, p in policy.named_parameters()}
    if D.DIST.rank == 0:
        torch.save({"numbers": numbers, "grads": grads}, out)


def gather_bf16(model_dir: str, out: str) -> None:
    """distributed.gathered_weights of the sharded policy in bf16: rank 0 saves what it received, in order."""
    policy = D.shard_policy(models.load_model(model_dir), bf16=False)
    got = list(D.gathered_weights(policy, torch.bfloat16))
    if D.DIST.rank == 0:
        torch.save(got, out)
    elif got:
        raise AssertionError("only rank 0 receives the gathered weights")


def one_update(model_dir: str, out: str) -> None:
    tokenizer = models.load_tokenizer(model_dir)
    policy = D.shard_policy(models.load_model(model_dir), bf16=False)
    rt = R.Runtime(policy, tokenizer, engines=[], pool=None, loop=None)
    cfg = update_config()
    optimizer, schedule = R.make_optimizer(policy, cfg)
    numbers = R.policy_update(rt, cfg, optimizer, schedule, fixed_batch(tokenizer), random.Random(0))
    weights, _ = D.full_state(policy)
    if D.DIST.rank == 0:
        torch.save({"weights": weights, "numbers": numbers}, out)


def load_from_rank0(model_dir: str, out: str) -> None:
    tokenizer = models.load_tokenizer(model_dir)
    policy = D.sharded_policy_from_rank0(model_dir, "cpu", bf16=False)
    weights, _ = D.full_state(policy)
    buffers = {n: b.clone() for n, b in policy.named_buffers()}
    cfg = update_config()
    optimizer, schedule = R.make_optimizer(policy, cfg)  # (before any forward: FSDP2 swaps the parameters then)
    R.policy_update(R.Runtime(policy, tokenizer, engines=[], pool=None, loop=None), cfg, optimizer, schedule,
                    fixed_batch(tokenizer), random.Random(0))
    updated, opt = D.full_state(policy, optimizer)
    state_file = Path(out + ".trainer_state.pt")
    if D.DIST.rank == 0:
        torch.save({"step": 3, "cursor": 17, "optimizer": opt}, state_file)
    D.barrier()
    again, _ = R.make_optimizer(policy, cfg)
    state = D.load_trainer_state(state_file)
    held = state["optimizer"]  # rank 0: the full state; the others: an empty stand-in
    D.load_optimizer_state(policy, again, held)
    _, opt_again = D.full_state(policy, again)
    ids = torch.tensor([scheduler.render_prompt(tokenizer, "What is 6*7?")[:24]])
    with torch.no_grad():
        logits = policy(input_ids=ids).logits
    torch.save({"weights": weights, "updated": updated, "logits": logits, "buffers": buffers, "optimizer": opt,
                "reloaded": opt_again,
                "step": state["step"], "cursor": state["cursor"], "held_keys": len(held or {})},
               f"{out}.rank{D.DIST.rank}")


HELD = []  # the tensors storages() saw, held so that no later allocation can reuse their addresses


def storages(policy, optimizer) -> set:
    """The data pointers of every local shard and optimizer tensor this rank holds."""
    local = lambda t: getattr(t, "_local_tensor", t)  # noqa: E731
    tensors = [local(p) for p in policy.parameters()] + [local(v) for s in optimizer.state.values()
                                                         for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    HELD.extend(tensors)
    return {t.untyped_storage().data_ptr() for t in tensors}


def offload_round_trip(model_dir: str, out: str) -> None:
    tokenizer = models.load_tokenizer(model_dir)
    cfg = update_config()
    result = {}
    for offload in (False, True):
        policy = D.shard_policy(models.load_model(model_dir), bf16=False)
        rt = R.Runtime(policy, tokenizer, engines=[], pool=None, loop=None)
        optimizer, schedule = R.make_optimizer(policy, cfg)
        R.policy_update(rt, cfg, optimizer, schedule, fixed_batch(tokenizer), random.Random(0))
        before, away, back = storages(policy, optimizer), None, None
        if offload:
            D.move_trainer(policy, optimizer, "host")
            away = storages(policy, optimizer)
            D.move_trainer(policy, optimizer, "device")
            back = storages(policy, optimizer)
        numbers = R.policy_update(rt, cfg, optimizer, schedule, fixed_batch(tokenizer), random.Random(1))
        weights, opt = D.full_state(policy, optimizer)
        HELD.clear()
        result[offload] = {"weights": weights, "optimizer": opt, "numbers": numbers,
                           "moved_away": away is not None and not (away & before),
                           "moved_back": back is not None and not (back & away)}
    if D.DIST.rank == 0:
        torch.save(result, out)


def Toy(id: str, question: str, answer: str):
    """A problem outside the generator (no family; level 1 by default), as a loaded data file gives."""
    return tasks.Problem(id, question, answer)


def coin(response, gold):
    return float(sum(map(ord, response)) % 2)


def stage(model_dir: str, run_dir: str, steps: int, offload: bool = False) -> None:
    cfg = R.Config(offload_trainer=offload, out=run_dir, steps=steps, groups_per_step=2, group_size=2, oversample=2, max_draw_rounds=1,
                   max_turns=3, max_response_tokens=192, temperature=1.3, lr=1e-3, warmup_steps=1, minibatches=2,
                   micro_batch_tokens=4096, eval_problems=0, save_every=1, engine_batch=8, deterministic=True,
                   drop_all_equal=False, tool_timeout_s=5.0, samples_per_step=1, resume=True, precision="fp32",
                   device="cpu")
    d = Path(run_dir) / "stage1"
    d.mkdir(parents=True, exist_ok=True)
    ckpt = R.latest_checkpoint(d)
    start = torch.load(ckpt / "trainer_state.pt", weights_only=False) if ckpt else None
    rt = R.build_runtime(cfg, ckpt or Path(model_dir))
    rt.reward_fn = coin
    try:
        problems = [Toy(f"p{i}", "What is 6*7?", "42") for i in range(50)]
        R.train_stage(rt, cfg, "1", d, lambda i: problems[i % len(problems)], start=start)
    finally:
        # (weak references only now: move_trainer swaps the parameters, and torch refuses to swap a tensor that has
        # weak references)
        refs = [weakref.ref(p) for p in rt.model.parameters()]
        gc.disable()   # only close_runtime's own collection counts
        R.close_runtime(rt)
        alive = sum(r() is not None for r in refs)
        gc.enable()
    (d / f"alive.rank{D.DIST.rank}").write_text(str(alive))  # the stage's parameters still reachable


def last_barrier(seconds: float) -> None:
    """Rank 0 works `seconds` (as when it writes the final checkpoint: 177 GB at 14B) while rank 1 goes straight to
    close_distributed; the process group's timeout is 3 s here."""
    import time

    if D.DIST.rank == 0:
        time.sleep(seconds)
    D.close_distributed()


if __name__ == "__main__":
    if sys.argv[1] == "last_barrier":
        import datetime

        D.COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=3)
    D.init_distributed()
    if sys.argv[1] == "last_barrier":
        last_barrier(float(sys.argv[2]))
        D.exit_rank(0)
    if sys.argv[1] == "update":
        one_update(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "load":
        load_from_rank0(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "gather":
        gather_bf16(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "bf16_update":
        bf16_update(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "sft_grad":
        sft_gradients(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "sft_free":
        sft_stage_then_free(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "offload":
        offload_round_trip(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "sft":
        sft_steps(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        stage(sys.argv[2], sys.argv[3], int(sys.argv[4]), offload=sys.argv[5:] == ["offload"])
    D.close_distributed()
    D.exit_rank(0)
