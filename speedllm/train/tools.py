"""Tools for multi-turn rollouts (task=grpo with rl.tools): a tool is a Python callable that takes a call's JSON
arguments as keyword arguments and returns text. `ToolRunner` is what the rollout asks at each `</tool_call>`: it
parses the calls of a decode step, runs them at once in daemon threads under rl.tool_timeout_s (a hung tool is
left behind, never waited for), and returns each response as tokens in the chat template's own format (the
template's rendering of a tool message after an assistant tool call, and the next assistant turn's opening). A
tool that raises, hangs or returns non-text answers with an error text and counts in `errors`.

`calculator` is the built-in tool: arithmetic on numbers with + - * / // % ** and unary minus, by walking the
parsed expression (no eval), with limits on the expression's length, exponents and result size.
"""

import ast
import json
import operator
import re
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch.distributed as dist

from speedllm.errors import UserError

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_EXPRESSION = 200  # characters
MAX_EXPONENT = 64
MAX_DIGITS = 100  # of an integer result


def _value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(b) > MAX_EXPONENT:
            raise ValueError(f"exponent {b} is larger than {MAX_EXPONENT}")
        v = _OPS[type(node.op)](a, b)
        if isinstance(v, complex) or (isinstance(v, int) and len(str(abs(v))) > MAX_DIGITS):
            raise ValueError("result out of range")
        return v
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


def calculator(expression: str) -> str:
    """Arithmetic.

    Args:
        expression: such as 2 + 3
    """
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression must be text of at most {MAX_EXPRESSION} characters")
    v = _value(ast.parse(expression, mode="eval").body)
    return str(int(v)) if isinstance(v, float) and v.is_integer() and abs(v) < 1e15 else str(v)


def parse_call(tools: Dict[str, Callable], text: str) -> tuple:
    """(tool, its keyword arguments) of the last `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in
    `text`, or (None, the error text for the model)."""
    body = text[text.rfind("<tool_call>") + len("<tool_call>"):].rpartition("</tool_call>")[0]
    try:
        call = json.loads(body) if "<tool_call>" in text else None
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError as e:
        return None, f"error: the tool call is not valid JSON ({e})"
    if not isinstance(call, dict) or "name" not in call:
        return None, 'error: a tool call is {"name": <tool>, "arguments": {...}} in JSON'
    if call["name"] not in tools:
        return None, f"error: no tool named {call['name']!r} (tools: {', '.join(sorted(tools))})"
    if not isinstance(args, dict):
        return None, "error: arguments must be a JSON object"
    return tools[call["name"]], args


def run_calls(tools: Dict[str, Callable], texts: Sequence[str], timeout_s: float, max_chars: int) -> List[tuple]:
    """(response text, whether it is an error) for the tool call that ends each of `texts`. The calls run at once,
    each in a daemon thread, for timeout_s together: a call still running then is left behind (it never blocks
    the run or its exit) and answers a timeout error."""
    boxes, threads = [], []
    for text in texts:
        fn, args = parse_call(tools, text)
        box = {"error": args} if fn is None else {}

        def target(fn=fn, args=args, box=box):
            try:
                box["value"] = fn(**args)
            except BaseException as e:  # noqa: BLE001 - reported to the model, whatever it is
                box["error"] = f"error: {type(e).__name__}: {e}"

        thread = threading.Thread(target=target, daemon=True, name="speedllm-tool") if fn is not None else None
        if thread is not None:
            thread.start()
        boxes.append(box)
        threads.append(thread)
    deadline = time.monotonic() + timeout_s
    out = []
    for box, thread in zip(boxes, threads):
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                box = {"error": f"error: TimeoutError: no answer within {timeout_s:g} s"}
        value = box.get("value")
        if "error" in box:
            out.append((box["error"][:max_chars], True))
        elif not isinstance(value, str):
            out.append((f"error: the tool returned {type(value).__name__}, not text"[:max_chars], True))
        else:
            out.append((value[:max_chars], False))
    return out


