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


def tool_response_text(response: str) -> str:
    """Scaffolding inserted after a tool call: close the assistant turn, a user turn holding the tool's result,
    then open the next assistant turn. Qwen's template renders a `tool` message exactly like this."""
    return (f"{IM_END}\n{IM_START}user\n<tool_response>\n{response}\n</tool_response>{IM_END}\n"
            f"{IM_START}assistant\n")


def encode(tokenizer, text: str) -> list[int]:
    """Tokenize inserted text: special tokens (<|im_start|>, <|im_end|>) are parsed, no BOS is added."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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
    finish_reason: str = ""              # "answer" | "length" | "turns" | "error"
    turns: int = 0                       # assistant turns
    tool_calls: int = 0
    tool_errors: int = 0                 # calls whose result is not ok (malformed calls included)
    tool_statuses: dict[str, int] = field(default_factory=dict)   # status -> count ("ok", "timeout", "malformed" ...)
    answer_tags: int = 0                 # number of <answer> tags in the model's text
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
