"""protocol.py - the multi-turn rollout's prompt, token encoding and trajectory record (paper section 2.1).

The model reasons, calls a Python tool with a JSON `<tool_call>`, reads the result inside `<tool_response>` in a
user turn, and finally answers in `<answer> ... \\boxed{} ... </answer>`. This module holds the text of that
protocol and the record of one rollout; it runs nothing:

    render_prompt(tokenizer, problem)        -> prompt_ids (the system prompt of paper Figure 3, the tool schema;
                                                a stateful tool_state adds one line naming it)
    encode_tool_response(tokenizer, text)    -> the inserted ids "<|im_end|> user <tool_response> ... assistant"
    Trajectory(prompt_ids, [Segment(ids, loss_mask, logprobs), ...], finish_reason, tool statistics)
    count_answer_blocks(model_text)          -> the answer tags that GRPO-RoC's format penalty counts

scheduler.py builds trajectories from these (rollout_one) and parses the tool calls; engines.py shares the
system prompt's KV; the trainer (rl_update.py, sft_data.py) reads Trajectory.input_ids / loss_mask, and
grpo_roc.py its statistics. Token ids are never re-tokenized.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

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


# The tool's state across calls (sandbox.py's tool_state): the paper's tool is stateless and its prompt says nothing
# about state; a stateful tool is named in one line at the end of the system message, so that a stateful run is not
# a stateless prompt with a surprise.
TOOL_STATE_LINES = {
    "stateless": "",
    "replay": ("\nThe Python tool keeps state: variables, imports and functions from earlier successful calls are "
               "available in later calls (earlier calls are run again, silently, before each new one); a call that "
               "fails is rolled back."),
    "persistent": ("\nThe Python tool keeps state: variables, imports, functions and files from earlier successful "
                   "calls are available in later calls (one Python session per conversation); a call that fails is "
                   "rolled back."),
}


def system_message(tool_state: str = "stateless") -> str:
    if tool_state not in TOOL_STATE_LINES:
        raise ValueError(f"tool_state must be one of {', '.join(TOOL_STATE_LINES)}, not {tool_state!r}")
    return SYSTEM_PROMPT + TOOLS_BLOCK + TOOL_STATE_LINES[tool_state]


def user_message(problem: str) -> str:
    return USER_PREFIX + problem


def prompt_text(problem: str, tool_state: str = "stateless") -> str:
    """The ChatML text the model sees before its first token (what `apply_chat_template` renders)."""
    return (f"{IM_START}system\n{system_message(tool_state)}{IM_END}\n"
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


def render_prompt(tokenizer, problem: str, tool_state: str = "stateless") -> list[int]:
    return encode(tokenizer, prompt_text(problem, tool_state))


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


_ANSWER_BLOCK_RE = re.compile(r"<answer>.*?</answer>", re.DOTALL)


def count_answer_blocks(text: str) -> int:
    """Complete <answer> ... </answer> blocks: RoC's p_format counts answers, and an opened, never closed tag is
    not one (grpo_roc.roc_penalty)."""
    return len(_ANSWER_BLOCK_RE.findall(text))
