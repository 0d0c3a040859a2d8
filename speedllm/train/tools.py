"""Tools for multi-turn rollouts (task=grpo with rl.tools): a tool is a Python callable that takes a call's JSON
arguments as keyword arguments and returns text. `ToolRunner` is what the rollout asks at each `</tool_call>`: it
parses the call, runs the tool in a daemon thread under rl.tool_timeout_s (a hung tool is left behind, never
waited for), and returns the tool response as tokens in the chat template's own format (the template's rendering
of a tool message after an assistant tool call, and the next assistant turn's opening). A tool that raises, hangs
or returns non-text answers with an error text and counts in `errors`.

`calculator` is the built-in tool: arithmetic on numbers with + - * / // % ** and unary minus, by walking the
parsed expression (no eval), with limits on the expression's length, exponents and result size.
"""

import ast
import json
import operator
import re
import threading
from typing import Callable, Dict, List, Optional, Sequence

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
    """The value of an arithmetic expression such as "(3 + 4) * 2 / 7", as text."""
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression must be text of at most {MAX_EXPRESSION} characters")
    v = _value(ast.parse(expression, mode="eval").body)
    return str(int(v)) if isinstance(v, float) and v.is_integer() and abs(v) < 1e15 else str(v)


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>\s*$", re.DOTALL)


def call_with_timeout(fn: Callable, kwargs: dict, timeout_s: float):
    """fn(**kwargs) in a daemon thread: its result, or raises TimeoutError after timeout_s (the thread is left to
    finish or hang on its own; it never blocks the run or its exit)."""
    box = {}

    def target():
        try:
            box["value"] = fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 - reported to the model, whatever it is
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True, name="speedllm-tool")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def run_call(tools: Dict[str, Callable], text: str, timeout_s: float, max_chars: int) -> tuple:
    """(response text, whether it is an error) for the tool call that ends `text`."""
    match = _CALL.search(text)
    try:
        call = json.loads(match.group(1)) if match else None
        if not isinstance(call, dict) or "name" not in call:
            return 'error: a tool call is {"name": <tool>, "arguments": {...}} in JSON', True
        name, args = call["name"], call.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args)
        if name not in tools:
            return f"error: no tool named {name!r} (tools: {', '.join(sorted(tools))})", True
        if not isinstance(args, dict):
            return "error: arguments must be a JSON object", True
        value = call_with_timeout(tools[name], args, timeout_s)
    except BaseException as e:  # noqa: BLE001 - a tool's failure is the model's answer, never the run's
        if isinstance(e, (KeyboardInterrupt,)):
            raise
        return f"error: {type(e).__name__}: {e}"[:max_chars], True
    if not isinstance(value, str):
        return f"error: the tool returned {type(value).__name__}, not text", True
    return value[:max_chars], False


def response_template(tokenizer, **template_kwargs) -> tuple:
    """(before, after): the text the chat template puts between an assistant turn's `</tool_call>` and a tool
    message's content, and between that content and the next assistant turn's first token."""
    mark = "\x00TOOL\x00"
    call = {"type": "function", "function": {"name": "t", "arguments": {}}}
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": mark}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    end = text.index("</tool_call>") + len("</tool_call>")
    before, after = text[end:].split(mark)
    return before, after


class ToolRunner:
    """What a rollout needs for rl.tools: the token that ends a call, and the tokens that answer it."""

    def __init__(self, tools: Dict[str, Callable], tokenizer, max_turns: int, timeout_s: float, max_chars: int):
        self.tools, self.tokenizer = tools, tokenizer
        self.max_turns, self.timeout_s, self.max_chars = max_turns, timeout_s, max_chars
        self.end_id = tokenizer.convert_tokens_to_ids("</tool_call>")
        self.before, self.after = response_template(tokenizer)
        self.errors = 0
        self.calls = 0

    def respond(self, completion_ids: Sequence[int]) -> List[int]:
        """The tokens that answer the tool call ending completion_ids (the row's completion so far)."""
        text = self.tokenizer.decode(list(completion_ids), skip_special_tokens=False)
        response, error = run_call(self.tools, text, self.timeout_s, self.max_chars)
        self.calls += 1
        self.errors += error
        return self.tokenizer.encode(self.before + response + self.after, add_special_tokens=False)


def build_tools(entries) -> Dict[str, Callable]:
    """{name: callable} of rl.tools entries ({_target_: module.fn}); the name is the function's own."""
    import hydra.utils

    tools = {}
    for entry in entries:
        fn = hydra.utils.get_method(entry["_target_"])
        tools[entry["_target_"].rsplit(".", 1)[-1]] = fn
    return tools


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
