"""scheduler.py - multi-turn tool rollouts and the load-balanced rollout scheduler.

Implements two parts of rStar2-Agent (arXiv 2508.20722):
  * section 2.1, multi-turn rollout and prompt: the model reasons, calls a Python tool with a JSON
    `<tool_call>`, reads the result inside `<tool_response>` in a user turn, and finally answers in
    `<answer> ... \\boxed{} ... </answer>`;
  * section 3.2, the load-balanced rollout scheduler: requests go to the inference engine with the most free
    KV-cache capacity, tool calls run asynchronously in the sandbox while other requests keep generating.

How data flows through one trajectory (token ids are never re-tokenized):

    render_prompt(problem)            -> prompt_ids                                     (no loss)
    engine.generate(ids, budget)      -> model segment: token ids + log-probs           (loss mask 1)
      ... stops at </tool_call> -> parse_tool_call(text) -> sandbox.run(code, input)
    tool_response_ids(result text)    -> inserted segment: "<|im_end|> user <tool_response> ... assistant"
                                                                                       (loss mask 0)
      ... repeat until <|im_end|> (answer), the length budget, or the turn limit
    Trajectory(prompt_ids, segments, finish_reason, tool statistics)

The trainer concatenates prompt_ids + segment ids, takes the loss only where loss_mask == 1, and reads the
statistics (tool calls, tool errors, answer tags, turns) for GRPO-RoC's penalty.

The trainer's API (one event loop, created once, owns the sandbox pool and every rollout step):

    loop = asyncio.new_event_loop(); loop.run_until_complete(pool.start())
    engines = [TransformersEngine(model, tokenizer, max_batch=16)]          # CPU: may share the trainer's model
    engines = VLLMEngine.launch(model_path, loop)                           # GPUs: one engine per GPU
    groups = run_rollouts(engines, pool, tokenizer, [(id, question), ...], n_per_problem, RolloutConfig(...),
                          seed=step_seed, loop=loop)                        # list[list[Trajectory]], in order
    sync_weights(engines, model)                                            # after each optimizer step

Reproducibility: each request samples with its own generator seeded from (seed, problem index, sample index,
turn), so a resumed run draws the same tokens; RolloutConfig(deterministic=True) also fixes the composition of
every batch (waves formed at barriers), making whole runs bit-identical at the cost of tool/generation overlap.

The load-balanced scheduler is measured in bench/bench_scheduler.py (simulated engines with finite KV caches,
against the paper's static allocation and a least-requests router) and bench/bench_rollout.py (real rollouts on
CPU against a turn-synchronous loop). vllm_engine.py says how to check it on a GPU box.

Modules (imports flow one way: protocol <- engines <- vllm_engine <- scheduler):
    protocol.py     the prompt, token encoding, Segment / Trajectory, count_answer_blocks (section 2.1)
    engines.py      GenRequest / GenResult, TransformersEngine, SimulatedEngine, virtual_time_loop
    slot_engine.py  TransformersEngine's forward: a Llama-family decoder over slot KV
    vllm_engine.py  VLLMEngine and its weight loader, placement, shutdown (vLLM imported only when used)
    scheduler.py    (this file) tool-call parsing and running, RolloutConfig, the Scheduler, the rollout loop,
                    sync_weights; it re-exports the names above, so `scheduler.X` works for all of them.
parse_tool_call stays here beside run_tool: together they are the tool call's handling (and one exercise of
classroom.py).
"""
from __future__ import annotations

import asyncio
import heapq
import json
from dataclasses import dataclass, field, replace
from typing import Callable

from engines import (GenRequest, GenResult, SimulatedEngine, TransformersEngine,  # noqa: F401 (re-exported)
                     eos_token_ids, finish_reason, request_seed, sample_rows, virtual_time_loop)
from protocol import (IM_END, IM_START, SYSTEM_PROMPT, TOOL_CALL_CLOSE, TOOL_CALL_OPEN,  # noqa: F401 (re-exported)
                      TOOL_NAME, TOOL_SCHEMA, Segment, Trajectory, count_answer_blocks, encode, encode_plain,
                      encode_tool_response, prompt_text, render_prompt, system_message, tool_response_text,
                      user_message)
