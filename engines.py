"""engines.py - the in-process inference engines behind the rollout scheduler (paper section 3.2, engines).

Data flow: scheduler.py's Scheduler places a GenRequest (context ids, budget, sampling seed) on an engine with
engine.submit(req); the engine generates one turn (or one chunk of it) and resolves the future with a GenResult
(token ids, their log-probs under log_softmax(logits / T), why it stopped: "eos" | "tool" | "length"), which
rollout_one appends to the Trajectory (protocol.py). Engines never import the scheduler.

  * TransformersEngine: continuous batching on a Hugging Face Llama-family model in a hand-written decode loop
    (CPU, single-GPU debugging); its forward over slot KV is slot_engine.py;
  * SimulatedEngine + virtual_time_loop: a cost model of a GPU engine in virtual time, for
    bench/bench_scheduler.py and the scheduler tests only;
  * VLLMEngine (one per GPU) lives in vllm_engine.py, which needs vLLM.
"""
from __future__ import annotations

import asyncio
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from model import release_freed_memory
from protocol import TOOL_CALL_CLOSE, render_prompt

# ----------------------------------------------------------------------------------------------------------
# Inference engines: one small duck-typed interface shared by TransformersEngine (CPU, single-GPU debug),
# VLLMEngine (one per GPU, vllm_engine.py) and SimulatedEngine (benchmarks and scheduler tests). No base class:
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
#   engine.shutdown()           (where the engine has a thread or processes of its own) stop them: at a stage's
#                               end, and after Ctrl-C left a rollout phase mid-way (scheduler.stop_rollouts)
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


TURN_END = "<|im_end|>"  # ChatML's end of a turn: what the SFT teaches the policy to write (protocol.py)


def eos_token_ids(tokenizer, model=None) -> set[int]:
    """End-of-turn tokens: the tokenizer's eos, the model's generation eos, and <|im_end|> whenever the vocabulary
    has it. An instruct checkpoint's eos is <|im_end|> already; a base checkpoint's (Qwen3-*-Base, the paper's
    starting point) is <|endoftext|>, so without the third every SFT-taught turn would run to the length budget."""
    ids = {tokenizer.eos_token_id}
    turn_end = tokenizer.convert_tokens_to_ids(TURN_END)  # unk (or None) in a vocabulary without it
    if turn_end is not None and tokenizer.convert_ids_to_tokens(turn_end) == TURN_END:
        ids.add(turn_end)
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return {i for i in ids if i is not None}


def sample_rows(logits, temperatures, top_ps, generators):
    """Sample one token per row, each row with its own generator. Returns (tokens, logprobs) as lists.

    logp = log_softmax(logits / T) is the log-probability the trainer computes for the same token (the
    importance ratio's denominator); top-p only narrows the set the token is drawn from (nucleus sampling),
    as vLLM does; with top_p = 1 the two distributions are the same. T <= 0 means greedy.

    Inverse CDF (multinomial draws 49K exponentials a row: 8% of a step), all rows of top_p = 1 at once: one
    float64 uniform u from each row's generator, token k of the row for u * cdf[-1] in [cdf[k-1], cdf[k])
    (inverse_cdf). Sums and u in float64: in float32 the sum's step near its top is 6e-8, so at 49,152 tokens
    hundreds to tens of thousands of them had an interval of width 0 (never drawn) and others were rounded up
    (total variation 3e-4 from the softmax); float32's u reaches only 2^24 points. In float64 both steps are
    ~1e-16 (tests/test_scheduler.py). Row by row the same arithmetic gives the same tokens (tests/test_engine.py)."""
    import torch

    if all(t == 1.0 or t <= 0 for t in temperatures):                   # x / 1 = x: no division
        logp = torch.log_softmax(logits, dim=-1)
    else:
        temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], dtype=logits.dtype, device=logits.device)
        logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    greedy = any(t <= 0 for t in temperatures)
    tokens = torch.argmax(logp, dim=-1) if greedy else torch.zeros(len(generators), dtype=torch.long,
                                                                    device=logp.device)  # greedy rows keep these
    drawn = [b for b, (t, p) in enumerate(zip(temperatures, top_ps)) if t > 0 and p >= 1.0]
    if drawn:
        idx = torch.tensor(drawn, device=logp.device)
        part = logp if len(drawn) == len(generators) else logp[idx]
        u = torch.cat([torch.rand(1, generator=generators[b], device=logp.device, dtype=torch.float64)
                       for b in drawn])
        tokens[idx] = inverse_cdf(part.exp(), u)                          # exp in float32: relative error 6e-8 each
    for b, (t, p) in enumerate(zip(temperatures, top_ps)):  # nucleus: the fewest most likely tokens of mass p
        if t > 0 and p < 1.0:
            probs, order = torch.sort(logp[b].exp(), descending=True)
            keep = (torch.cumsum(probs, 0) - probs) < p  # always keeps the most likely token
            tokens[b] = order[torch.multinomial(probs * keep, 1, generator=generators[b])]
    lps = logp.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), lps.tolist()


