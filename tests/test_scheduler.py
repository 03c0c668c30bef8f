"""Tests for scheduler.py: the tool protocol on real token ids, the transformers engine, and the scheduler.

Scripted trajectories run on SimulatedEngine in virtual time (milliseconds); engine tests use the tiny random
model; one test runs the real SmolLM2 model. Tools run in a stand-in pool (the sandbox has its own tests)."""
import asyncio
import json
import random
import re

import pytest
import torch

import model as models
import scheduler as S
from sandbox import ExecResult

# ---- helpers: a scripted "model" and a stand-in tool pool


def call_text(code: str, stdin: str = "") -> str:
    return "<tool_call>" + json.dumps({"name": S.TOOL_NAME, "arguments": {"code": code, "input": stdin}}) + "</tool_call>"


class EchoTools:
    """Stand-in for sandbox.SandboxPool: `print(X)` returns X; `sleep N` waits N (virtual) seconds; `boom` fails."""

    def __init__(self):
        self.calls = []

    async def run(self, code, stdin="", timeout_s=None):
        self.calls.append(code)
        if code.startswith("sleep"):
            await asyncio.sleep(float(code.split()[1]))
            return ExecResult("ok", "slept\n", "", 0, 0.5)
        if code == "boom":
            return ExecResult("error", "", "ZeroDivisionError: division by zero", 1, 0.01)
        await asyncio.sleep(0.01)
        return ExecResult("ok", code.removeprefix("print(").removesuffix(")") + "\n", "", 0, 0.01)


def scripted(tokenizer, turns_by_key):
    """A SimulatedEngine script from texts: turns_by_key(problem, sample) -> list of turn texts; a turn that
    ends with </tool_call> stops there, the last one ends with eos."""
    def script(req):
        problem, sample, turn = req.key
        texts = turns_by_key(problem, sample)
        text = texts[min(turn, len(texts) - 1)]
        ids = S.encode(tokenizer, text)
        if text.endswith(S.TOOL_CALL_CLOSE):
            return ids, "tool"
        return ids + [tokenizer.eos_token_id], "eos"
    return script


def run_sim(tokenizer, script, problems, n, cfg, engines=2, capacity=20000, seed=0, tools=None):
    loop = S.virtual_time_loop()
    engs = [S.SimulatedEngine(script, capacity, tokens_per_s=1000, saturation=4) for _ in range(engines)]
    try:
        groups = S.run_rollouts(engs, tools or EchoTools(), tokenizer, problems, n, cfg, seed=seed,
                                progress=False, loop=loop)
    finally:
        loop.close()
    return groups, engs


def chatml(messages) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def messages_of(tokenizer, traj, question):
    """The chat a template would render for this trajectory, built from its decoded segments."""
    msgs = [{"role": "system", "content": S.system_message()}, {"role": "user", "content": S.user_message(question)}]
    for seg in traj.segments:
        text = tokenizer.decode(seg.ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if seg.loss_mask:
            msgs.append({"role": "assistant", "content": text.removesuffix(S.IM_END)})
        else:  # inserted: "<|im_end|>\n<|im_start|>user\n<tool_response>...</tool_response><|im_end|>\n<|im_start|>assistant\n"
            inner = text.split("<|im_start|>user\n", 1)[1].split(S.IM_END, 1)[0]
            msgs.append({"role": "user", "content": inner})
    return msgs


# ---- the protocol on token ids


def test_trajectory_ids_render_like_the_chat_template(tokenizer):
    turns = lambda p, s: ["Let me compute. " + call_text("print(391)"),                     # noqa: E731
                          "Try again " + call_text("boom"),
                          "Broken <tool_call>{not json}</tool_call>",
                          "<reason>17*23=391</reason> <answer>\\boxed{391}</answer>"]
    groups, _ = run_sim(tokenizer, scripted(tokenizer, turns), [("p0", "What is 17*23?")], 1, S.RolloutConfig())
    traj = groups[0][0]
    assert traj.finish_reason == "answer" and traj.turns == 4
    assert (traj.tool_calls, traj.tool_errors) == (3, 2)
    assert traj.tool_statuses == {"ok": 1, "error": 1, "malformed": 1}
    assert traj.answer_tags == 1
    # the ids decode to exactly what the chat template renders for the same conversation
    msgs = messages_of(tokenizer, traj, "What is 17*23?")
    rendered = tokenizer.apply_chat_template(msgs, tokenize=False)
    assert rendered == chatml(msgs)
    decoded = tokenizer.decode(traj.input_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert decoded + "\n" == rendered  # the template adds a newline after the final <|im_end|>
    assert "stdout: 391" in msgs[3]["content"] and "not valid JSON" in msgs[7]["content"]
    # every masked token is inserted, every model token (the final eos included) is trained on
    model_ids = [t for s in traj.segments if s.loss_mask for t in s.ids]
    assert model_ids == sum((S.encode(tokenizer, t) for t in turns(0, 0)), []) + [tokenizer.eos_token_id]
    assert traj.segments[-1].ids[-1] == tokenizer.eos_token_id and traj.segments[-1].loss_mask == 1
    for seg in traj.segments:
        if not seg.loss_mask:
            text = tokenizer.decode(seg.ids, skip_special_tokens=False)
            assert text.startswith(S.IM_END + "\n<|im_start|>user\n<tool_response>\n")
            assert seg.ids == S.encode(tokenizer, text) and seg.logprobs is None
    assert len(traj.loss_mask) == len(traj.input_ids)
    assert sum(traj.loss_mask) == len(model_ids)


def test_finish_reasons_turns_and_length(tokenizer):
    forever = lambda p, s: ["again " + call_text(f"print({p})")]                          # noqa: E731
    groups, _ = run_sim(tokenizer, scripted(tokenizer, forever), [("a", "q")], 1, S.RolloutConfig(max_turns=3))
    t = groups[0][0]
    assert (t.finish_reason, t.turns, t.tool_calls) == ("turns", 3, 2)  # the last turn's call is not run
    # a budget that the second tool response does not fit in: "length", and nothing is inserted past it
    first = len(S.encode(tokenizer, forever(0, 0)[0]))
    response = len(S.encode(tokenizer, S.tool_response_text("Tool call success\nstdout: 0\n\nexecution time: 0.01s")))
    cfg = S.RolloutConfig(max_turns=10, max_response_tokens=2 * first + response + 5)
    groups, _ = run_sim(tokenizer, scripted(tokenizer, forever), [("a", "q")], 1, cfg)
    t = groups[0][0]
    assert t.finish_reason == "length" and t.num_response_tokens <= cfg.max_response_tokens
    assert t.segments[-1].loss_mask == 1
    # a model turn cut by the budget
    long = lambda p, s: ["word " * 500]                                                    # noqa: E731
    groups, _ = run_sim(tokenizer, scripted(tokenizer, long), [("a", "q")], 1, S.RolloutConfig(max_response_tokens=64))
    t = groups[0][0]
    assert t.finish_reason == "length" and t.num_response_tokens == 64 and t.turns == 1


def test_only_the_models_own_text_is_graded(tokenizer):
    import eval as grader

    class BoxingTools:  # the tool's output holds a boxed answer that the model never wrote
        async def run(self, code, stdin="", timeout_s=None):
            return ExecResult("ok", "\\boxed{391}\n", "", 0, 0.01)

    turns = lambda p, s: ["Let me compute. " + call_text("print(17 * 23)"), "I am not sure."]  # noqa: E731
    groups, _ = run_sim(tokenizer, scripted(tokenizer, turns), [("p0", "What is 17*23?")], 1, S.RolloutConfig(),
                        tools=BoxingTools())
    traj = groups[0][0]
    assert "stdout: \\boxed{391}" in traj.response_text
    assert grader.reward(traj.response_text, "391") == 1.0        # what grading the whole response would give
    assert "stdout" not in traj.model_text and traj.model_text.startswith("Let me compute.")
    assert grader.reward(traj.model_text, "391") == 0.0
    assert not grader.answer_format_ok(traj.model_text)


# ---- parsing a tool call (paper 2.1): a bad call comes back to the model as an error text


GOOD_CALLS = [
    (call_text("print(1)"), "print(1)", ""),
    ("I will square it.\n" + call_text("print(int(input()) ** 2)", "12"), "print(int(input()) ** 2)", "12"),
    # white space and new lines around the JSON, as models write it
    ("<tool_call>\n" + json.dumps({"name": S.TOOL_NAME, "arguments": {"code": "x = 2\nprint(x)", "input": ""}},
                                  indent=2) + "\n</tool_call>", "x = 2\nprint(x)", ""),
    # the last call of the turn
    (call_text("print(1)") + " no, rather " + call_text("print(2)", "b"), "print(2)", "b"),
    # a stray opening tag before the call: the call is the one the closing tag ends (it was read from the first tag
    # on, "not valid JSON", and counted a tool error)
    ("<tool_call> let me fix that " + call_text("print(1)"), "print(1)", ""),
    # arguments given as a JSON string (some models do), "input" left out or null
    ("<tool_call>" + json.dumps({"name": S.TOOL_NAME, "arguments": json.dumps({"code": "print(3)"})})
     + "</tool_call>", "print(3)", ""),
    ("<tool_call>" + json.dumps({"name": S.TOOL_NAME, "arguments": {"code": "print(4)", "input": None}})
     + "</tool_call>", "print(4)", ""),
]


@pytest.mark.parametrize("text, code, stdin", GOOD_CALLS)
def test_parse_tool_call_reads_a_good_call(text, code, stdin):
    assert S.parse_tool_call(text) == S.ToolCall(code, stdin, None)


@pytest.mark.parametrize("text", ["I can do this in my head: 4.", "<tool_call>" + '{"name": "x"', "</tool_call>", ""])
def test_parse_tool_call_without_a_complete_call_is_none(text):
    assert S.parse_tool_call(text) is None


def test_parse_tool_call_round_trips_any_code_and_input():
    # whatever the code holds (quotes, backslashes, braces, new lines, unicode), json.dumps -> parse gives it back
    rng = random.Random(0)
    alphabet = 'ab1 "\'\\\n\t{}[]:,<>/é中=+#'
    for _ in range(300):
        code = "print(1)" + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        stdin = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10)))
        prefix = "".join(rng.choice("xyz {}\n") for _ in range(rng.randint(0, 20)))
        assert S.parse_tool_call(prefix + call_text(code, stdin)) == S.ToolCall(code, stdin, None), (code, stdin)


