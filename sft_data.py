"""sft_data.py - the examples of the non-reasoning SFT cold start (arXiv 2508.20722, section 4.1).

Before RL the paper fine-tunes the base model on data that teaches *no* math reasoning: how to call the tool, how
to follow instructions and the answer format, and how to chat. This module builds such data locally (nothing is
downloaded), from the chores and direct questions of chores.py and chores_math.py, and hands sft.py a list of
Trajectories:

    draft_example(seed, i, cfg) -> Draft: question + one or two tool calls (reason, code, stdin) + final turn
      -> every program runs in the real SandboxPool -> format_tool_response(result)  (real tool outputs, errors too)
      -> render_example: the RL protocol of scheduler.py, as a Trajectory:
           prompt  = render_prompt(tok, question)                                     loss mask 0
           model   = "<reason> .. </reason>\\n<tool_call>\\n{json}\\n</tool_call>"     loss mask 1
           tool    = encode_tool_response(tok, tool text) (the text never parsed as ChatML)  loss mask 0
           ... (one or two calls) ...
           model   = "<reason> .. </reason>\\n<answer> .. \\boxed{X} </answer><|im_end|>"   loss mask 1
    + direct-answer / instruction-following drafts (no tool: "<reason>..</reason> <answer>\\boxed{..}</answer>")
    + optionally a JSONL file of chat examples ({"messages": [...]}, load_chat_jsonl) for GPU runs on real
      function-calling sets
      -> sft.py: length-bucketed batches, the loss on loss-mask-1 tokens only, early stopping, the saved model

Why the data is varied (DESIGN.md, "Machines"): a probe SFT on one fixed template trained to a loss of 0.001 left
the model nearly deterministic, so GRPO groups were all-right or all-wrong and RL stalled. Here the reasoning
sentences, question phrasings, code styles (print(expr), variables, loops, functions, stdin) and the number of
calls (one, a check with a second method, an error then a fix) are all drawn at random, and training stops
early, so the model learns the format but keeps a spread of behaviours for RL to choose from.
Most programs end in `result = expr` + `print(result)` (name_the_result): a 135M model miscounts closing
parentheses in deeply nested one-liners, and its most common error after SFT was "unmatched ')'" (README, "valid
tool call").
"""
from __future__ import annotations

import ast
import asyncio
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import tasks
from chores import EVERYDAY_CHORES, chore_programs, direct_example
from chores_math import MATH_CHORES, chore_mix
from scheduler import (IM_END, IM_START, TOOL_NAME, Segment, Trajectory, encode, encode_tool_response,
                       render_prompt, tool_response_text)
from sft_config import SFTConfig


# ----------------------------------------------------------------------------------------------------------
# Reasoning and answer sentences, drawn at random so that no single template is memorised

CALL_REASONS = [
    "I will use Python to {what}.", "Let me {what} with a short program.", "A small script can {what} reliably.",
    "To avoid mistakes, I'll {what} in code.", "The easiest way to {what} is to run some Python.",
    "I need to {what}. Let me write code for it.", "Let me compute this: I'll {what} with Python.",
    "Doing this by hand is error-prone, so I'll {what} with the tool.", "I can {what} using Python.",
    "First, {what} with a quick program.", "I'll call the Python tool to {what}.", "Let's {what} programmatically.",
]
STDIN_REASONS = ["I'll pass the data on standard input and {what}.", "The program reads the data from stdin; "
                 "then it will {what}.", "Let me feed the input through stdin and {what}."]
VERIFY_REASONS = ["Let me double-check with a different method.", "I'll verify that with a second program.",
                  "To be sure, I'll compute it another way.", "Let me confirm this result independently."]
FIX_REASONS = ["The code failed with a NameError: I misspelled a variable. Let me fix it and run again.",
               "There is a typo in a variable name. I'll correct it and rerun.",
               "The error shows an undefined name; fixing the typo."]
FINAL_REASONS = ["The tool printed {x}.", "The output is {x}.", "The program ran successfully and printed {x}.",
                 "From the tool output, the result is {x}.", "The code gives {x}, so that is the answer.",
                 "Both runs agree on {x}.", "The result is {x}."]
