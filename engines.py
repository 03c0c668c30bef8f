"""engines.py - the in-process inference engines behind the rollout scheduler (paper section 3.2, engines).

Data flow: scheduler.py's Scheduler places a GenRequest (context ids, budget, sampling seed) on an engine with
engine.submit(req); the engine generates one turn (or one chunk of it) and resolves the future with a GenResult
(token ids, their log-probs under log_softmax(logits / T), why it stopped: "eos" | "tool" | "length"), which
rollout_one appends to the Trajectory (protocol.py). Engines never import the scheduler.

  * TransformersEngine: continuous batching on a Hugging Face model in a hand-written decode loop (CPU,
    single-GPU debugging), with the KV-cache helpers it needs (shared_prompt_prefix ... trim_padding);
  * SimulatedEngine + virtual_time_loop: a cost model of a GPU engine in virtual time, for
    bench/bench_scheduler.py and the scheduler tests only;
  * VLLMEngine (one per GPU) lives in vllm_engine.py, which needs vLLM.
"""
from __future__ import annotations

import asyncio
import hashlib
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field

from model import prefix_cache, release_freed_memory
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
    as vLLM does; with top_p = 1 the two distributions are the same. T <= 0 means greedy."""
    import torch

    temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], dtype=logits.dtype, device=logits.device)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens = []
    for row, (t, p, gen) in enumerate(zip(temperatures, top_ps, generators)):
        if t <= 0:
            tok = int(torch.argmax(logp[row]))
        elif p >= 1.0:  # inverse CDF: one uniform per row (multinomial draws 49K exponentials: 8% of a step)
            # token k for u * cdf[-1] in [cdf[k-1], cdf[k]), sums and u in float64: in float32 the sum's step near
            # its top is 6e-8, so at 49,152 tokens hundreds to tens of thousands of them had an interval of width
            # 0 (never drawn) and others were rounded up (total variation 3e-4 from the softmax); float32's u
            # reaches only 2^24 points. In float64 both steps are ~1e-16 (tests/test_scheduler.py).
            cdf = torch.cumsum(logp[row].exp(), 0, dtype=torch.float64)  # exp in float32: relative error 6e-8 each
            u = torch.rand(1, generator=gen, device=logp.device, dtype=torch.float64) * cdf[-1]
            tok = min(int(torch.searchsorted(cdf, u, right=True)), len(cdf) - 1)
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

    What makes it fast on a CPU, measured in bench/bench_rollout.py and bench/bench_rl_step.py:
      * the shared prefix: every prompt starts with the same ~450-token system prompt and tool schema. Its KV
        is computed once per weight version and held once for the whole batch; only the rest of the context
        is prefilled (that prefill used to cost more than all the decoding), and attention reads the prefix
        once per step for all rows (shared_prefix_attention) instead of once per row;
      * a KV buffer with room to grow (growing_kv_layer), instead of transformers' DynamicCache which copies
        the whole cache at every step;
      * a row that stops at a tool call keeps its KV until its continuation comes (_keep_kv), which then
        prefills only the tool's response and what follows;
      * sampling by inverse CDF (sample_rows), and the vocabulary projection as W h^T
        (output_projection_transposed).

    KV layout: the shared prefix (P columns, one copy), then the batch's cache, one column per cached token
    (all rows append the next token in the same column):

        prefix:  0 .. P-1, shared by the rows that have it
        column:  0 ......... start[b]-1   start[b] ........... L-1
        row b:   padding (masked)         the row's own tokens (rest of prompt, output)

    A row whose context does not start with the shared prefix masks the prefix and keeps its whole context in
    its own tokens. Positions count real tokens only, so each row sees the positions of a plain forward of its
    own context. The decode runs in a worker thread, so the event loop keeps serving tool
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
        # the KV of rows that stopped at a tool call, until their continuation comes: {(problem, sample):
        # (context ids it covers, has_prefix, [(keys, values)] per layer)}; dropped at a weight sync
        self._kept_kv: OrderedDict = OrderedDict()
        self.reused_tokens = 0            # prefill tokens taken from _kept_kv instead of recomputed
        if self.prefix_ids:
            use_shared_prefix_attention(self.model)
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
        """Copy new weights into the engine's model in place (no re-allocation). `weights` is a state dict, a
        model, or (name, tensor) pairs (distributed.gathered_weights); when it is the engine's own model (the CPU trainer may share it) there is nothing to copy.
        Either way the cached KV of the shared prefix belongs to the old weights and is dropped."""
        import torch

        with self._weights_lock:
            self._prefix_kv = None
            self._kept_kv.clear()
            if weights is self.model:
                return
            state = weights.state_dict() if hasattr(weights, "state_dict") else weights
            pairs = state.items() if hasattr(state, "items") else state   # (or (name, tensor) pairs, streamed)
            state = {k.removeprefix("module."): v for k, v in pairs}  # DDP / accelerate wrappers
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
                            cache = merge_batches(cache, rows, new_cache, new_rows)
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
                            if why == "tool" and row.req.key:   # its continuation comes back after the tool
                                self._keep_kv(row, j, cache)
                            on_finish(row.item, GenResult(row.new_ids, row.new_lps, why))
                    if len(keep) < len(rows):  # drop stopped rows from the batch and its KV cache
                        rows = [rows[j] for j in keep]
                        self._in_flight = [r.item for r in rows]
                        if not rows:
                            cache, logits = None, None
                            continue
                        cache.batch_select_indices(torch.tensor(keep, device=self.device))
                        cache = trim_padding(cache, rows)
                    logits = self._decode_step(rows, cache)
        finally:
            self.model.train(was_training)

    def _forward(self, rows, input_ids, position_ids, cache):
        import torch

        extra = {}
        if self.prefix_ids:   # shared_prefix_attention: the prefix's KV, and which rows attend to it
            has_prefix = torch.tensor([r.has_prefix for r in rows], device=self.device)
            extra["shared_prefix"] = (self._shared_prefix_kv(), has_prefix)
        width = cache.get_seq_length() + input_ids.shape[1]
        with output_projection_transposed(self.model):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask(rows, width, self.device),
                             position_ids=position_ids, use_cache=True, logits_to_keep=1,
                             **{self._cache_kw: cache}, **extra)
        return out.logits[:, -1, :].float()

    def _shared_prefix_kv(self):
        """The KV of prefix_ids under the current weights, computed once per weight version."""
        import torch

        if self._prefix_kv is None and self.prefix_ids:
            self._prefix_kv = prefix_cache(self.model, torch.tensor([self.prefix_ids], device=self.device))
        return self._prefix_kv

    def _keep_kv(self, row, j: int, cache) -> None:
        """Keep row j's own KV columns (its context and all it generated but the last token, whose KV is not
        computed yet) for the continuation of its trajectory after the tool call: that request then prefills
        only the tool's response and the tokens after it (_prefill). At most max_batch rows are kept."""
        n = row.own_len + len(row.new_ids) - 1
        end = cache.get_seq_length()
        kv = [(layer.keys[j:j + 1, :, end - n:end].clone(), layer.values[j:j + 1, :, end - n:end].clone())
              for layer in cache.layers]
        self._kept_kv[row.req.key[:2]] = (row.req.ids + row.new_ids[:-1], row.has_prefix, kv)
        while len(self._kept_kv) > self.max_batch:
            self._kept_kv.popitem(last=False)

    def _kept_kv_for(self, req: GenRequest, has_prefix: bool, own_len: int):
        """The kept KV of this request's own first tokens (at most own_len - 1 of them: one token at least runs,
        for its logits), when the kept row's context is where this request's context begins; else None."""
        kept = self._kept_kv.pop(req.key[:2], None) if req.key else None
        if kept is None:
            return None
        ids, kept_has_prefix, kv = kept
        if kept_has_prefix != has_prefix or req.ids[:len(ids)] != ids:
            return None
        n = min(kv[0][0].shape[2], own_len - 1)
        return [(k[:, :, :n], v[:, :, :n]) for k, v in kv] if n > 0 else None

    def _prefill(self, items):
        """Prefill new requests as one batch on top of the shared prefix: returns their rows, their cache
        (columns: left padding, own tokens; the prefix stays shared) and the logits of their next token.

        A continuation whose trajectory's KV was kept at its tool call (_keep_kv) takes those columns as they
        are; the forward covers only the last W columns, W = the most tokens any newcomer lacks (the tool's
        response and what follows it, or a fresh request's whole own context):

            row b:  [padding | kept KV of its first own_len - W tokens | its last W tokens, forwarded]"""
        import torch

        P = len(self.prefix_ids)
        rows, kept = [], []
        for req, *_ in items:
            has_prefix = P > 0 and len(req.ids) > P and req.ids[:P] == self.prefix_ids
            own = req.ids[P:] if has_prefix else req.ids
            rows.append(_Row(items[len(rows)], req, torch.Generator(device=self.device).manual_seed(req.seed),
                             has_prefix, own_len=len(own), next_pos=len(req.ids)))
            kept.append(self._kept_kv_for(req, has_prefix, len(own)))
        lacking = [r.own_len - (kv[0][0].shape[2] if kv else 0) for r, kv in zip(rows, kept)]
        width, W = max(r.own_len for r in rows), max(lacking)
        ids = torch.full((len(rows), W), self.pad_id, dtype=torch.long)
        pos = torch.zeros((len(rows), W), dtype=torch.long)
        for b, row in enumerate(rows):
            n = min(row.own_len, W)                  # this row's tokens in the forward window
            ids[b, W - n:] = torch.tensor(row.req.ids[-n:])
            first = (P if row.has_prefix else 0) + row.own_len - n
            pos[b, W - n:] = torch.arange(first, first + n)
            row.start = width - row.own_len
        cache = new_cache(None)
        if width > W:   # the kept columns in front of the window (a row with own_len > W has kept KV)
            some = next(kv for kv in kept if kv)
            layers = []
            for i in range(len(some)):
                k = some[i][0].new_zeros((len(rows), some[i][0].shape[1], width - W, some[i][0].shape[3]))
                v = torch.zeros_like(k)
                for b, (row, kv) in enumerate(zip(rows, kept)):
                    n = row.own_len - W              # columns this row takes from its kept KV
                    if n > 0:
                        k[b, :, width - W - n:] = kv[i][0][0, :, :n]
                        v[b, :, width - W - n:] = kv[i][1][0, :, :n]
                layers.append((k, v))
            cache = new_cache(layers, room=W + 1)
            self.reused_tokens += sum(max(0, r.own_len - W) for r in rows)
        self.waves += 1
        self.prefill_tokens += sum(min(r.own_len, W) for r in rows)
        logits = self._forward(rows, ids.to(self.device), pos.to(self.device), cache)
        return rows, cache, logits

    def _decode_step(self, rows, cache):
        import torch

        dev = self.device
        step_ids = torch.tensor([[r.new_ids[-1]] for r in rows], device=dev)
        positions = torch.tensor([[r.next_pos + len(r.new_ids) - 1] for r in rows], device=dev)
        return self._forward(rows, step_ids, positions, cache)


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