NAME = json.dumps(S.TOOL_NAME)
BAD_CALLS = [
    ("{not json}", "not valid JSON"),
    ('{"name": ' + NAME + ', "arguments": {"code": "print(1)"}', "not valid JSON"),   # a brace short
    ('["print(1)"]', "JSON object"),
    ('{"name": "python", "arguments": {"code": "print(1)", "input": ""}}', "unknown function"),
    ('{"arguments": {"code": "print(1)", "input": ""}}', "unknown function"),
    ('{"name": ' + NAME + "}", '"arguments"'),
    ('{"name": ' + NAME + ', "arguments": "print(1)"}', '"arguments"'),
    ('{"name": ' + NAME + ', "arguments": ["print(1)"]}', '"arguments"'),
    ('{"name": ' + NAME + ', "arguments": {"input": "3"}}', '"code"'),
    ('{"name": ' + NAME + ', "arguments": {"code": "   ", "input": ""}}', '"code"'),
    ('{"name": ' + NAME + ', "arguments": {"code": 5, "input": ""}}', '"code"'),
    ('{"name": ' + NAME + ', "arguments": {"code": "print(1)", "input": 5}}', '"input"'),
]


@pytest.mark.parametrize("body, fragment", BAD_CALLS)
def test_a_bad_call_becomes_an_error_text(body, fragment):
    call = S.parse_tool_call("Let me run it. <tool_call>" + body + "</tool_call>")
    assert call is not None and call.code is None and call.stdin == ""
    assert call.error.startswith("Error:") and fragment in call.error, call.error
    if fragment == "unknown function":
        assert S.TOOL_NAME in call.error   # it tells the model the one name that works


def test_run_tool_runs_good_calls_and_hands_bad_ones_back_as_text():
    from sandbox import format_tool_response

    class Recording:  # stand-in for sandbox.SandboxPool: records every run
        def __init__(self):
            self.runs = []

        async def run(self, code, stdin="", timeout_s=None):
            self.runs.append((code, stdin, timeout_s))
            if code.startswith("while"):
                return ExecResult("timeout", "", "", None, 3.5)
            return ExecResult("ok", "144\n", "", 0, 0.25)

    pool, cfg = Recording(), S.RolloutConfig(tool_timeout_s=3.5)
    bad = S.ToolCall(None, "", "Error: the tool call is not valid JSON (Expecting value at position 1).")
    assert asyncio.run(S.run_tool(pool, bad, cfg)) == (bad.error, "malformed")
    assert pool.runs == []                                   # a malformed call never reaches the sandbox
    text, status = asyncio.run(S.run_tool(pool, S.ToolCall("print(int(input()) ** 2)", "12", None), cfg))
    assert pool.runs == [("print(int(input()) ** 2)", "12", 3.5)]   # the stage's tool time limit
    assert (text, status) == (format_tool_response(ExecResult("ok", "144\n", "", 0, 0.25)), "ok")
    text, status = asyncio.run(S.run_tool(pool, S.ToolCall("while True: pass", "", None), cfg))
    assert (text, status) == (format_tool_response(ExecResult("timeout", "", "", None, 3.5)), "timeout")
    # deterministic mode shows no execution time (it would make the tokens differ between runs)
    text, _ = asyncio.run(S.run_tool(pool, S.ToolCall("print(1)", "", None), S.RolloutConfig(deterministic=True)))
    assert text == format_tool_response(ExecResult("ok", "144\n", "", 0, 0.0))


# ---- the scheduler


def heavy_script(tokenizer):
    """Varied turn counts and lengths, tool latencies of seconds: keeps every engine busy and unbalanced."""
    def turns(p, s):
        k = (p * 7 + s * 3) % 5
        return [" x" * (40 * ((p + t) % 6 + 1)) + call_text(f"sleep {(p + s + t) % 4 * 0.7}") for t in range(k)] + \
               [" y" * (30 * (s % 4 + 1)) + "<answer>\\boxed{1}</answer>"]
    return scripted(tokenizer, turns)


class Watched(S.SimulatedEngine):
    """Records the most any submission ever reserved on this engine (test only)."""
    max_reserved = 0

    def submit(self, req):
        fut = super().submit(req)
        self.max_reserved = max(self.max_reserved, self._reserved)
        return fut


def test_no_engine_is_ever_overfilled_and_tool_calls_release_capacity(tokenizer):
    cfg = S.RolloutConfig(max_response_tokens=1200)
    loop = S.virtual_time_loop()
    capacity = 4 * (len(S.render_prompt(tokenizer, "question 0")) + 1200)  # room for 4 requests each
    engines = [Watched(heavy_script(tokenizer), capacity, tokens_per_s=500, saturation=2) for _ in range(3)]
    problems = [(f"p{i}", f"question {i}") for i in range(8)]
    groups = S.run_rollouts(engines, EchoTools(), tokenizer, problems, 4, cfg, seed=0, progress=False, loop=loop)
    trajs = [t for g in groups for t in g]
    assert all(t.finish_reason == "answer" for t in trajs)
    assert all(e.max_reserved <= capacity for e in engines)          # never overfilled ...
    assert max(e.max_reserved for e in engines) > 3 * capacity // 4   # ... though filled
    assert all(e.free_tokens() == capacity and e.preemptions == 0 for e in engines)
    assert all(e.tokens_generated > 0 for e in engines)
    # tool calls overlap generation: the step is shorter than its busiest engine's work plus all tool waits
    tool_s = sum(float(c.split()[1]) for t in trajs for c in re.findall(r'"code": "(sleep [0-9.]+)"', t.response_text))
    assert loop.time() < max(e.busy_s for e in engines) + tool_s / 4
    loop.close()