def response_template(tokenizer) -> tuple:
    """(before, after): the text the chat template puts between an assistant turn's `</tool_call>` and a tool
    message's content, and between that content and the next assistant turn's first token."""
    mark = "\x00TOOL\x00"
    call = {"type": "function", "function": {"name": "t", "arguments": {}}}
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": mark}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    end = text.index("</tool_call>") + len("</tool_call>")
    before, after = text[end:].split(mark)
    return before, after


class ToolRunner:
    """What a rollout needs for rl.tools: the token that ends a call, and the tokens that answer it."""

    def __init__(self, tools: Dict[str, Callable], tokenizer, max_turns: int, timeout_s: float, max_chars: int,
                 group=None):
        """group: ranks that sample the same rows (a tensor-parallel group): its first rank runs the calls and
        sends every rank the same answers, so a tool that is late on one rank cannot feed them different tokens."""
        self.tools, self.tokenizer, self.group = tools, tokenizer, group
        self.max_turns, self.timeout_s, self.max_chars = max_turns, timeout_s, max_chars
        self.end_id = tokenizer.convert_tokens_to_ids("</tool_call>")
        self.before, self.after = response_template(tokenizer)
        self.errors = 0
        self.calls = 0

    def respond(self, completions: Sequence[Sequence[int]]) -> List[List[int]]:
        """The tokens that answer the tool call ending each of `completions` (rows' completion ids so far)."""
        if not completions:
            return []
        texts = [self.tokenizer.decode(list(ids), skip_special_tokens=False) for ids in completions]
        if self.group is None:
            answers = run_calls(self.tools, texts, self.timeout_s, self.max_chars)
        else:  # every rank of the group has the same calls at the same step: a matched collective
            box = [run_calls(self.tools, texts, self.timeout_s, self.max_chars) if dist.get_rank(self.group) == 0
                   else None]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
            answers = box[0]
        out = []
        for response, error in answers:
            self.calls += 1
            self.errors += error
            out.append(self.tokenizer.encode(self.before + response + self.after, add_special_tokens=False))
        return out


def build_tools(entries) -> Dict[str, Callable]:
    """{name: callable} of rl.tools entries ({_target_: module.fn}); the name is the function's own."""
    import hydra.utils

    tools = {}
    for entry in entries:
        fn = hydra.utils.get_method(entry["_target_"])
        tools[entry["_target_"].rsplit(".", 1)[-1]] = fn
    return tools


def tool_schemas(tools: Dict[str, Callable]) -> List[dict]:
    """The JSON schemas the chat template shows the model (its `tools=`), from each tool's signature and docstring."""
    from transformers.utils import get_json_schema

    schemas = []
    for name, fn in tools.items():
        try:
            schemas.append(get_json_schema(fn))
        except Exception as e:  # noqa: BLE001 - transformers' docstring and type-hint errors
            raise UserError(f"rl.tools: {name} cannot be shown to the model ({str(e).splitlines()[0]}); give it type "
                            "hints and a docstring with an Args: line per argument") from None
    return schemas


def conversation(tokenizer, completion_ids: Sequence[int], tool_mask: Optional[Sequence[float]]) -> List[dict]:
    """A completion as TRL's multi-turn messages: assistant turns (their text) and tool turns (the tool's text)."""
    messages, start = [], 0
    spans = []
    flags = list(tool_mask or [0] * len(completion_ids))
    for i in range(1, len(completion_ids) + 1):
        if i == len(completion_ids) or flags[i] != flags[start]:
            spans.append((flags[start], completion_ids[start:i]))
            start = i
    for is_tool, ids in spans:
        text = tokenizer.decode(list(ids), skip_special_tokens=False)
        if is_tool:
            match = re.search(r"<tool_response>\n?(.*?)\n?</tool_response>", text, re.DOTALL)
            messages.append({"role": "tool", "content": match.group(1) if match else text})
        else:
            messages.append({"role": "assistant", "content": tokenizer.decode(list(ids), skip_special_tokens=True)})
    return messages