ANSWERS = ["\\boxed{{{x}}}", "The answer is \\boxed{{{x}}}.", "\\boxed{{{x}}}", "Result: \\boxed{{{x}}}",
           "So the answer is \\boxed{{{x}}}."]


def call_turn(reason: str, code: str, stdin: str) -> str:
    """One model turn that calls the tool, exactly as the RL rollout expects (generation stops at </tool_call>)."""
    call = json.dumps({"name": TOOL_NAME, "arguments": {"code": code, "input": stdin}})
    return f"<reason> {reason} </reason>\n<tool_call>\n{call}\n</tool_call>"


def answer_turn(rng, reason: str, answer: str) -> str:
    """The final model turn: reasoning, then the answer in <answer> with \\boxed{}, then the end-of-turn token."""
    sep = rng.choice(["\n", "\n", " "])
    return f"<reason> {reason} </reason>{sep}<answer> {rng.choice(ANSWERS).format(x=answer)} </answer>{IM_END}"


def typo(code: str) -> str | None:
    """A buggy twin for the "error, then fix" examples: the last use of the first assigned name is misspelled."""
    first = code.split("\n")[0]
    name = first.split(" = ")[0].strip() if " = " in first else ""
    uses = list(re.finditer(rf"\b{name}\b", code)) if name.isidentifier() else []
    if len(uses) < 2:
        return None
    last = uses[-1]
    return code[:last.start()] + name + name[-1] + code[last.end():]


def name_the_result(code: str) -> str:
    """`print(f(g(x)))` on the last line -> `result = f(g(x))` then `print(result)`: one level of parentheses
    less to close in the line that a small model most often gets wrong. Other programs are returned unchanged."""
    lines = code.split("\n")
    try:
        call = ast.parse(lines[-1]).body[0].value
    except (SyntaxError, IndexError, AttributeError):
        return code
    if not (isinstance(call, ast.Call) and getattr(call.func, "id", "") == "print" and len(call.args) == 1
            and not call.keywords and not isinstance(call.args[0], (ast.Name, ast.Constant))):
        return code
    name = next(n for n in ("result", "answer", "value", "out", "res") if not re.search(rf"\b{n}\b", code))
    expr = ast.get_source_segment(lines[-1], call.args[0])
    return "\n".join(lines[:-1] + [f"{name} = {expr}", f"print({name})"])


# ----------------------------------------------------------------------------------------------------------
# Building examples: draft -> run every program in the sandbox -> render as a Trajectory


@dataclass
class Draft:
    id: str
    question: str
    answer: str                                  # the expected final answer (what the last program prints)
    calls: list[tuple[str, str, str]] = field(default_factory=list)   # (reason, code, stdin) per tool call
    expect: list[str] = field(default_factory=list)                   # expected status per call
    final: str = ""                              # the final model turn, <|im_end|> included
    same_as: tuple[str, dict] | None = None      # the generator problem the chore states (chores.Chore.same_as)


def chore_kind(rng, cfg: SFTConfig):
    """The chore function this draft uses: one of the mix's, or of MATH_CHORES with probability math_share."""
    if cfg.math_share is None:
        return rng.choice(chore_mix(cfg.extra_chores))
    return rng.choice(MATH_CHORES if rng.random() < cfg.math_share else EVERYDAY_CHORES)