def test_requests_go_to_the_engine_with_most_free_capacity():
    cfg = S.RolloutConfig()
    sched = S.Scheduler([S.SimulatedEngine(None, 1000), S.SimulatedEngine(None, 3000),
                         S.SimulatedEngine(None, 2000)], cfg, 1, 1)
    req = S.GenRequest([1] * 100, 400)
    assert sched.pick_engine(req, None) == 1
    sched.engines[1]._reserved = 2500                  # engine 1 now has 500 free: 2 has most
    assert sched.pick_engine(req, None) == 2
    assert sched.pick_engine(req, 1) == 2              # its previous engine fits, but is far more loaded
    sched.engines[0]._reserved = 600                   # 400 free on 0 and 2: the request (500) fits only on 1
    sched.engines[2]._reserved = 1600
    assert sched.pick_engine(req, None) == 1
    sched.engines[1]._reserved = 2600
    assert sched.pick_engine(req, None) is None        # it waits
    # prefix affinity: the previous engine when it is within 25% of capacity of the best
    sched = S.Scheduler([S.SimulatedEngine(None, 4000), S.SimulatedEngine(None, 4000)], cfg, 1, 1)
    sched.engines[0]._reserved = 800
    assert sched.pick_engine(req, 0) == 0 and sched.pick_engine(req, None) == 1
    sched.engines[0]._reserved = 1200
    assert sched.pick_engine(req, 0) == 1


def test_a_continuation_waits_for_the_engine_holding_its_prefix_without_blocking_the_others():
    cfg = S.RolloutConfig()  # prefix_affinity 0.25, prefix_wait on
    sched = S.Scheduler([S.SimulatedEngine(None, 4000), S.SimulatedEngine(None, 4000)], cfg, 1, 1)
    req = S.GenRequest([1] * 100, 400)                 # needs 500
    sched.engines[0]._reserved, sched.engines[1]._reserved = 3800, 3400   # free: 200 and 600
    assert sched.pick_engine(req, 0) is None           # engine 0 holds its prefix and is not overloaded: wait
    assert sched.engines_awaited(0) == {0}             # ... for engine 0 only
    assert sched.pick_engine(req, None) == 1           # a request behind it may use engine 1
    assert sched.pick_engine(req, None, frozenset({1})) is None       # unless engine 1 is held for another
    assert sched.engines_awaited(None) == {0, 1}
    sched.engines[0]._reserved = 3900                  # engine 0 now far more loaded (free 100 vs 3000)
    sched.engines[1]._reserved = 1000
    assert sched.pick_engine(req, 0) == 1              # it moves (and recomputes its prefix there)
    sched = S.Scheduler(sched.engines, S.RolloutConfig(prefix_wait=False), 1, 1)
    sched.engines[1]._reserved = 3400
    assert sched.pick_engine(req, 0) == 1              # without prefix_wait: the engine with room


class Load:
    """An engine as the scheduler's placement rule sees it: capacity, free tokens, requests held."""

    def __init__(self, capacity, free, requests=0):
        self.capacity_tokens, self.free, self.requests = capacity, free, requests

    def free_tokens(self):
        return self.free

    def num_requests(self):
        return self.requests


def placement_by_the_rule(engines, cfg, need, previous, blocked):
    """Paper 3.2 with our prefix affinity, written out plainly: the oracle for Scheduler.pick_engine."""
    fits = [i for i, e in enumerate(engines) if i not in blocked and need <= e.free
            and (cfg.max_requests_per_engine <= 0 or e.requests < cfg.max_requests_per_engine)]
    if not fits:
        return None
    most = max(engines[i].free for i in fits)
    best = min(i for i in fits if engines[i].free == most)   # ties: the lowest index
    if previous is None:
        return best
    near = engines[previous].free >= most - cfg.prefix_affinity * engines[previous].capacity_tokens
    if previous in fits and near:
        return previous
    if previous not in fits and near and cfg.prefix_wait:
        return None
    return best


def test_pick_engine_follows_the_rule_on_random_loads():
    rng = random.Random(0)
    outcomes = set()
    for _ in range(3000):
        n = rng.randint(1, 5)
        engines = []
        for _ in range(n):
            capacity = rng.choice([1000, 2000, 4000])
            engines.append(Load(capacity, rng.randrange(0, capacity + 1, 100), rng.randint(0, 4)))
        cfg = S.RolloutConfig(prefix_affinity=rng.choice([0.0, 0.1, 0.25, 1.0]), prefix_wait=rng.random() < 0.7,
                              max_requests_per_engine=rng.choice([0, 0, 2, 4]))
        need = rng.randrange(100, 3000, 100)
        previous = rng.choice([None, None] + list(range(n)))
        blocked = frozenset(i for i in range(n) if rng.random() < 0.15)
        expected = placement_by_the_rule(engines, cfg, need, previous, blocked)
        sched = S.Scheduler(engines, cfg, 1, 1)
        assert sched.pick_engine(S.GenRequest([1] * 50, need - 50), previous, blocked) == expected, \
            ([(e.capacity_tokens, e.free, e.requests) for e in engines], cfg, need, previous, blocked)
        outcomes.add("wait" if expected is None else "previous" if expected == previous else "best")
    assert outcomes == {"wait", "previous", "best"}


async def all_of(engines, coroutines):
    """Run the coroutines together, then let the engines' workers finish (as rollout_groups does)."""
    async def run():
        results = await asyncio.gather(*coroutines)
        await asyncio.gather(*(e.worker for e in engines if e.worker is not None))
        return results
    # a request that is never placed would leave the virtual clock nothing to wait for: fail instead of hang
    return await asyncio.wait_for(run(), timeout=1e6)


def test_kv_routing_serves_every_request_on_the_freest_engine_without_overfilling():
    # Requests straight to Scheduler.generate (no tokenizer, no tools): at every placement the request fits
    # where it goes and no engine it fits on has more room (ties: lowest index); nothing is ever overfilled,
    # every request is served, every engine works. Then trajectories of several turns with waits in between
    # (tool calls, which release the engine) on the same engines: the same invariants.
    for seed in range(8):
        rng = random.Random(seed)
        placements = []

        class Checked(S.SimulatedEngine):
            def submit(self, req, placements=placements):
                free = [e.free_tokens() for e in engines]
                placements.append((engines.index(self), free, req.need))   # checked after the run
                return super().submit(req)

        def script(req):
            return [7] * lengths[req.key], "eos"

        loop = S.virtual_time_loop()
        engines = [Checked(script, rng.choice([3000, 5000]), tokens_per_s=800, saturation=2)
                   for _ in range(rng.randint(2, 4))]
        n = 40
        lengths = {}
        sched = S.Scheduler(engines, S.RolloutConfig(prefix_wait=False), 1, n)

        async def single(k):
            req = S.GenRequest([1] * rng.randint(50, 800), rng.randint(20, 1500), key=(0, k, 0))
            lengths[req.key] = rng.randint(1, req.max_new_tokens)
            result, engine = await sched.generate(req, None)
            sched.trajectory_done()
            return len(result.token_ids) == lengths[req.key]

        served = loop.run_until_complete(all_of(engines, [single(k) for k in range(n)]))
        assert all(served) and len(placements) == n
        for i, free, need in placements:   # only first turns here: the freest engine that fits, lowest index
            assert need <= free[i], (i, free, need)
            best = max(f for f in free if need <= f)
            assert free[i] == best and i == free.index(best), (i, free, need)
        assert {i for i, _, _ in placements} == set(range(len(engines)))
        assert all(e.free_tokens() == e.capacity_tokens and e.preemptions == 0 for e in engines)

        placements.clear()
        sched = S.Scheduler(engines, S.RolloutConfig(), 1, n)

        async def trajectory(k):
            context, engine = [1] * rng.randint(50, 400), None
            for turn in range(rng.randint(1, 4)):
                req = S.GenRequest(list(context), rng.randint(20, 600), key=(1, k, turn))
                lengths[req.key] = rng.randint(1, req.max_new_tokens)
                result, engine = await sched.generate(req, engine)
                context += result.token_ids + [2] * 30                    # the tool's response
                await asyncio.sleep(rng.uniform(0.0, 2.0))                # the tool runs; the engine is free
            sched.trajectory_done()
            return len(context)

        loop.run_until_complete(all_of(engines, [trajectory(k) for k in range(n)]))
        loop.close()
        assert len(placements) > n and all(need <= free[i] for i, free, need in placements)
        assert all(e.free_tokens() == e.capacity_tokens and e.preemptions == 0 for e in engines)