from vllm_engine import (VLLMEngine, VLLMWeightLoader, generation_eos_ids,  # noqa: F401 (re-exported)
                         shutdown_engines, vllm_finish, vllm_placement, wants_vllm, weight_file_dir)

# ----------------------------------------------------------------------------------------------------------
# Parsing the model's tool call. A bad call never ends a rollout: it comes back to the model as an error text
# and counts as a tool error for RoC.


@dataclass(frozen=True)
class ToolCall:
    code: str | None     # None when the call is malformed
    stdin: str
    error: str | None    # the text returned to the model for a malformed call


def parse_tool_call(turn_text: str) -> ToolCall | None:
    """The last <tool_call>{...}</tool_call> of a model turn, or None when the turn holds no call: the body runs
    from the last opening tag before the last closing tag. (Read from the first opening tag on, "<tool_call> let me
    fix that <tool_call>{...}</tool_call>" was invalid JSON: the code never ran and RoC counted a tool error.)"""
    end = turn_text.rfind(TOOL_CALL_CLOSE)
    start = turn_text.rfind(TOOL_CALL_OPEN, 0, max(end, 0))
    if end < 0 or start < 0:
        return None
    body = turn_text[start + len(TOOL_CALL_OPEN):end].strip()
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(None, "", f"Error: the tool call is not valid JSON ({e.msg} at position {e.pos}).")
    if not isinstance(call, dict):
        return ToolCall(None, "", "Error: the tool call must be a JSON object with \"name\" and \"arguments\".")
    name = call.get("name")
    if name != TOOL_NAME:
        return ToolCall(None, "", f"Error: unknown function {name!r}; the only function is {TOOL_NAME}.")
    args = call.get("arguments")
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = None
    if not isinstance(args, dict):
        return ToolCall(None, "", "Error: \"arguments\" must be an object with \"code\" and \"input\".")
    code, stdin = args.get("code"), args.get("input", "")
    if not isinstance(code, str) or not code.strip():
        return ToolCall(None, "", "Error: missing required argument \"code\" (a string of Python code).")
    if stdin is None:
        stdin = ""
    if not isinstance(stdin, str):
        return ToolCall(None, "", "Error: argument \"input\" must be a string.")
    return ToolCall(code, stdin, None)


# ----------------------------------------------------------------------------------------------------------
# Rollout configuration (paper defaults; the trainer's presets override them per stage)


@dataclass
class RolloutConfig:
    max_turns: int = 10              # assistant turns (paper: 10 in stages 1-2, 15 in stage 3, 30 at evaluation)
    max_response_tokens: int = 8192  # budget for everything after the prompt, inserted tool tokens included
    temperature: float = 1.0         # paper: 1.0 for training rollouts, 0.6 at evaluation
    top_p: float = 1.0
    tool_timeout_s: float = 10.0
    # deterministic=True forms generation waves at barriers: the scheduler waits until every unfinished
    # trajectory is waiting for generation, then hands out the waiting requests in (problem, sample) order.
    # Results are then bit-identical across runs (with the same engines and threads), at the cost of overlap:
    # no engine generates while any tool call is running. The default overlaps tools and generation and is
    # reproducible per request (each request samples with its own seed) up to floating-point noise that the
    # composition of a batch can add to its logits. Tool execution times are shown as 0.00s in this mode (they
    # would change the text); a call that runs close to its timeout can still differ. Applies to routing "kv".
    deterministic: bool = False
    # "kv": ours (paper 3.2): the engine with the most free KV capacity, only when the request fits.
    # "least_requests" and "static" are the baselines that bench/bench_scheduler.py compares against:
    # the engine holding the fewest requests, or a fixed contiguous share of the rollouts per engine (the
    # paper's "static allocation"); both send at once, whether or not the request fits.
    routing: str = "kv"
    # A continuation after a tool call stays on the engine that holds its prefix (its KV cache can be reused)
    # unless that engine has less free capacity than the best one by more than this fraction of its capacity.
    prefix_affinity: float = 0.25
    # A continuation whose previous engine is full for now waits for that engine (keeping its cached prefix)
    # unless that engine is overloaded by the rule above; requests behind it may use the other engines.
    prefix_wait: bool = True
    # Reserve KV for at most this many new tokens per request (0: the turn's whole remaining budget). A turn
    # that needs more continues in a new request, preferably on the same engine, where its prefix is cached.
    # Smaller reservations let an engine run more sequences at once without ever overflowing (the reservation
    # still covers everything a request can write); the price is one more admission per chunk. Worth it where
    # the engine keeps a prefix cache (vLLM); on the CPU engine a continuation re-reads its context.
    chunk_tokens: int = 0
    # At most this many requests held per engine (0: no cap). Past its saturation point an engine's throughput
    # stays flat while each sequence slows down, so extra sequences only stretch the longest trajectories.
    max_requests_per_engine: int = 0
    # The tool's state across a trajectory's calls (sandbox.py): stateless (the paper's: each call a fresh process)
    # | replay (earlier successful calls rerun before each call) | persistent (one live Python session per
    # trajectory, failed calls rolled back). A stateful tool is named in the prompt (protocol.TOOL_STATE_LINES).
    tool_state: str = "stateless"
    # A tool call running longer than this (seconds) holds one of the CPU engine's cores until it returns: the
    # engine decodes on one thread fewer meanwhile (engines.py, TransformersEngine._threads_for). A negative value:
    # never (the decode keeps all its threads and shares their cores with the calls).
    tool_core_after_s: float = 0.05