@contextmanager
def output_projection_transposed(model):
    """Inside: the model's output projection (an nn.Linear, weight W [V, H]) computes logits^T = W h^T instead
    of h W^T: the same numbers, in the order MKL runs 1.6-2x faster for SmolLM2's 49K x 576 W at 8-64 rows
    (a quarter of a decode step). The head's own product is skipped (a pre-hook hands it zero positions) and
    its output replaced, so whatever the model does with the logits afterwards still happens."""
    import torch

    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        yield
        return
    held = []

    def no_positions(_head, args):
        held.append(args[0])
        return (args[0][..., :0, :],)

    def transposed(_head, _args, _out):
        h = held.pop()
        flat = h.reshape(-1, h.shape[-1])
        logits = torch.mm(head.weight, flat.T).T.contiguous()
        logits = logits if head.bias is None else logits + head.bias
        return logits.view(*h.shape[:-1], -1)

    handles = [head.register_forward_pre_hook(no_positions), head.register_forward_hook(transposed)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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


def attention_mask(rows, width: int, device):
    """The 2D mask of the batch's own columns (see TransformersEngine): every column from the row's own start
    on. (Which rows see the shared prefix, shared_prefix_attention is told separately.)"""
    import torch

    col = torch.arange(width, device=device)[None, :]
    start = torch.tensor([r.start for r in rows], device=device)[:, None]
    return (col >= start).long()


SHARED_PREFIX_ATTENTION = "rstar2_shared_prefix"   # the transformers attention implementation registered below


def shared_prefix_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            shared_prefix=None, **kwargs):
    """Attention over [shared prefix | the row's own columns] with the prefix's KV held once for the whole batch
    (a transformers attention function; TransformersEngine passes shared_prefix=(prefix KV per layer, has_prefix
    [B] bool) with every forward). Without shared_prefix it is transformers' sdpa, so a trainer that shares the
    engine's model computes exactly what it did.

    Decoding (one query a row) is bound by reading the KV cache: with the ~450-token prefix copied into every
    row, a batch of 32 reads 32 copies of it in every layer (23% of a decode step, more than the weights). Here
    the prefix is read once, as one matmul for all rows and heads (GQA: the query heads of a KV head are stacked):

        s_prefix = q K_prefix^T * scale        [kv heads, B * groups, P]     (-inf for rows without the prefix)
        s_own    = q K_own^T * scale + mask    [B, kv heads, groups, L_own]
        p = softmax([s_prefix | s_own]),  out = p_prefix V_prefix + p_own V_own

    A prefill (many queries a row) concatenates the prefix to the row's columns and runs sdpa (its flash kernel
    never holds the whole score matrix)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if shared_prefix is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    import torch

    layers, has_prefix = shared_prefix
    pk, pv = layers[module.layer_idx]                      # [1, kv heads, P, d]
    B, H, Q, d = query.shape
    kvh, P = key.shape[1], pk.shape[2]
    g = H // kvh
    scale = scaling if scaling is not None else d ** -0.5
    own_mask = attention_mask[:, :, :, -key.shape[2]:].bool()   # [B, 1, Q, L_own], True = attend
    prefix_mask = has_prefix.view(B, 1, 1, 1).expand(B, 1, Q, P)
    if Q > 1:   # prefill: the prefix in front of every row's own columns, then sdpa
        keys = torch.cat([pk.expand(B, -1, -1, -1), key], dim=2)
        values = torch.cat([pv.expand(B, -1, -1, -1), value], dim=2)
        mask = torch.cat([prefix_mask, own_mask], dim=-1)
        return sdpa_attention_forward(module, query, keys, values, mask, dropout=dropout, scaling=scale, **kwargs)
    q = query.reshape(B, kvh, g, d)                                               # head h = kv head h // g
    s_prefix = torch.matmul(q.transpose(0, 1).reshape(kvh, B * g, d), pk[0].transpose(1, 2))
    s_prefix = s_prefix.view(kvh, B, g, P).transpose(0, 1)                        # [B, kv heads, g, P]
    s_own = torch.matmul(q, key.transpose(2, 3))                                  # [B, kv heads, g, L_own]
    scores = torch.cat([s_prefix, s_own], dim=-1).float() * scale
    scores = scores.masked_fill(~torch.cat([prefix_mask, own_mask], dim=-1).view(B, 1, 1, -1), float("-inf"))
    p = torch.softmax(scores, dim=-1).to(value.dtype)
    out_prefix = torch.matmul(p[..., :P].transpose(0, 1).reshape(kvh, B * g, P), pv[0]).view(kvh, B, g, d)
    out = out_prefix.transpose(0, 1) + torch.matmul(p[..., P:], value)           # [B, kv heads, g, d]
    return out.reshape(B, H, 1, d).transpose(1, 2), None                         # [B, 1, H, d], as sdpa returns


def use_shared_prefix_attention(model) -> None:
    """Register shared_prefix_attention with transformers and switch the model to it (it is sdpa whenever no
    shared prefix is passed). Its mask is sdpa's, always materialised (never skipped for is_causal)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def always_a_mask(*args, **kwargs):
        return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})

    AttentionInterface.register(SHARED_PREFIX_ATTENTION, shared_prefix_attention)
    AttentionMaskInterface.register(SHARED_PREFIX_ATTENTION, always_a_mask)
    model.set_attn_implementation(SHARED_PREFIX_ATTENTION)


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
                    self.set(key_states[:, :, :0], value_states[:, :, :0], room=key_states.shape[-2] + 128)
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


def merge_batches(cache, rows, new, new_rows):
    """Stack the newcomers' cache under the running batch's, left-padding the shorter one so both end in the
    same column (every row appends its next token there). Written straight into one new buffer per layer (with
    room to grow), so the batch's KV is copied once."""
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
                buf[rows_, :, shift:target] = x                                  # right-aligned
            bufs.append(buf)
        layer = growing_kv_layer()()
        layer.hold(*bufs, target)
        merged.layers.append(layer)
    return merged


def trim_padding(cache, rows, slack: int = 64):
    """Drop the padding columns that every remaining row masks (left by rows that left the batch), once there
    are at least `slack` of them: attention then runs over fewer columns. In place: the own-token columns move
    left inside the existing buffers."""
    waste = min(r.start for r in rows)
    if waste < slack:
        return cache
    for r in rows:
        r.start -= waste
    for layer in cache.layers:
        n = layer.keys.shape[-2]
        for buf in (layer.k_buf, layer.v_buf):
            buf[:, :, :n - waste] = buf[:, :, waste:n].clone()
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