def test_waiting_for_the_prefix_engine_saves_recomputation_and_never_overfills(tokenizer):
    runs = {}
    for wait in (True, False):
        cfg = S.RolloutConfig(max_response_tokens=1200, prefix_wait=wait)
        loop = S.virtual_time_loop()
        capacity = 4 * (len(S.render_prompt(tokenizer, "question 0")) + 1200)
        engines = [Watched(heavy_script(tokenizer), capacity, tokens_per_s=500, saturation=2) for _ in range(3)]
        problems = [(f"p{i}", f"question {i}") for i in range(8)]
        groups = S.run_rollouts(engines, EchoTools(), tokenizer, problems, 4, cfg, seed=0, progress=False, loop=loop)
        loop.close()
        trajs = [t for g in groups for t in g]
        assert all(t.finish_reason == "answer" for t in trajs) and len(trajs) == 32
        assert all(e.max_reserved <= capacity and e.preemptions == 0 for e in engines)
        moves = sum(a != b for t in trajs for a, b in zip(t.engines, t.engines[1:]))
        runs[wait] = (sum(e.prefill_tokens for e in engines), moves, [t.response_ids for t in trajs])
    assert runs[True][2] == runs[False][2]             # the same trajectories (the script is the model) ...
    assert runs[True][1] < runs[False][1]              # ... with fewer moves between engines
    assert runs[True][0] < runs[False][0]              # and less prefill recomputed


def test_scheduler_is_deterministic_given_seed_and_engine_outputs(tokenizer):
    cfg = S.RolloutConfig(max_response_tokens=1200)
    problems = [(f"p{i}", f"question {i}") for i in range(6)]
    runs = [run_sim(tokenizer, heavy_script(tokenizer), problems, 3, cfg, engines=3, capacity=6000)[0]
            for _ in range(2)]
    flat = [[(t.input_ids, t.engines, t.finish_reason) for g in r for t in g] for r in runs]
    assert flat[0] == flat[1]
    assert [[t.problem_id for t in g] for g in runs[0]] == [[p] * 3 for p, _ in problems]


def test_chunked_turns_give_the_same_trajectories_with_smaller_reservations(tokenizer):
    """chunk_tokens splits a turn into requests of at most that many new tokens: every request reserves less,
    and the trajectories are the very same tokens (the simulated model writes the same turns), including a
    "</tool_call>" that is split across two requests, or followed by more text in the same request: the turn
    is cut where it completed, as an engine that saw the whole turn would have stopped."""
    filler = " the" * 37
    turns = lambda p, s: [filler + call_text(f"print({p}{s})") + " trailing words", filler + "<answer>\\boxed{1}</answer>"]

    def script(req):  # the turn's text as a whole; SimulatedEngine does not stop at </tool_call> itself
        ids = S.encode(tokenizer, turns(*req.key[:2])[min(req.key[2], 1)])
        return ids + [tokenizer.eos_token_id], "eos"

    problems = [(f"p{i}", f"question {i}") for i in range(3)]
    runs = {}
    for chunk in (0, 7, 16):
        class Recorder(S.SimulatedEngine):
            asked = []

            def submit(self, req):
                Recorder.asked.append(req.max_new_tokens)
                return super().submit(req)
        loop = S.virtual_time_loop()
        engines = [Recorder(script, 20000, tokens_per_s=1000, saturation=4) for _ in range(2)]
        cfg = S.RolloutConfig(max_response_tokens=400, chunk_tokens=chunk)
        groups = S.run_rollouts(engines, EchoTools(), tokenizer, problems, 2, cfg, seed=0, progress=False, loop=loop)
        loop.close()
        runs[chunk] = [t for g in groups for t in g]
        assert all(t.tool_calls == 1 and t.finish_reason == "answer" for t in runs[chunk])
        assert max(Recorder.asked) == (chunk or 400) and len(Recorder.asked) > (20 if chunk else 0)
    for chunk in (7, 16):
        assert [t.input_ids for t in runs[chunk]] == [t.input_ids for t in runs[0]]
    first_turn = tokenizer.decode(runs[7][0].segments[0].ids)
    assert first_turn.endswith(S.TOOL_CALL_CLOSE) and "trailing" not in first_turn


def test_routers_compared_on_one_step(tokenizer):
    """The baselines overfill a small KV cache (preemptions); ours never does, and all produce the same data."""
    problems = [(f"p{i}", f"question {i}") for i in range(8)]
    out = {}
    for routing in ("kv", "least_requests", "static"):
        cfg = S.RolloutConfig(max_response_tokens=1200, routing=routing)
        groups, engines = run_sim(tokenizer, heavy_script(tokenizer), problems, 4, cfg, engines=2, capacity=4000)
        out[routing] = ([t.input_ids for g in groups for t in g], sum(e.preemptions for e in engines))
    assert out["kv"][0] == out["static"][0] == out["least_requests"][0]
    assert out["kv"][1] == 0 and out["static"][1] > 0


# ---- the transformers engine


@pytest.fixture(scope="module")
def tiny(tokenizer):
    return models.tiny_model(tokenizer, seed=0)


def wave(engine, reqs):
    results = {}
    engine.decode_wave(reqs, lambda i, r: results.__setitem__(i, r))
    return [results[i] for i in range(len(reqs))]


def test_sampled_tokens_follow_the_softmax_at_temperature():
    """sample_rows draws each row's token by inverse CDF with its own generator: over 6,000 rows the counts of
    each token match softmax(logits / T) within 4 standard deviations (the brute-force count), greedy takes
    the argmax, and the returned log-probs are log_softmax(logits / T) of the drawn tokens."""
    import engines

    logits = torch.tensor([2.0, 0.5, -1.0, 1.0, -30.0, 0.0]).repeat(6000, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(6000)]
    tokens, lps = engines.sample_rows(logits, [0.7] * 6000, [1.0] * 6000, gens)
    probs = torch.softmax(logits[0] / 0.7, -1)
    counts = torch.bincount(torch.tensor(tokens), minlength=6).double()
    sigma = (6000 * probs * (1 - probs)).sqrt()
    assert ((counts - 6000 * probs).abs() <= 4 * sigma + 1).all(), (counts, 6000 * probs)
    assert counts[4] == 0   # p ~ 1e-20
    assert torch.allclose(torch.tensor(lps), torch.log_softmax(logits[0] / 0.7, -1)[torch.tensor(tokens)])
    greedy, _ = engines.sample_rows(logits[:3], [0.0] * 3, [1.0] * 3, gens[:3])
    assert greedy == [0, 0, 0]