def draft_example(seed: int, index: int, cfg: SFTConfig) -> Draft:
    """The index-th example of a seeded stream (its own RNG, so example i never depends on how many were drawn)."""
    rng = random.Random(f"sft:{seed}:{index}")
    if rng.random() < cfg.direct_share:
        q, reason, a = direct_example(rng)
        return Draft(f"sft-{index}-direct", q, a, final=answer_turn(rng, reason, a))
    make = chore_kind(rng, cfg)
    chore = make(rng)
    while chore.same_as and tasks.split_of(*chore.same_as) != "train":   # never a validation or test problem:
        chore = make(rng)                                                  # the same kind, other numbers
    programs = [(name_the_result(code) if rng.random() < cfg.name_share else code, stdin)
                for code, stdin in chore_programs(chore)]
    code, stdin = rng.choice(programs)
    reasons = STDIN_REASONS if stdin else CALL_REASONS
    d = Draft(f"sft-{index}-{chore.what.split()[0]}", chore.question, chore.answer, same_as=chore.same_as)
    first_reason = rng.choice(reasons).format(what=chore.what)
    roll = rng.random()
    others = [p for p in programs if p[0] != code]
    buggy = typo(code)
    if roll < cfg.fix_share and buggy:
        d.calls = [(first_reason, buggy, stdin), (rng.choice(FIX_REASONS), code, stdin)]
        d.expect = ["error", "ok"]
    elif roll < cfg.fix_share + cfg.verify_share and others:
        d.calls = [(first_reason, code, stdin), (rng.choice(VERIFY_REASONS), *rng.choice(others))]
        d.expect = ["ok", "ok"]
    else:
        d.calls, d.expect = [(first_reason, code, stdin)], ["ok"]
    finals = FINAL_REASONS if len(d.calls) > 1 else [r for r in FINAL_REASONS if "Both" not in r]
    d.final = answer_turn(rng, rng.choice(finals).format(x=chore.answer), chore.answer)
    return d


def render_example(tokenizer, draft: Draft, results: list) -> Trajectory | None:
    """Draft + real sandbox results -> Trajectory (prompt, model and tool segments), or None when the sandbox did
    not do what the draft expects (then the example would teach something false, so it is dropped)."""
    from sandbox import format_tool_response

    for result, want in zip(results, draft.expect):
        if result.status != want or (want == "error" and "NameError" not in result.stderr):
            return None
    if results and results[-1].stdout.strip() != draft.answer:
        return None
    t = Trajectory(problem_id=draft.id, prompt_ids=render_prompt(tokenizer, draft.question), finish_reason="answer",
                   reward=1.0)
    texts = []
    for (reason, code, stdin), result in zip(draft.calls, results):
        model_text, tool_out = call_turn(reason, code, stdin), format_tool_response(result)
        tool_text = tool_response_text(tool_out)
        t.segments += [Segment(encode(tokenizer, model_text), 1),
                       Segment(encode_tool_response(tokenizer, tool_out), 0)]
        texts += [model_text, tool_text]
        t.tool_calls += 1
        t.tool_errors += result.status != "ok"
        t.tool_statuses[result.status] = t.tool_statuses.get(result.status, 0) + 1
    t.segments.append(Segment(encode(tokenizer, draft.final), 1))
    t.response_text = "".join(texts) + draft.final
    t.model_text = "".join(texts[::2]) + draft.final
    t.turns, t.answer_tags = len(draft.calls) + 1, 1
    return t


async def run_drafts(drafts: list[Draft], pool) -> list[list]:
    """Run every tool call of every draft in the sandbox pool, concurrently."""
    async def one(d: Draft):
        return [await pool.run(code, stdin) for _, code, stdin in d.calls]
    return await asyncio.gather(*(one(d) for d in drafts))