# ----------------------------------------------------------------------------------------------------------
# The load-balanced rollout scheduler (paper section 3.2)
#
# Every trajectory is a coroutine. Each assistant turn is one generation request; the scheduler keeps the
# requests that cannot be placed yet in a waiting queue and places them in order:
#   * to the engine with the most free KV capacity, and only when prompt + remaining budget fits there, so no
#     engine is ever overfilled (no preemption, no recomputation);
#   * a continuation prefers the engine that already holds its prefix, unless that engine is overloaded;
#   * when a turn ends in a tool call, the engine's capacity is released at once, the call runs in the sandbox
#     pool while other requests generate, and the continuation is queued again when the result arrives;
#   * continuations go before new trajectories (they hold progress; finishing them shortens the step's tail).


class Scheduler:
    def __init__(self, engines: list, cfg: RolloutConfig, num_problems: int, n_per_problem: int):
        self.engines, self.cfg = engines, cfg
        self.n_per_problem = n_per_problem
        self.num_trajectories = num_trajectories = num_problems * n_per_problem
        self.waiting: list = []        # heap of (priority, order, request, previous engine, future)
        self.busy = num_trajectories   # trajectories neither waiting here nor finished (deterministic barriers)
        self._order = 0

    def pick_engine(self, req: GenRequest, previous: int | None, blocked: frozenset = frozenset()) -> int | None:
        """The engine with the most free capacity among those the request fits in (ties: lowest index);
        the previous engine when it fits and is within `prefix_affinity` of the best; None when none fits.
        Engines in `blocked` are held for a request ahead in the queue: this one may not take them.

        A request reserves its context plus every token it may write (req.need). An engine cannot be told to
        pause a sequence, so this is the only admission rule under which its KV cache can never overflow,
        whatever the lengths turn out to be. cfg.chunk_tokens keeps each reservation small."""
        free = [e.free_tokens() for e in self.engines]
        cap = self.cfg.max_requests_per_engine
        fits = [i for i in range(len(self.engines)) if i not in blocked
                and req.need <= free[i] and (cap <= 0 or self.engines[i].num_requests() < cap)]
        if not fits:
            return None
        best = max(fits, key=lambda i: (free[i], -i))
        if previous in fits and self.near_best(previous, free[best]):
            return previous
        if previous is not None and previous not in fits and self.cfg.prefix_wait and \
                self.near_best(previous, free[best]):
            return None  # its prefix is cached there and that engine is not overloaded: wait for it
        return best

    def near_best(self, i: int, best_free: int) -> bool:
        """Engine i has at most `prefix_affinity` of its capacity less free than the best engine."""
        return self.engines[i].free_tokens() >= best_free - self.cfg.prefix_affinity * self.engines[i].capacity_tokens

    def engines_awaited(self, previous: int | None) -> set[int]:
        """The engines a request that could not be placed waits for: its previous engine when it waits to keep
        its cached prefix, else all of them (it takes the first with room, in queue order)."""
        if previous is not None and self.cfg.prefix_wait:
            free = [e.free_tokens() for e in self.engines]
            if self.near_best(previous, max(free)):
                return {previous}
        return set(range(len(self.engines)))

    async def generate(self, req: GenRequest, previous: int | None) -> tuple[GenResult, int]:
        """Generate one turn; returns the result and the engine that produced it."""
        loop = asyncio.get_running_loop()
        out = loop.create_future()
        problem, sample, turn = req.key
        if self.cfg.routing == "static":   # baseline: a fixed contiguous share of the rollouts per engine
            index = problem * self.n_per_problem + sample
            self._send(req, index * len(self.engines) // self.num_trajectories, out)
        elif self.cfg.routing == "least_requests":  # baseline: fewest requests held, fits or not
            counts = [e.num_requests() for e in self.engines]
            self._send(req, counts.index(min(counts)), out)
        elif self.cfg.routing == "kv":
            if self.cfg.deterministic:
                priority = (problem, sample)
            else:  # continuations (after a tool call, or the next chunk of a turn) first
                priority = (0 if turn > 0 or req.turn_offset > 0 else 1, self._order)
            self._order += 1
            heapq.heappush(self.waiting, (priority, self._order, req, previous, out))
            self.busy -= 1
            self.dispatch()
        else:
            raise ValueError(f"unknown routing {self.cfg.routing!r} (kv | least_requests | static)")
        return await out

    def dispatch(self) -> None:
        """Place waiting requests in queue order. A request that fits nowhere holds the engines it waits for
        (all of them, or only its previous engine when it waits to reuse its cached prefix there): requests
        behind it may not overtake it on those engines, so nothing is starved, but may use the others.
        Deterministic mode places only at barriers."""
        if self.cfg.deterministic and self.busy > 0:
            return
        blocked: set[int] = set()
        skipped = []
        while self.waiting and len(blocked) < len(self.engines):
            item = heapq.heappop(self.waiting)
            _, _, req, previous, out = item
            i = self.pick_engine(req, previous, frozenset(blocked))
            if i is None:
                skipped.append(item)
                blocked |= self.engines_awaited(previous)
                continue
            self.busy += 1
            self._send(req, i, out)
        for item in skipped:
            heapq.heappush(self.waiting, item)

    def _send(self, req: GenRequest, i: int, out: asyncio.Future) -> None:
        def done(inner: asyncio.Future) -> None:
            if out.done():  # the trajectory was cancelled meanwhile
                pass
            elif inner.exception() is not None:
                out.set_exception(inner.exception())
            else:
                out.set_result((inner.result(), i))
            self.dispatch()  # the engine's capacity is free again

        self.engines[i].submit(req).add_done_callback(done)

    def trajectory_done(self) -> None:
        self.busy -= 1
        self.dispatch()


def session_slots(pool, cfg: RolloutConfig) -> asyncio.Semaphore | None:
    """With persistent sessions, at most the pool's max_sessions trajectories run at once (the others wait to
    start): past it the pool would refuse their sessions. None: no bound."""
    limit = getattr(getattr(pool, "config", None), "max_sessions", 0) if cfg.tool_state == "persistent" else 0
    return asyncio.Semaphore(limit) if limit > 0 else None


def open_tool(pool, tool_state: str):
    """A trajectory's tool: the pool itself for the stateless tool, else a session of it (pool.session)."""
    return pool if tool_state == "stateless" else pool.session(tool_state)


async def close_tool(tool) -> None:
    """End a trajectory's session (its processes go now); a failure to close ends nothing else."""
    try:
        await tool.close()
    except Exception:  # noqa: BLE001 - the pool is closing, or the worker died with the session
        pass


async def run_tool(pool, call: ToolCall, cfg: RolloutConfig) -> tuple[str, str]:
    """Run one tool call in the sandbox pool: (the text inside <tool_response>, status). A malformed call
    returns its error text without running anything."""
    from sandbox import format_tool_response

    if call.code is None:
        return call.error, "malformed"
    result = await pool.run(call.code, call.stdin, timeout_s=cfg.tool_timeout_s)
    if cfg.deterministic:  # the execution time would make the text (and so the tokens) differ between runs
        result = replace(result, duration_s=0.0)
    return format_tool_response(result), result.status


async def generate_turn(sched: Scheduler, tokenizer, cfg: RolloutConfig, context: list[int], budget: int,
                        engine: int | None, seed: int, problem_index: int, sample_index: int,
                        turn: int) -> tuple[GenResult, int]:
    """One assistant turn: a single request, or with cfg.chunk_tokens a chain of requests of at most that many
    new tokens each, the next one continuing where the last stopped for length. Returns the whole turn."""
    ids, lps, chunk = [], [], 0
    while True:
        left = budget - len(ids)
        req = GenRequest(context + ids, min(left, cfg.chunk_tokens) if cfg.chunk_tokens > 0 else left,
                         cfg.temperature, cfg.top_p, request_seed(seed, problem_index, sample_index, turn, chunk),
                         (problem_index, sample_index, turn), turn_offset=len(ids))
        result, engine = await sched.generate(req, engine)
        ids += result.token_ids
        lps += result.logprobs
        end = tool_call_end(tokenizer, ids)
        if end is not None:  # cut where the first call completed, even if an engine saw only part of it
            return GenResult(ids[:end], lps[:end], "tool"), engine
        if result.finish != "length" or len(ids) >= budget:
            break
        chunk += 1
    return GenResult(ids, lps, result.finish), engine


def tool_call_end(tokenizer, ids: list[int]) -> int | None:
    """How many tokens of a turn run up to and including its first complete "</tool_call>", or None.

    An engine stops a request at "</tool_call>" only when it sees the whole tag in that request's own tokens: a
    tag split across two chunks of a turn (cfg.chunk_tokens) is seen by neither, and the turn would run on to a
    second call. Looking at the turn as a whole puts the stop exactly where an engine that generated the whole
    turn in one request would have put it."""
    def decode(part):
        return tokenizer.decode(part, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    if TOOL_CALL_CLOSE not in decode(ids):
        return None
    for k in range(1, len(ids) + 1):  # every token holds at least one character: a window of len(tag) suffices
        if TOOL_CALL_CLOSE in decode(ids[max(0, k - len(TOOL_CALL_CLOSE)):k]):
            return k
    return None



async def rollout_one(sched: Scheduler, pool, tokenizer, cfg: RolloutConfig, seed: int, problem_index: int,
                      sample_index: int, problem_id: str, prompt_ids: list[int]) -> Trajectory:
    """One multi-turn trajectory: generate, run the tool call, insert its result, ... until the end of turn,
    the length budget or the turn limit."""
    traj = Trajectory(problem_id, list(prompt_ids))
    context = list(prompt_ids)
    model_text = []
    engine = None
    tool = open_tool(pool, cfg.tool_state)  # this trajectory's tool: its session lives until the trajectory ends
    try:
        for turn in range(cfg.max_turns):
            budget = cfg.max_response_tokens - traj.num_response_tokens
            if budget <= 0:
                traj.finish_reason = "length"
                break
            result, engine = await generate_turn(sched, tokenizer, cfg, context, budget, engine,
                                                 seed, problem_index, sample_index, turn)
            traj.turns += 1
            traj.engines.append(engine)
            traj.segments.append(Segment(list(result.token_ids), 1, list(result.logprobs)))  # eos kept
            context += result.token_ids
            text = tokenizer.decode(result.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            model_text.append(text)
            if result.finish == "eos":
                traj.finish_reason = "answer"  # ended its turn without a tool call, answer or not
                break
            if result.finish == "length":
                traj.finish_reason = "length"
                break
            if turn + 1 == cfg.max_turns:  # the last allowed turn ended in a call: it is not run
                traj.finish_reason = "turns"
                break
            call = parse_tool_call(text) or ToolCall(
                None, "", f"Error: the turn ended at {TOOL_CALL_CLOSE} without a matching {TOOL_CALL_OPEN}.")
            response, status = await run_tool(tool, call, cfg)
            traj.tool_calls += 1
            traj.tool_errors += status != "ok"
            traj.tool_statuses[status] = traj.tool_statuses.get(status, 0) + 1
            inserted = encode_tool_response(tokenizer, response)
            if len(inserted) > cfg.max_response_tokens - traj.num_response_tokens:
                traj.finish_reason = "length"  # the tool's answer does not fit in the budget
                break
            traj.segments.append(Segment(inserted, 0))
            context += inserted
    except Exception as e:  # an engine or sandbox failure ends this trajectory only
        traj.finish_reason, traj.error = "error", f"{type(e).__name__}: {e}"
    finally:
        sched.trajectory_done()
        if tool is not pool:
            await close_tool(tool)
    traj.response_text = tokenizer.decode(traj.response_ids, skip_special_tokens=False,
                                          clean_up_tokenization_spaces=False)
    traj.model_text = "".join(model_text)
    traj.answer_tags = count_answer_blocks(traj.model_text)
    return traj


@dataclass
class Retry:
    """A problem whose group is all wrong is sampled again the moment its group is graded, while the other groups
    still run (rstar2_mini's retry_all_wrong: waiting for the round's end left the engine mostly empty for a
    second ramp): attempt a draws with seeds[a] for the same problem index. grade(problem index, group) sets each
    trajectory's reward; spent collects (problem index, replaced group). In the barrier mode (deterministic) the
    retries start after the round, so the waves stay reproducible."""
    grade: Callable
    seeds: list
    spent: list = field(default_factory=list)


async def rollout_groups(engines: list, pool, tokenizer, problems: list[tuple[str, str]], n_per_problem: int,
                         cfg: RolloutConfig, seed: int, progress: bool = True,
                         retry: Retry | None = None) -> list[list[Trajectory]]:
    """All n_per_problem trajectories of every problem, concurrently. Returns groups in problem order, each
    group in sample order (a retried problem's last group). Runs on the caller's event loop (the one the sandbox
    pool lives on)."""
    from tqdm.auto import tqdm

    prompts = [render_prompt(tokenizer, question, cfg.tool_state) for _, question in problems]
    biggest = max(e.capacity_tokens for e in engines)
    if prompts and max(map(len, prompts)) + cfg.max_response_tokens > biggest:
        raise ValueError(f"a prompt of {max(map(len, prompts))} tokens plus the {cfg.max_response_tokens}-token "
                         f"budget does not fit in any engine's KV capacity ({biggest} tokens)")
    sched = Scheduler(engines, cfg, len(problems), n_per_problem)
    for e in engines:   # the CPU engine decodes on the cores the sandbox's running calls leave it
        if hasattr(e, "cores_taken") and hasattr(pool, "calls_running"):
            after = cfg.tool_core_after_s
            e.cores_taken = (lambda: pool.calls_running(after)) if after >= 0 else None
    bar = tqdm(total=len(problems) * n_per_problem, desc="rollouts", unit="traj", disable=not progress)
    round_done, first_rounds = asyncio.Event(), [len(problems)]

    slots = session_slots(pool, cfg)

    async def sample(pi: int, seed_: int) -> list[Trajectory]:
        async def one(si: int) -> Trajectory:
            if slots is None:
                traj = await rollout_one(sched, pool, tokenizer, cfg, seed_, pi, si, problems[pi][0], prompts[pi])
            else:  # a persistent session each: no more trajectories at once than the pool holds sessions
                sched.busy -= 1  # (waiting for a slot is not running: deterministic waves form without it)
                sched.dispatch()
                async with slots:
                    sched.busy += 1
                    traj = await rollout_one(sched, pool, tokenizer, cfg, seed_, pi, si, problems[pi][0],
                                             prompts[pi])
            bar.update(1)
            return traj
        return list(await asyncio.gather(*(one(si) for si in range(n_per_problem))))

    async def group(pi: int) -> list[Trajectory]:
        trajs = await sample(pi, seed)
        if retry is None:
            return trajs
        retry.grade(pi, trajs)
        first_rounds[0] -= 1
        if first_rounds[0] == 0:
            round_done.set()
        for seed_ in retry.seeds:
            if any(t.reward > 0 for t in trajs):
                break
            if cfg.deterministic:
                await round_done.wait()
            retry.spent.append((pi, trajs))
            sched.busy += n_per_problem     # trajectories neither waiting nor finished (the barrier's count)
            bar.total += n_per_problem
            trajs = await sample(pi, seed_)
            retry.grade(pi, trajs)
        return trajs

    try:
        groups = await asyncio.gather(*(group(pi) for pi in range(len(problems))))
        await asyncio.gather(*(e.worker for e in engines if getattr(e, "worker", None) and not e.worker.done()))
    finally:
        bar.close()
    return list(groups)


def run_rollouts(engines: list, pool, tokenizer, problems: list[tuple[str, str]], n_per_problem: int,
                 cfg: RolloutConfig, seed: int, progress: bool = True,
                 loop: asyncio.AbstractEventLoop | None = None, retry: Retry | None = None) -> list[list[Trajectory]]:
    """Synchronous entry point for the trainer: loop.run_until_complete(rollout_groups(...)). Pass the event loop
    that the sandbox pool was started on and keep it across steps; without one, a fresh loop is used and closed
    (only for pools that are not bound to a loop)."""
    coro = rollout_groups(engines, pool, tokenizer, problems, n_per_problem, cfg, seed, progress, retry)
    if loop is not None:
        return loop.run_until_complete(coro)
    fresh = asyncio.new_event_loop()
    try:
        return fresh.run_until_complete(coro)
    finally:
        fresh.close()


def stop_rollouts(engines: list, loop: asyncio.AbstractEventLoop) -> None:
    """The end of a stage, or of a command that Ctrl-C (or an error) stopped mid-phase: stop what the engines run
    beside the caller (vLLM's processes, the CPU engine's decode thread), then cancel what a phase left pending on
    the loop (its trajectories, an engine's worker) and let them unwind, as asyncio.run does before it closes its
    loop; left pending, each is reported at exit ("Task was destroyed but it is pending!"). After a phase that
    ended normally nothing is pending and only the engines stop."""
    shutdown_engines(engines)
    left = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in left:
        task.cancel()
    if left and not loop.is_closed():
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))


def occupancy_stats(engines: list, reset: bool = False) -> dict:
    """The rollout phase's occupancy for metrics.jsonl, over the engines that trace it (TransformersEngine): decode
    iterations, busy rows per iteration (mean, against engine_slots), longest own context per iteration (mean), own
    columns a row's decode attention read per iteration (mean: masked ones included), ms per iteration; the tokens
    prefilled (admitted rows' contexts: prompts past the shared prefix, tool responses) and the seconds of the
    iterations that prefilled; the context tokens copied instead (a question's samples admitted together); the
    decode's threads per iteration (mean: fewer than torch's while the sandbox's calls held cores).
    reset=True starts a new phase."""
    traced = [e for e in engines if hasattr(e, "occupancy")]
    if reset:
        for e in traced:
            e.reset_occupancy()
        return {}
    if not traced:
        return {}
    occ = [e.occupancy() for e in traced]
    n = sum(o["iterations"] for o in occ) or 1
    return {"rollout_iterations": sum(o["iterations"] for o in occ),
            "rollout_rows_mean": round(sum(o["rows_mean"] * o["iterations"] for o in occ) / n, 2),
            "rollout_columns_mean": round(sum(o["columns_mean"] * o["iterations"] for o in occ) / n, 1),
            "rollout_read_mean": round(sum(o["read_mean"] * o["iterations"] for o in occ) / n, 1),
            "rollout_ms_per_iteration": round(sum(o["ms_per_iteration"] * o["iterations"] for o in occ) / n, 1),
            "rollout_prefill_tokens": sum(o["prefill_tokens"] for o in occ),
            "rollout_prefill_iterations": sum(o["prefill_iterations"] for o in occ),
            "rollout_prefill_s": round(sum(o["prefill_seconds"] for o in occ), 2),
            "rollout_copied_tokens": sum(o["copied_tokens"] for o in occ),
            "rollout_threads_mean": round(sum(o["threads_mean"] * o["iterations"] for o in occ) / n, 2),
            "engine_slots": sum(o["slots"] for o in occ)}


def sync_weights(engines: list, weights) -> None:
    """Send the trainer's new weights (a model or a state dict) to every engine, once per engine backend
    (the VLLMEngine handles of one launch share a backend that broadcasts to all its GPUs)."""
    seen = set()
    for engine in engines:
        backend = getattr(engine, "backend", engine)
        if id(backend) not in seen:
            seen.add(id(backend))
            engine.load_weights(weights)