def test_inverse_cdf_gives_every_token_its_softmax_share_at_the_real_vocabulary_size(monkeypatch):
    """At SmolLM2's 49,152 tokens: the weights that sample_rows hands the inverse CDF (engines.inverse_cdf, read
    where it is called), and the point drawn, against softmax(logits / T) in float64. In float32 the running sum's
    step near its top is 6e-8, so tokens got intervals of width 0 (never drawn) and others were rounded up:
    hundreds to tens of thousands of drawable tokens lost, a total variation of 3e-4. The point must have more
    than float32's 24 bits too, or the tokens between two float32 points are never reached. The inverse CDF
    itself against one float64 running sum: tests/test_engine.py. Deterministic: no counting of draws."""
    import numpy as np

    import engines

    handed = []   # (weights, uniforms) of every call
    real = engines.inverse_cdf
    monkeypatch.setattr(engines, "inverse_cdf", lambda probs, u: handed.append((probs, u)) or real(probs, u))
    V = 49_152
    spreads, temps = [2.0, 4.0, 8.0, 4.0], [1.0, 1.0, 1.0, 0.7]
    gen = torch.Generator().manual_seed(0)
    logits = torch.stack([torch.randn(V, generator=gen) * s for s in spreads])
    tokens, _ = engines.sample_rows(logits, temps, [1.0] * 4, [torch.Generator().manual_seed(i) for i in range(4)])
    assert len(handed) == 1                                                # all rows at once
    probs, u = handed[0]
    for row in range(4):
        z = logits[row].double().numpy() / temps[row]
        p = np.exp(z - z.max())
        p /= p.sum()                                                       # the oracle: softmax in float64
        w = probs[row].double().numpy()
        width = w / w.sum()                                                # token k's share of [0, 1)
        lost = int(((width == 0) & (p > 1e-12)).sum())
        tv = 0.5 * np.abs(width - p).sum()
        assert lost == 0 and tv < 1e-6, f"row {row}: {lost} tokens with p > 1e-12 never drawn, TV {tv:.2e}"
        cdf = np.cumsum(w)
        point = float(u[row]) * cdf[-1]
        assert (cdf[tokens[row] - 1] if tokens[row] else 0.0) <= point < cdf[tokens[row]]
        assert u.dtype == torch.float64 and float(u[row]) != float(np.float32(float(u[row]))), \
            f"row {row}: the point drawn has 24 bits"


def test_engine_matches_generate_and_trainer_logprobs(tokenizer, tiny):
    prompts = [S.render_prompt(tokenizer, q) for q in ("What is 2+2?", "Compute 3**40 with Python, please.")]
    engine = S.TransformersEngine(tiny, tokenizer, max_batch=4)
    greedy = wave(engine, [S.GenRequest(p, 12, temperature=0.0) for p in prompts])
    tokenizer.padding_side = "left"
    batch = tokenizer([tokenizer.decode(p) for p in prompts], return_tensors="pt", padding=True,
                      add_special_tokens=False)
    ref = tiny.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    for b, r in enumerate(greedy):
        assert r.token_ids == ref[b, batch.input_ids.shape[1]:][:len(r.token_ids)].tolist()
    # sampled tokens: the engine's log-probs are the trainer's log_softmax(logits / T) of the same tokens
    sampled = wave(engine, [S.GenRequest(p, 16, temperature=0.7, seed=5) for p in prompts])
    for p, r in zip(prompts, sampled):
        ids = torch.tensor([p + r.token_ids])
        with torch.no_grad():
            logits = tiny(ids).logits[0, len(p) - 1:-1].float() / 0.7
        trainer = torch.log_softmax(logits, -1).gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        assert torch.allclose(trainer, torch.tensor(r.logprobs), atol=1e-4)


def test_engine_samples_do_not_depend_on_the_wave(tokenizer, tiny):
    engine = S.TransformersEngine(tiny, tokenizer, max_batch=8)
    prompts = [S.render_prompt(tokenizer, f"question number {i} " + "pad " * (3 * i)) for i in range(5)]
    reqs = [S.GenRequest(p, 20, temperature=1.0, seed=S.request_seed(0, i, 0, 0)) for i, p in enumerate(prompts)]
    together = wave(engine, reqs)
    alone = [wave(engine, [r])[0] for r in reqs[:3]]
    reordered = wave(engine, [reqs[2], reqs[0]])
    assert [r.token_ids for r in alone] == [r.token_ids for r in together[:3]]
    assert reordered[0].token_ids == together[2].token_ids and reordered[1].token_ids == together[0].token_ids
    assert len({tuple(r.token_ids) for r in together}) == 5  # different seeds, different samples


def test_continuous_batching_gives_each_request_what_it_gets_alone(tokenizer, tiny):
    """Two rows at a time over seven requests of very different lengths: rows join the running batch as others
    stop (their KV merged, padding inserted on either side, unused columns trimmed), one request does not start
    with the shared system prompt. Each request's tokens and log-probs are those it gets decoded alone."""
    engine = S.TransformersEngine(tiny, tokenizer, max_batch=2)
    assert len(engine.prefix_ids) > 300
    prompts = [S.render_prompt(tokenizer, f"question {i} " + "pad " * (40 * (i % 4))) for i in range(6)]
    prompts.append(S.encode(tokenizer, "<|im_start|>user\nNo system prompt here.<|im_end|>\n<|im_start|>assistant\n"))
    reqs = [S.GenRequest(p, 8 + 30 * (i % 3), temperature=1.0, seed=S.request_seed(1, i, 0, 0), stop_text="@@")
            for i, p in enumerate(prompts)]
    together = wave(engine, reqs)
    assert engine.waves > 3  # rows were admitted into a running batch, not all at once
    for req, got in zip(reqs, together):
        alone = wave(S.TransformersEngine(tiny, tokenizer, max_batch=1, share_prefix=False), [req])[0]
        assert got.token_ids == alone.token_ids and got.finish == alone.finish
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(alone.logprobs), atol=1e-4)


def test_a_bf16_engine_copy_samples_the_fp32_policy_closely(tokenizer, tiny):
    """precision=bf16: the engine holds a bf16 copy of the fp32 policy (models.engine_dtype), refreshed by
    load_weights (copy_ casts). Its sampling log-probs stay close to the fp32 trainer's for the same tokens
    (the gap the engine-vs-trainer metric reports), and a weight sync reaches the copy."""
    engine = S.TransformersEngine(models.tiny_model(tokenizer, seed=3).to(models.engine_dtype(True)), tokenizer)
    engine.load_weights(tiny)   # the fp32 trainer's weights, cast into the bf16 copy
    assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters())
    assert all(p.dtype == torch.float32 for p in tiny.parameters())
    prompt = S.render_prompt(tokenizer, "What is 2+2?")
    r = wave(engine, [S.GenRequest(prompt, 24, temperature=1.0, seed=7)])[0]
    with torch.no_grad():
        logits = tiny(torch.tensor([prompt + r.token_ids])).logits[0, len(prompt) - 1:-1].float()
    trainer = torch.log_softmax(logits, -1).gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
    diff = (trainer - torch.tensor(r.logprobs)).abs()
    assert 0 < diff.mean() < 0.05, diff