def build_sft_examples(tokenizer, n: int, seed: int, pool=None, cfg: SFTConfig | None = None,
                       loop: asyncio.AbstractEventLoop | None = None) -> list[Trajectory]:
    """n generated SFT examples whose tool responses are real sandbox outputs.

    pool: a SandboxPool (bound to no event loop); None starts a private one. loop: an event loop to run on
    (None: asyncio.run; must not be called from inside a running loop - use `asyncio.to_thread` there)."""
    cfg = cfg or SFTConfig()

    async def go(pool):
        examples: list[Trajectory] = []
        index = 0
        for _ in range(5):  # refill rounds: an example is dropped when the sandbox disagrees with its draft
            want = n - len(examples)
            if want <= 0:
                break
            drafts = [draft_example(seed, index + i, cfg) for i in range(want + want // 10 + 1)]
            index += len(drafts)
            for draft, results in zip(drafts, await run_drafts(drafts, pool)):
                t = render_example(tokenizer, draft, results)
                if t is not None and len(examples) < n:
                    examples.append(t)
        return examples

    async def with_pool():
        if pool is not None:
            return await go(pool)
        from sandbox import SandboxPool
        async with SandboxPool() as private:
            return await go(private)

    return loop.run_until_complete(with_pool()) if loop is not None else asyncio.run(with_pool())


# ----------------------------------------------------------------------------------------------------------
# Chat examples from a JSONL file: {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ...}]}

ROLES = ("system", "user", "assistant", "tool")


def chat_pieces(messages: list[dict]) -> list[tuple[str, int]]:
    """ChatML text pieces with loss masks: assistant content (+ <|im_end|>) is 1, everything else 0. Consecutive
    tool messages become one user turn of <tool_response> blocks, as Qwen's template renders them. Without a
    system message the paper's system prompt (with the tool schema) is used. OpenAI-style `tool_calls` on an
    assistant message are written as <tool_call> blocks."""
    from scheduler import system_message

    pieces: list[tuple[str, int]] = []
    if messages[0]["role"] != "system":
        pieces.append((f"{IM_START}system\n{system_message()}{IM_END}\n", 0))
    i = 0
    while i < len(messages):
        m = messages[i]
        if m["role"] == "tool":
            j = i
            while j < len(messages) and messages[j]["role"] == "tool":
                j += 1
            body = "\n".join(f"<tool_response>\n{t['content']}\n</tool_response>" for t in messages[i:j])
            pieces.append((f"{IM_START}user\n{body}{IM_END}\n", 0))
            i = j
            continue
        if m["role"] == "assistant":
            text = m.get("content") or ""
            for call in m.get("tool_calls") or []:
                fn = call.get("function", call)
                args = fn.get("arguments", {})
                args = json.loads(args) if isinstance(args, str) else args
                text += f"\n<tool_call>\n{json.dumps({'name': fn['name'], 'arguments': args})}\n</tool_call>"
            pieces += [(f"{IM_START}assistant\n", 0), (text.strip("\n") + IM_END, 1), ("\n", 0)]
        else:
            pieces.append((f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n", 0))
        i += 1
    while pieces and pieces[-1][1] == 0:  # nothing after the last assistant turn is trained on
        pieces.pop()
    return pieces


def check_chat_row(row) -> str | None:
    """Why a parsed JSONL row is not a chat example, or None when it is."""
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
        return 'expected an object {"messages": [...]} with a non-empty list'
    for k, m in enumerate(row["messages"]):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            return f"message {k}: role must be one of {', '.join(ROLES)}"
        if not isinstance(m.get("content"), str) and not (m["role"] == "assistant" and m.get("tool_calls")):
            return f"message {k} ({m['role']}): content must be a string"
    if not any(m["role"] == "assistant" for m in row["messages"]):
        return "no assistant message (nothing to train on)"
    return None


def load_chat_jsonl(path: str | Path, tokenizer) -> list[Trajectory]:
    """Chat examples -> Trajectories (prompt = everything before the first assistant content). A malformed line
    raises ValueError naming the file and its 1-based line number."""
    examples = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            problem = check_chat_row(row)
            if problem is None:
                try:
                    pieces = chat_pieces(row["messages"])
                except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
                    problem = f"malformed tool call ({type(e).__name__}: {e})"
            if problem is not None:
                raise ValueError(f"{path}:{lineno}: {problem}")
            first = next(k for k, (_, mask) in enumerate(pieces) if mask)
            t = Trajectory(problem_id=f"{Path(path).stem}-{lineno}",
                           prompt_ids=encode(tokenizer, "".join(text for text, _ in pieces[:first])),
                           finish_reason="answer", reward=1.0)
            t.segments = [Segment(encode(tokenizer, text), mask) for text, mask in pieces[first:]]
            t.response_text = "".join(text for text, _ in pieces[first:])
            t.model_text = "".join(text for text, mask in pieces[first:] if mask)
            examples.append(t)
    return examples