CDF_BLOCK = 1024   # tokens in a block of inverse_cdf: 48 blocks at SmolLM2's 49,152


def inverse_cdf(probs, u):
    """Token k of each row for u * cdf[-1] in [cdf[k-1], cdf[k]), cdf the float64 cumulative sum of the row's
    probs [R, V] (unnormalized, >= 0), u [R] float64 in [0, 1). Returns [R] token ids.

    In two levels, as one cumulative sum over the whole row would give them: the block of CDF_BLOCK tokens that
    holds the point, from the blocks' float64 sums (S_j, edges E_j = S_1 + ... + S_j, point u * E_last); then
    the token inside that block, from the block's own float64 cumulative sum against point - E_(j-1). torch's
    float64 cumsum runs element by element and makes float64 copies of the whole [R, V]; the block sums are
    vectorized (bench/bench_decode_parts.py: 0.50 against 0.62 ms at 20 rows, 1.17 against 1.85 at 48, the same
    at 4; alone, with fresh pages for its copies, the whole-row sum took up to 7 ms at 20 rows). The two sums
    differ from one running sum in their last bits only (~1e-16 of the total): a point that close to an
    interval's edge is the only case that could draw the neighbour (tests/test_engine.py: the same tokens over
    60,000 points and 9,000 interval midpoints)."""
    import torch
    import torch.nn.functional as F

    R, V = probs.shape
    K = CDF_BLOCK
    blocks = -(-V // K)
    if blocks * K != V:
        probs = F.pad(probs, (0, blocks * K - V))                          # zeros: never drawn
    probs = probs.reshape(R, blocks, K)
    # [R, blocks] E_j, eight rows at a time: the float64 copy of its input that sum makes (19 MB for 48 rows) came
    # fresh from the system at every call (sample_rows at 20-64 rows: 6-16 ms with one copy, 3.5-5.7 ms with 3 MB ones)
    edges = torch.cat([part.sum(-1, dtype=torch.float64) for part in probs.split(8)]).cumsum(-1)
    point = u * edges[:, -1]
    j = torch.searchsorted(edges, point[:, None], right=True)[:, 0].clamp_(max=blocks - 1)
    rows = torch.arange(R, device=probs.device)
    before = torch.where(j > 0, edges[rows, (j - 1).clamp(min=0)], 0.0)  # E_(j-1)
    inside = torch.cumsum(probs[rows, j], -1, dtype=torch.float64)       # [R, K] the block's own cdf
    # below the block's own total: its last bits may fall short of S_j, and the point must land in the block
    rest = torch.minimum(point - before, torch.nextafter(inside[:, -1], torch.zeros_like(point)))
    k = torch.searchsorted(inside, rest[:, None], right=True)[:, 0]
    return (j * K + k).clamp_(max=V - 1)


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
    """In-process engine on a Hugging Face Llama-family causal LM (CPU, single-GPU debugging): continuous batching
    over slot KV (slot_engine.py), with the shared system prompt computed once.

    One decode thread runs the batch, up to max_batch rows, row i in KV slot i. Every iteration it admits waiting
    requests into the free slots, then runs one forward over every row's pending tokens (one sampled token for a
    decoding row; for an admitted row the part of its context no KV covers), samples every row at once and checks
    every row's stop. A row leaves the moment it stops and its future resolves then, so its tool call starts while
    the others keep decoding; the last row moves into its slot (one row's KV). A row stopped at a tool call hands
    its KV to the engine, and its continuation, admitted like any request, prefills only the tool's response and
    what follows. Requests admitted together with the same context (the samples of one question) prefill it once:
    the others copy its KV columns and last logits. Every row samples with its request's own generator, so its
    tokens do not depend on which other requests share the batch. The decode runs in a worker thread, so the
    event loop keeps serving tool results.

    Positions count real tokens only (no padding anywhere), so each row sees the positions of a plain forward of
    its own context. A row whose context does not start with the shared prefix masks the prefix and keeps its whole
    context in its own columns. engine.trace (set it to a list) records every iteration's busy rows, their longest
    own context, the own columns its decode attention read, the tokens forwarded (and of them, prefilled: admitted
    rows' contexts), the rows admitted as copies of another's context, and the milliseconds; occupancy()
    summarizes the iterations since the last reset_occupancy()."""

    def __init__(self, model, tokenizer, max_batch: int = 16, kv_capacity_tokens: int = 65536,
                 device: str = "cpu", share_prefix: bool = True, tool_state: str = "stateless"):
        from slot_engine import SlotDecoder

        self.model = model.to(device)
        self.decoder = SlotDecoder(self.model, max_batch, device)   # refuses a model it does not implement
        self._stale = True                # the decoder's operands must be rebuilt from the model's weights
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.capacity_tokens = kv_capacity_tokens
        self.device = device
        self.eos_ids = eos_token_ids(tokenizer, model)
        # the prompt names a stateful tool in the system message, so the prefix is that of the run's tool state
        self.prefix_ids = shared_prompt_prefix(tokenizer, tool_state) if share_prefix else []
        self._prefix_kv = None            # [layers, 2, kv heads, P, head dim] of prefix_ids, current weights
        # the KV of rows that stopped at a tool call, until their continuation comes: {(problem, sample):
        # (context ids it covers, has_prefix, [layers, 2, kv heads, n, head dim])}; dropped at a weight sync
        self._kept_kv: OrderedDict = OrderedDict()
        self._stop_tokens: dict[str, set] = {}   # stop text -> the tokens whose text holds its last character
        self.reused_tokens = 0            # prefill tokens taken from _kept_kv instead of recomputed
        self._queue: list[tuple[GenRequest, asyncio.Future]] = []
        self._lock = threading.Lock()     # guards _queue and _looping between the event loop and the decode thread
        self._looping = False             # whether a decode loop is running (or about to)
        self._in_flight: list = []        # items of the rows in the running batch (failed if the loop raises)
        self._reserved = 0
        self._held = 0
        self.worker: asyncio.Task | None = None
        self._weights_lock = threading.Lock()  # a weight sync waits for the running decode loop
        self._shut = threading.Event()    # shutdown(): the decode thread ends at its next iteration
        self.tokens_generated = 0
        self.waves = 0                    # iterations that admitted requests
        self.prefill_tokens = 0           # tokens prefilled (the shared prefix excluded)
        self.trace: list | None = None    # set to [] to record every iteration (see the class docstring)
        # () -> how many cores other work holds now (the sandbox's running calls: scheduler.rollout_groups sets it
        # on a CPU engine); each iteration decodes on torch's threads less that many, at least one (_threads_for)
        self.cores_taken: Callable[[], int] | None = None
        self.reset_occupancy()

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
        """Copy new weights into the engine's model in place (no re-allocation). `weights` is a state dict, a
        model, or (name, tensor) pairs (distributed.gathered_weights); when it is the engine's own model (the CPU
        trainer may share it) there is nothing to copy. Either way the decoder's operands (fused, prepacked copies)
        are rebuilt before the next decode, and the cached KV (the shared prefix's, the rows kept at a tool call)
        belongs to the old weights and is dropped."""
        import torch

        with self._weights_lock:
            self._prefix_kv = None
            self._kept_kv.clear()
            self._stale = True
            if weights is self.model:
                return
            state = weights.state_dict() if hasattr(weights, "state_dict") else weights
            pairs = state.items() if hasattr(state, "items") else state   # (or (name, tensor) pairs, streamed)
            state = {k.removeprefix("module."): v for k, v in pairs}  # DDP / accelerate wrappers
            with torch.no_grad():
                self.model.load_state_dict(state, strict=True)  # copy_() into the existing tensors

    def shutdown(self) -> None:
        """End the decode thread at its next iteration, for good: every request it holds or is given later fails.
        After Ctrl-C the main thread leaves the event loop mid-phase while this thread would go on until each of its
        rows had ended (up to a turn's whole budget: a minute and more on a CPU), and the process cannot exit before
        it (concurrent.futures joins its threads at exit). At a stage's end the thread is idle: nothing to stop."""
        self._shut.set()

    def release_operands(self) -> None:
        """Let go of what the next weight sync makes stale anyway, before the update runs (phases.for_update): the
        decoder's fused and prepacked copies of the weights (as large as the model in the engine's dtype), the
        shared prefix's KV, and the KV kept for rows stopped at a tool call whose continuation never came (the
        step's rollouts are over). The next decode rebuilds the first two from the model, as after a sync."""
        with self._weights_lock:
            self.decoder.layers = self.decoder.head = None
            self._prefix_kv = None
            self._kept_kv.clear()
            self._stale = True
        release_freed_memory()

    def reset_occupancy(self) -> None:
        self._occ = {"iterations": 0, "rows": 0, "columns": 0, "read": 0, "seconds": 0.0, "tokens": 0,
                     "prefill_tokens": 0, "prefill_iterations": 0, "prefill_seconds": 0.0, "copied_tokens": 0,
                     "threads": 0}

    def occupancy(self) -> dict:
        """The iterations since reset_occupancy(): how many, busy rows, longest own context and own columns read
        by a row's decode attention per iteration (means), milliseconds per iteration, tokens forwarded (sampled
        and prefilled); of those, the prefilled ones (admitted rows' contexts: prompts past the shared prefix,
        tool responses), and the iterations that prefilled any, with their seconds; and the context tokens not
        prefilled because a row admitted with them had the same context (copied_tokens: a question's samples); the
        decode's threads per iteration (mean: fewer than torch's while tool calls held cores)."""
        o, n = self._occ, max(self._occ["iterations"], 1)
        return {"iterations": o["iterations"], "rows_mean": o["rows"] / n, "columns_mean": o["columns"] / n,
                "read_mean": o["read"] / n, "ms_per_iteration": 1000 * o["seconds"] / n, "tokens": o["tokens"],
                "slots": self.max_batch, "prefill_tokens": o["prefill_tokens"],
                "prefill_iterations": o["prefill_iterations"], "prefill_seconds": o["prefill_seconds"],
                "copied_tokens": o["copied_tokens"], "threads_mean": o["threads"] / n}

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
        import time

        import torch

        rows: list[_Row] = []             # rows[i] holds KV slot i
        self._in_flight = []
        base = threads = torch.get_num_threads()   # this thread's team: one thread a core unless set otherwise
        with self._weights_lock, torch.inference_mode():
            if self._stale:
                self.decoder.refresh()
                self._stale = False
            self.decoder.cache = self.decoder.new_cache()
            try:
                while True:
                    if self._shut.is_set():   # _serve fails the requests in flight and queued with this
                        raise RuntimeError("the engine was shut down (Ctrl-C or the end of its stage)")
                    started = time.perf_counter()
                    items = take(self.max_batch - len(rows), not rows) if len(rows) < self.max_batch else []
                    if items is None:
                        return
                    threads = self._threads_for(base, threads)
                    ids, pos, shape = [], [], []
                    decoding = len(rows)
                    for r in rows:        # decoding rows: the token each sampled last
                        ids.append(r.new_ids[-1])
                        pos.append(r.next_pos + len(r.new_ids) - 1)
                        shape.append((1, r.has_prefix))
                    firsts, copies = same_context(items)
                    for item in firsts:   # admitted rows: what no KV covers of their context
                        row, todo = self._admit(item, len(rows))
                        rows.append(row)
                        ids += row.req.ids[-todo:]
                        pos += range(len(row.req.ids) - todo, len(row.req.ids))
                        shape.append((todo, row.has_prefix))
                    forwarded = len(rows)
                    sources = [decoding + f for _, f in copies]
                    for (item, _), src in zip(copies, sources):   # row src's context: nothing to forward
                        rows.append(self._admit_copy(item, rows[src]))
                    self._in_flight = [r.item for r in rows]
                    self.waves += bool(items)
                    logits = self.decoder.forward(ids, pos, shape, self._shared_prefix_kv()
                                                  if any(r.has_prefix for r in rows) else None)
                    if copies:            # their KV columns and last logits are row src's
                        for slot, src in enumerate(sources, forwarded):
                            self.decoder.cache.copy(src, slot)
                        logits = torch.cat([logits, logits[sources]])
                    tokens, lps = sample_rows(logits, [r.req.temperature for r in rows], [r.req.top_p for r in rows],
                                              [r.gen for r in rows])
                    done = []
                    for j, row in enumerate(rows):
                        row.new_ids.append(tokens[j])
                        row.new_lps.append(lps[j])
                        why = self._stop(row)
                        if why is not None:
                            if why == "tool" and row.req.key:   # its continuation comes back after the tool
                                self._keep_kv(row, j)
                            on_finish(row.item, GenResult(row.new_ids, row.new_lps, why))
                            done.append(j)
                    self._record(rows, len(ids), len(ids) - decoding, len(copies), threads, started)
                    rows = self._leave(rows, done)
            finally:
                if threads != base:
                    torch.set_num_threads(base)
                self._in_flight = []
                self.decoder.cache = None      # the slots' memory goes back (the trainer runs next)
                release_freed_memory()

    def _threads_for(self, base: int, now: int) -> int:
        """The decode's threads for the next iteration: `base` (torch's, one a core) less the cores other work holds
        (cores_taken: the sandbox's calls running longer than RolloutConfig.tool_core_after_s), at least one. An
        OpenMP team member that shares its core with a tool call holds up the whole team at every parallel region
        of the iteration: beside a call that spins, a decode iteration of 8 rows took 174 ms on two threads and 104
        ms on one, 79 ms alone (2 AVX2 cores; docs/contention.md, "A tool call takes a core"). The thread count sets
        no value: fp32 logits are the same bits on 1 and 2 threads (tests/test_engine.py)."""
        import torch

        want = base if self.cores_taken is None or self.device != "cpu" else max(1, base - self.cores_taken())
        if want != now:
            torch.set_num_threads(want)   # (this thread's OpenMP team; the trainer's thread keeps its own)
        return want

    def _stop(self, row) -> str | None:
        """finish_reason of the row's latest token; the stop text is decoded only after a token that holds its
        last character (an occurrence ends inside the newest token: every earlier one was checked before)."""
        tok, req = row.new_ids[-1], row.req
        if tok in self.eos_ids:
            return "eos"
        if tok in self._stop_candidates(req.stop_text):
            return finish_reason(self.tokenizer, row.new_ids, req, self.eos_ids)
        return "length" if len(row.new_ids) >= req.max_new_tokens else None

    def _stop_candidates(self, stop_text: str) -> set:
        if stop_text not in self._stop_tokens:
            self._stop_tokens[stop_text] = tokens_holding(self.tokenizer, stop_text[-1])
        return self._stop_tokens[stop_text]

    def _record(self, rows, tokens: int, prefilled: int, copies: int, threads: int, started: float) -> None:
        import time

        seconds = time.perf_counter() - started
        columns = max(self.decoder.cache.lens[:len(rows)])
        read = self.decoder.read_columns   # own columns the decoding rows' attention read (masked ones included)
        for key, value in (("iterations", 1), ("rows", len(rows)), ("columns", columns), ("read", read),
                           ("seconds", seconds), ("tokens", tokens), ("prefill_tokens", prefilled),
                           ("prefill_iterations", prefilled > 0), ("prefill_seconds", seconds if prefilled else 0.0),
                           ("threads", threads)):
            self._occ[key] += value
        if self.trace is not None:
            self.trace.append({"rows": len(rows), "columns": columns, "read": read, "tokens": tokens,
                               "prefill": prefilled, "copies": copies, "threads": threads,
                               "ms": round(1000 * seconds, 2)})

    def _leave(self, rows, done: list[int]):
        """Drop the stopped rows: each free slot below the new row count takes the KV of a row above it."""
        if not done:
            return rows
        gone = set(done)
        keep = [r for j, r in enumerate(rows) if j not in gone]
        holes = [j for j in done if j < len(keep)]
        movers = [j for j in range(len(keep), len(rows)) if j not in gone]
        for hole, src in zip(holes, movers):
            self.decoder.cache.move(src, hole)
        for j in done:
            if j >= len(keep):
                self.decoder.cache.lens[j] = 0
        order = list(range(len(keep)))
        for hole, src in zip(holes, movers):
            order[hole] = src
        return [rows[j] for j in order]

    def _shared_prefix_kv(self):
        """The KV of prefix_ids under the current weights, computed once per weight version."""
        if self._prefix_kv is None and self.prefix_ids:
            self._prefix_kv = self.decoder.prefix_kv(self.prefix_ids)
        return self._prefix_kv

    def _keep_kv(self, row, j: int) -> None:
        """Keep row j's own KV columns (its context and all it generated but the last token, whose KV is not
        computed yet) for the continuation of its trajectory after the tool call (_admit). At most max_batch
        rows are kept."""
        n = row.own_len + len(row.new_ids) - 1
        self._kept_kv[row.req.key[:2]] = (row.req.ids + row.new_ids[:-1], row.has_prefix,
                                          self.decoder.cache.take(j, n))
        while len(self._kept_kv) > self.max_batch:
            self._kept_kv.popitem(last=False)

    def _admit_copy(self, item, first):
        """A row for a request whose context is that of `first`, a row admitted in the same iteration: its KV and
        its first token's logits are copied from first's (the same tokens at the same positions). Any KV kept
        for it at a tool call is dropped (the copy covers its whole context)."""
        import torch

        req = item[0]
        if req.key:
            self._kept_kv.pop(req.key[:2], None)
        self._occ["copied_tokens"] += first.own_len
        return _Row(item, req, torch.Generator(device=self.device).manual_seed(req.seed), first.has_prefix,
                    first.own_len, next_pos=len(req.ids))

    def _admit(self, item, slot: int):
        """A row for this request in `slot`, with the KV kept at its trajectory's tool call when its context
        begins with that row's context (at most own_len - 1 columns: one token at least runs, for its logits).
        Returns (row, tokens of its context still to prefill)."""
        import torch

        req = item[0]
        P = len(self.prefix_ids)
        has_prefix = P > 0 and len(req.ids) > P and req.ids[:P] == self.prefix_ids
        own_len = len(req.ids) - P if has_prefix else len(req.ids)
        row = _Row(item, req, torch.Generator(device=self.device).manual_seed(req.seed), has_prefix, own_len,
                   next_pos=len(req.ids))
        self.decoder.cache.lens[slot] = 0
        kept = self._kept_kv.pop(req.key[:2], None) if req.key else None
        if kept is not None:
            ids, kept_has_prefix, kv = kept
            n = min(kv.shape[3], own_len - 1)
            if kept_has_prefix == has_prefix and req.ids[:len(ids)] == ids and n > 0:
                self.decoder.cache.put(slot, kv[:, :, :, :n])
                self.reused_tokens += n
        todo = own_len - self.decoder.cache.lens[slot]
        self.prefill_tokens += todo
        return row, todo


def same_context(items):
    """The items of one admission split into firsts (the first of each distinct context) and copies: [(item,
    index in firsts of the item with its context)]. A step submits the 2G samples of a question together, so
    their prompts are prefilled once (the rest is the same arithmetic on the same tokens: its KV and logits)."""
    firsts, copies, seen = [], [], {}
    for item in items:
        key = tuple(item[0].ids)
        if key in seen:
            copies.append((item, seen[key]))
        else:
            seen[key] = len(firsts)
            firsts.append(item)
    return firsts, copies


_HOLDING: dict = {}   # (tokenizer, its size, character) -> token ids: decoding a vocabulary takes a second


def tokens_holding(tokenizer, char: str) -> set:
    """The ids of the tokens whose decoded text holds `char`."""
    key = (getattr(tokenizer, "name_or_path", ""), len(tokenizer), type(tokenizer).__name__, char)
    if key not in _HOLDING:
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False)
        _HOLDING[key] = frozenset(i for i, t in enumerate(texts) if char in t)
    return _HOLDING[key]


@dataclass
class _Row:
    """One request in TransformersEngine's running batch."""
    item: tuple                  # what on_finish gets back: (request, future) or (request, index)
    req: GenRequest
    gen: object                  # the request's torch.Generator
    has_prefix: bool             # whether its context starts with the engine's shared prefix
    own_len: int                 # context tokens in its own columns (all of them when it has no prefix)
    next_pos: int                # position of its first new token (= its context length)
    new_ids: list = field(default_factory=list)
    new_lps: list = field(default_factory=list)


def shared_prompt_prefix(tokenizer, tool_state: str = "stateless") -> list[int]:
    """The token ids every rendered prompt starts with (system prompt, tool schema, the user turn's opening
    instructions): the common prefix of renders that differ only in the question. Questions that start with a
    digit, a word, a space or a symbol, because the last token before the question can merge with its first
    character (": 1" is ":", " ", "1" but ": What" is ":", " What")."""
    renders = [render_prompt(tokenizer, q, tool_state) for q in ("1", "2", "What", "x", " y", "(", "\\", "A", "é")]
    n = 0
    while all(n < len(r) and r[n] == renders[0][n] for r in renders):
        n += 1
    return renders[0][:n]



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