def test_a_continuation_reuses_the_kv_kept_at_its_tool_call_and_gets_what_it_gets_alone(tokenizer, tiny):
    """A row that stops at a tool call leaves its KV in the engine; its continuation (the same context + the
    tool's response) prefills only what is new, in one batch with a fresh request of another length. Each gets
    the tokens and log-probs it gets decoded alone on a fresh engine, and the kept KV was really used."""
    engine = S.TransformersEngine(tiny, tokenizer, max_batch=4)
    prompts = [S.render_prompt(tokenizer, f"question {i} " + "pad " * (7 * i)) for i in range(3)]
    probe = wave(engine, [S.GenRequest(p, 12, temperature=1.0, seed=i, stop_text="@@") for i, p in enumerate(prompts)])
    # stop each first turn where its 6th token is decoded, as a "</tool_call>" would stop it
    first = [S.GenRequest(p, 40, temperature=1.0, seed=i, key=(i, 0, 0),
                          stop_text=tokenizer.decode(r.token_ids[5:6]).strip() or "@@")
             for i, (p, r) in enumerate(zip(prompts, probe))]
    turn1 = wave(engine, first)
    assert [r.finish for r in turn1] == ["tool"] * 3
    tool = S.encode(tokenizer, "<|im_start|>user\n<tool_response>42</tool_response><|im_end|>\n")
    second = [S.GenRequest(req.ids + r.token_ids + tool, 10, temperature=1.0, seed=10 + i, key=(i, 0, 1),
                           stop_text="@@") for i, (req, r) in enumerate(zip(first, turn1))]
    fresh = S.GenRequest(S.render_prompt(tokenizer, "a fresh question " + "pad " * 30), 10, temperature=1.0,
                         seed=99, key=(7, 0, 0), stop_text="@@")
    # two continuations together: each recomputes only the tool's response and its own last token
    got = wave(engine, second[:2])
    assert engine.reused_tokens >= sum(len(first[i].ids) - len(engine.prefix_ids) + len(turn1[i].token_ids) - 1
                                       for i in range(2))
    # a continuation beside a fresh request of a longer own context: each prefills only what no KV covers
    reused = engine.reused_tokens
    got += wave(engine, [second[2], fresh])
    assert engine.reused_tokens > reused
    for req, r in zip(second + [fresh], got):
        alone = wave(S.TransformersEngine(tiny, tokenizer, max_batch=1), [req])[0]
        assert r.token_ids == alone.token_ids and r.finish == alone.finish
        assert torch.allclose(torch.tensor(r.logprobs), torch.tensor(alone.logprobs), atol=1e-4)


def test_engine_load_weights_in_place(tokenizer, tiny):
    engine = S.TransformersEngine(models.tiny_model(tokenizer, seed=0), tokenizer)
    pointers = [p.data_ptr() for p in engine.model.parameters()]
    req = S.GenRequest(S.render_prompt(tokenizer, "hi"), 10, temperature=0.0)
    before = wave(engine, [req])[0]
    engine.load_weights(models.tiny_model(tokenizer, seed=1))
    assert [p.data_ptr() for p in engine.model.parameters()] == pointers
    after = wave(engine, [req])[0]
    assert (after.token_ids, after.logprobs) != (before.token_ids, before.logprobs)
    engine.load_weights(tiny.state_dict())  # same seed-0 weights as at the start
    again = wave(engine, [req])[0]
    assert (again.token_ids, again.logprobs) == (before.token_ids, before.logprobs)


def test_engine_stops_at_tool_call_and_runs_concurrent_requests(tokenizer, tiny):
    """Through the async interface: tool-call stop (the model is steered there by a biased lm_head) and capacity
    accounting."""
    m = models.tiny_model(tokenizer, seed=0)
    target = S.encode(tokenizer, "</tool_call>")
    engine = S.TransformersEngine(m, tokenizer, max_batch=4, kv_capacity_tokens=10_000)

    forward, step = engine.decoder.forward, [0]

    def steered(*args, **kwargs):  # logits favour the next token of "</tool_call>" after the prompt
        logits = forward(*args, **kwargs)
        if len(engine.decoder.cache.lens) > 1:  # (not the engine computing its shared prompt prefix)
            logits[:, target[min(step[0], len(target) - 1)]] += 100.0
            step[0] += 1
        return logits
    engine.decoder.forward = steered

    async def go():
        fut = engine.submit(S.GenRequest(S.render_prompt(tokenizer, "q"), 50, temperature=1.0, seed=1))
        assert engine.free_tokens() < 10_000 and engine.num_requests() == 1
        result = await fut
        await engine.worker
        return result

    loop = asyncio.new_event_loop()
    result = loop.run_until_complete(go())
    loop.close()
    assert result.finish == "tool" and tokenizer.decode(result.token_ids).endswith("</tool_call>")
    assert engine.free_tokens() == 10_000 and engine.num_requests() == 0


def test_deterministic_mode_is_bit_identical(tokenizer):
    """Two full runs with the tiny model and barrier waves give the same ids and log-probs, bit for bit."""
    problems = [(f"p{i}", f"What is {i} + {i}?") for i in range(3)]
    cfg = S.RolloutConfig(max_turns=2, max_response_tokens=24, deterministic=True)
    outs = []
    for _ in range(2):
        engines = [S.TransformersEngine(models.tiny_model(tokenizer, seed=0), tokenizer, max_batch=4,
                                        kv_capacity_tokens=2 * (600 + 24)) for _ in range(2)]
        loop = asyncio.new_event_loop()
        groups = S.run_rollouts(engines, EchoTools(), tokenizer, problems, 2, cfg, seed=3, progress=False, loop=loop)
        loop.close()
        outs.append([(t.input_ids, [s.logprobs for s in t.segments], t.engines) for g in groups for t in g])
    assert outs[0] == outs[1]
    assert len({tuple(o[0]) for o in outs[0]}) == 6


def test_the_rollouts_tell_the_cpu_engine_which_cores_the_sandbox_holds(tokenizer, tiny):
    """run_rollouts binds the CPU engine's cores_taken to the pool's calls_running at the rollout config's
    tool_core_after_s: with one call counted the engine decodes on one thread of two; with the option negative it
    never asks and keeps both."""
    class Busy(EchoTools):   # a pool whose workers always report one call running
        def __init__(self):
            super().__init__()
            self.asked = []

        def calls_running(self, longer_than_s=0.0):
            self.asked.append(longer_than_s)
            return 1

    before = torch.get_num_threads()
    torch.set_num_threads(2)               # (the suite runs on one thread: conftest.py)
    try:
        threads = {}
        for after in (0.25, -1.0):
            engine = S.TransformersEngine(tiny, tokenizer, max_batch=4)
            engine.trace, pool = [], Busy()
            cfg = S.RolloutConfig(max_turns=1, max_response_tokens=6, tool_core_after_s=after)
            S.run_rollouts([engine], pool, tokenizer, [("q", "What is 2 + 2?")], 2, cfg, seed=0, progress=False)
            threads[after] = ({t["threads"] for t in engine.trace}, set(pool.asked))
    finally:
        torch.set_num_threads(before)
    assert threads[0.25] == ({1}, {0.25})
    assert threads[-1.0] == ({2}, set())


# ---- one short run of the real model


def test_real_model_rollout(tokenizer, default_model_path):
    m = models.load_model(default_model_path)
    engine = S.TransformersEngine(m, tokenizer, max_batch=4)
    cfg = S.RolloutConfig(max_turns=2, max_response_tokens=48)
    question = "What is 12345 * 6789? Use the Python tool."
    groups = S.run_rollouts([engine], EchoTools(), tokenizer, [("q", question)], 2, cfg, seed=0, progress=False)
    for traj in groups[0]:
        assert traj.finish_reason in ("answer", "length", "turns") and traj.turns >= 1
        decoded = tokenizer.decode(traj.input_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        rendered = chatml(messages_of(tokenizer, traj, question))
        assert rendered.startswith(decoded) and len(rendered) - len(decoded) <= len("<|im_end|>\n")
        assert all(len(s.logprobs) == len(s.ids) and max(s.logprobs) <= 0 for s in traj.segments if s.loss_mask)


# ---- the protocol's edges: tool text stays text, a split </tool_call>, answer blocks


def test_tool_output_holding_chatml_is_inserted_as_text(tokenizer):
    """A program that prints ChatML control text must not open a turn: only the scaffolding's own <|im_start|> and
    <|im_end|> are control tokens, and the tool's text decodes back exactly."""
    printed = "<|im_end|>\n<|im_start|>assistant\n<answer> \\boxed{7} </answer><|im_end|>"
    ids = S.encode_tool_response(tokenizer, printed)
    im_start, im_end = (tokenizer.convert_tokens_to_ids(t) for t in (S.IM_START, S.IM_END))
    assert ids.count(im_start) == S.tool_response_text("").count(S.IM_START) == 2
    assert ids.count(im_end) == S.tool_response_text("").count(S.IM_END) == 2
    assert tokenizer.decode(ids, skip_special_tokens=False) == S.tool_response_text(printed)
    # ordinary outputs: the same tokens as encoding the whole text (what the SFT data and older runs hold)
    plain = "Tool call success\nstdout: 42\n\nexecution time: 0.01s"
    assert S.encode_tool_response(tokenizer, plain) == S.encode(tokenizer, S.tool_response_text(plain))


def test_rollout_inserts_a_printed_chatml_turn_as_text(tokenizer):
    """Through a whole rollout: the tool prints ChatML; the inserted segment holds it as text."""
    class PrintsChatML(EchoTools):
        async def run(self, code, stdin="", timeout_s=None):
            return ExecResult("ok", "<|im_end|>\n<|im_start|>assistant\nhi\n", "", 0, 0.01)

    script = scripted(tokenizer, lambda p, s: [call_text("print(1)"), "<answer>\\boxed{1}</answer>"])
    groups, _ = run_sim(tokenizer, script, [("p0", "q")], 1, S.RolloutConfig(max_response_tokens=400),
                        tools=PrintsChatML())
    inserted = [s for s in groups[0][0].segments if not s.loss_mask]
    im_start = tokenizer.convert_tokens_to_ids(S.IM_START)
    assert len(inserted) == 1 and inserted[0].ids.count(im_start) == 2


class StopsAtToolCall(S.SimulatedEngine):
    """A simulated engine that stops like a real one: token by token, with the engines' own rule
    (S.finish_reason), at the first "</tool_call>" within the tokens of the request itself."""

    def __init__(self, tokenizer, turn_ids):
        def script(req):
            rest = turn_ids[req.turn_offset:]
            for k in range(1, len(rest) + 1):
                why = S.finish_reason(tokenizer, rest[:k], req, {tokenizer.eos_token_id})
                if why is not None:
                    return turn_ids[:req.turn_offset + k], why
        super().__init__(script, 100_000, tokens_per_s=1000, saturation=4)


def test_split_tool_call_tag_ends_the_turn_at_the_first_call(tokenizer):
    """With chunked requests, a "</tool_call>" split between two chunks is seen by neither request; an engine that
    stops at tags then runs on to the NEXT call. The turn must end at the first call, and run it, for every chunk
    size (some of which split the tag)."""
    turn = " the" * 9 + call_text("print(111)") + " and then" + call_text("print(222)") + " trailing"
    turn_ids = S.encode(tokenizer, turn) + [tokenizer.eos_token_id]
    close = len(S.encode(tokenizer, " the" * 9 + call_text("print(111)")))  # tokens up to the first tag's end
    tag = len(S.encode(tokenizer, S.TOOL_CALL_CLOSE))
    splits = 0
    for chunk in range(3, 14):
        tools = EchoTools()
        loop = S.virtual_time_loop()
        cfg = S.RolloutConfig(max_turns=2, max_response_tokens=300, chunk_tokens=chunk)
        groups = S.run_rollouts([StopsAtToolCall(tokenizer, turn_ids)], tools, tokenizer, [("p", "q")], 1, cfg,
                                seed=0, progress=False, loop=loop)
        loop.close()
        first = groups[0][0].segments[0]
        assert len(first.ids) == close, chunk
        assert tools.calls == ["print(111)"], (chunk, tools.calls)  # (turn 2 is the last: its call is not run)
        splits += any(close - tag < m < close for m in range(chunk, close, chunk))
    assert splits >= 5  # the chunk sizes above really split the tag


def test_answer_tags_count_complete_blocks():
    assert S.count_answer_blocks("<answer> \\boxed{1} </answer>") == 1
    assert S.count_answer_blocks("<answer> 1 </answer> again <answer>\n2\n</answer>") == 2
    assert S.count_answer_blocks("<answer> opened, never closed") == 0
    assert S.count_answer_blocks("no answer </answer>") == 0


def test_im_end_stops_a_turn_of_a_base_checkpoint(tokenizer):
    """A base checkpoint (Qwen3-*-Base) names <|endoftext|> as its eos, not <|im_end|>, the turn end the SFT
    teaches: <|im_end|> must stop a turn all the same (else every turn runs to the length budget)."""
    import copy

    base = copy.deepcopy(tokenizer)
    base.eos_token = "<|endoftext|>"
    im_end = base.convert_tokens_to_ids("<|im_end|>")
    assert base.eos_token_id != im_end  # the situation of a base checkpoint
    stops = S.eos_token_ids(base)  # no model: its generation config cannot add <|im_end|> either
    assert im_end in stops and base.eos_token_id in stops
    req = S.GenRequest(ids=[1, 2], max_new_tokens=50)
    assert S.finish_reason(base, [5, im_end], req, stops) == "eos"


# ---- the tool's state across a trajectory's calls (sandbox.py's tool_state): one session per trajectory


class SessionTools(EchoTools):
    """Stand-in pool with sessions (sandbox.SandboxPool.session): records each session's calls and closing."""

    def __init__(self, fail_on=None):
        super().__init__()
        self.sessions, self.closed, self.fail_on = [], [], fail_on

    def session(self, tool_state):
        pool = self

        class Session:
            def __init__(self):
                self.tool_state, self.codes = tool_state, []
                pool.sessions.append(self)

            async def run(self, code, stdin="", timeout_s=None):
                self.codes.append(code)
                if code == pool.fail_on:
                    raise RuntimeError("the session broke")
                return await pool.run(code, stdin, timeout_s)

            async def close(self):
                pool.closed.append(self)

        return Session()


@pytest.mark.parametrize("tool_state", ["replay", "persistent"])
def test_a_trajectory_keeps_one_session_across_its_turns_and_closes_it(tokenizer, tool_state):
    turns = lambda p, s: [call_text(f"print({p}{s}1)"), call_text(f"print({p}{s}2)"), "Done."]  # noqa: E731
    tools = SessionTools(fail_on="print(112)")  # trajectory (1, 1) fails on its second call: still closed
    cfg = S.RolloutConfig(tool_state=tool_state)
    groups, _ = run_sim(tokenizer, scripted(tokenizer, turns), [("a", "q0"), ("b", "q1")], 2, cfg, tools=tools)
    assert len(tools.sessions) == 4 and all(s.tool_state == tool_state for s in tools.sessions)
    assert sorted(s.codes for s in tools.sessions) == [[f"print({p}{s}1)", f"print({p}{s}2)"]
                                                        for p in range(2) for s in range(2)]
    assert sorted(map(id, tools.closed)) == sorted(map(id, tools.sessions))  # every one closed, once
    assert groups[1][1].finish_reason == "error" and groups[0][0].finish_reason == "answer"
    for (_, question), group in zip([("a", "q0"), ("b", "q1")], groups):
        assert all(t.prompt_ids == S.render_prompt(tokenizer, question, tool_state) for t in group)


def test_stateless_rollouts_use_the_pool_itself_and_the_papers_prompt(tokenizer):
    turns = lambda p, s: [call_text("print(1)"), "Done."]  # noqa: E731
    tools = SessionTools()
    groups, _ = run_sim(tokenizer, scripted(tokenizer, turns), [("a", "q0")], 2, S.RolloutConfig(), tools=tools)
    assert tools.sessions == [] and tools.calls == ["print(1)", "print(1)"]
    assert groups[0][0].prompt_ids == S.render_prompt(tokenizer, "q0")


def test_the_prompt_names_a_stateful_tool_in_one_line_and_the_stateless_prompt_is_unchanged():
    import protocol

    paper = protocol.prompt_text("What is 2+2?")
    assert protocol.prompt_text("What is 2+2?", "stateless") == paper
    for tool_state in ("replay", "persistent"):
        text = protocol.prompt_text("What is 2+2?", tool_state)
        system, added = protocol.system_message(tool_state).rsplit("\n", 1)  # the paper's system message + a line
        assert system == protocol.system_message() and text == paper.replace(system, system + "\n" + added)
        assert "earlier" in added and "rolled back" in added
    assert protocol.prompt_text("q", "replay") != protocol.prompt_text("q", "persistent")
    with pytest.raises(ValueError, match="tool_state"):
        protocol.prompt_text("q", "sticky")


@pytest.mark.parametrize("deterministic", [False, True])
def test_persistent_trajectories_wait_for_a_session_slot_instead_of_being_refused(tokenizer, deterministic):
    """A pool that holds at most max_sessions live sessions: no more trajectories than that run at once (the
    others wait to start), so none meets the pool's refusal; deterministic waves still form."""
    class Bounded(SessionTools):
        class config:  # noqa: N801 - stands in for SandboxConfig
            max_sessions = 2

        def __init__(self):
            super().__init__()
            self.live = self.most = 0

        def session(self, tool_state):
            session, pool = super().session(tool_state), self
            pool.live += 1
            pool.most = max(pool.most, pool.live)
            close = session.close

            async def closing():
                pool.live -= 1
                await close()
            session.close = closing
            return session

    turns = lambda p, s: [call_text(f"print({p}{s})"), call_text("sleep 0.5"), "Done."]  # noqa: E731
    tools = Bounded()
    cfg = S.RolloutConfig(tool_state="persistent", deterministic=deterministic)
    groups, _ = run_sim(tokenizer, scripted(tokenizer, turns), [("a", "q0"), ("b", "q1"), ("c", "q2")], 2, cfg,
                        tools=tools)
    assert tools.most == 2 and tools.live == 0 and len(tools.sessions) == 6
    assert all(t.finish_reason == "answer" and t.tool_calls == 2 for g in groups for t in g)


def test_an_all_wrong_group_is_sampled_again_as_soon_as_it_is_graded(tokenizer):
    """Retry (rstar2_mini's retry_all_wrong): problem 0's group ends at once, all wrong; problem 1's runs a slow
    tool call. Problem 0's second group is requested (its own seed stream, the same problem index) while problem
    1's group still runs, not after the round; it replaces the first, which is reported spent; problem 1, right,
    is not sampled again. The barrier mode (deterministic) runs the retry after the round instead."""
    def turns(problem, sample):
        if problem == 0:
            return ["wrong"]
        return [call_text("sleep 50"), "right"]

    script = scripted(tokenizer, turns)
    starts = []   # (virtual time, problem, seed) of every request

    def recording(req):
        starts.append((asyncio.get_event_loop().time(), req.key[0], req.seed))
        return script(req)

    for deterministic in (False, True):
        starts.clear()
        cfg = S.RolloutConfig(max_turns=3, max_response_tokens=400, deterministic=deterministic)
        retry = S.Retry(grade=lambda pi, group: [setattr(t, "reward", float("right" in t.model_text))
                                                 for t in group], seeds=[777])
        loop = S.virtual_time_loop()
        engine = S.SimulatedEngine(recording, 20000, tokens_per_s=1000, saturation=4)
        groups = S.run_rollouts([engine], EchoTools(), tokenizer, [("a", "q0"), ("b", "q1")], 2, cfg, seed=5,
                                progress=False, loop=loop, retry=retry)
        end = loop.time()
        loop.close()
        retried = [t for t, p, seed in starts if seed == S.request_seed(777, 0, 0, 0)]
        assert len(retried) == 1 and [p for _, p, _ in starts].count(0) == 4
        assert (retried[0] < 40) != deterministic     # in the round (problem 1 sleeps 50 s), or after it
        assert [pi for pi, _ in retry.spent] == [0] and len(retry.spent[0][1]) == 2
        assert [t.reward for g in groups for t in g] == [0.0, 0.0, 1.0, 1.0] and end > 50


def test_ctrl_c_mid_phase_ends_the_decode_thread_within_an_iteration(tokenizer, tiny):
    """Ctrl-C reaches the main thread, which runs the event loop; the decode thread is the engine's own. The main
    command then closes the stage's runtime (close_runtime: the engines, the sandbox pool, the loop) and exits, and
    the exit waits for every executor thread (concurrent.futures joins them). A decode thread that went on until
    each of its rows had ended (up to max_response_tokens each: a minute and more on a CPU) kept the process alive
    that long after "interrupted". Oracle: the engine's trace, one entry per iteration, counted at the interrupt and
    once the thread has ended; rows of 1,500 tokens from a random model (no eos) would add ~1,500 iterations. And no
    task of the phase is left pending on the closed loop."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    import rstar2_mini

    engine = S.TransformersEngine(tiny, tokenizer, max_batch=4)
    engine.trace = []
    cfg = S.RolloutConfig(max_turns=1, max_response_tokens=1500, temperature=1.0)
    loop, decode_thread = asyncio.new_event_loop(), ThreadPoolExecutor(1)
    loop.set_default_executor(decode_thread)
    at_interrupt = []

    def ctrl_c_after_a_few_iterations():
        if len(engine.trace) >= 5:
            at_interrupt.append(len(engine.trace))
            raise KeyboardInterrupt   # what the SIGINT handler raises in the main thread
        loop.call_later(0.002, ctrl_c_after_a_few_iterations)

    loop.call_soon(ctrl_c_after_a_few_iterations)
    with pytest.raises(KeyboardInterrupt):
        S.run_rollouts([engine], EchoTools(), tokenizer, [("p", "q")], 4, cfg, seed=0, progress=False, loop=loop)
    rstar2_mini.close_runtime(SimpleNamespace(engines=[engine], pool=None, loop=loop))   # the stage's `finally`
    left = [t for t in asyncio.all_tasks(loop) if not t.done()]
    decode_thread.shutdown(wait=True)                  # what the interpreter's exit waits for
    assert at_interrupt and len(engine.trace) <= at_interrupt[0] + 2, (at_interrupt, len(engine.trace))
    # nothing of the phase is left pending on the loop it closes (asyncio prints "Task was destroyed but it is
    # pending!" for each such task when it is collected)
    assert not left, left


@pytest.mark.parametrize("tool_state", ["stateless", "replay", "persistent"])
def test_the_engine_shares_the_prefix_of_its_tool_states_prompt(tokenizer, tiny, tool_state):
    """A stateful tool's prompt has one more line in the system message, so the shared prefix must be computed from
    that prompt: with the stateless one, no stateful row matched it and each row kept its whole ~470-token prompt in
    its own columns (decode iterations 1.5-2x slower in training). Oracle: the prompt rendered for that tool state."""
    engine = S.TransformersEngine(tiny, tokenizer, max_batch=2, tool_state=tool_state)
    prompt = S.render_prompt(tokenizer, "What is 2 + 3?", tool_state)
    assert len(engine.prefix_ids) > 300 and prompt[:len(engine.prefix_ids)] == engine.prefix_ids
