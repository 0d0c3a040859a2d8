"""Prompts for task=grpo: records with `prompt` (text, or OpenAI-style messages rendered with the chat template)
and any other fields, which reach the reward functions as keyword arguments of the same names (TRL's layout).

A prompt is drawn by its position in a per-epoch shuffle (`PromptOrder`), so a run and its resume draw the same
prompts; the loader position is one integer in the checkpoint.
"""

from dataclasses import dataclass
from typing import Dict, List

import numpy as np

from speedllm.data.preprocess import expand_inputs, read_records
from speedllm.errors import UserError, one_line


@dataclass
class PromptSet:
    """ids: token ids per prompt; prompts: each prompt as the record gave it (text or messages), what reward
    functions receive; columns: the records' other fields, one list per field name; where: "file:line"."""

    ids: List[List[int]]
    prompts: list
    columns: Dict[str, list]
    where: List[str]


def _messages(prompt, where: str) -> bool:
    """Whether a prompt is chat messages (else text); anything else is refused."""
    if isinstance(prompt, str):
        if not prompt:
            raise UserError(f"{where}: empty prompt — give every record some prompt text")
        return False
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        return True
    raise UserError(f"{where}: prompt must be text or a list of {{role, content}} messages")


def load_prompts(inputs, tokenizer, max_prompt_tokens: int, max_new_tokens: int, tools=None) -> PromptSet:
    """Every record of `inputs` (data.input: file, glob or list), tokenized; the first bad record is one line.

    Args:
        max_prompt_tokens: the model's positions minus rl.max_new_tokens: a longer prompt is refused.
        tools: JSON schemas of rl.tools, which the chat template shows in message prompts (its `tools=`).
    """
    ids, prompts, rows, wheres = [], [], [], []
    for path in expand_inputs(inputs):
        for where, record in read_records(path):
            if isinstance(record, UserError):
                raise record
            if not isinstance(record, dict) or "prompt" not in record:
                raise UserError(f"{where}: no `prompt` field — task=grpo records need prompt (text or "
                                "[{role, content}] messages) and the fields the reward functions read")
            prompt = record["prompt"]
            if _messages(prompt, where):
                try:
                    text = tokenizer.apply_chat_template(prompt, tools=tools or None, tokenize=False,
                                                         add_generation_prompt=True)
                except Exception as e:  # noqa: BLE001 - no chat template, or one that fails on these messages
                    raise UserError(f"{where}: chat messages need the tokenizer's chat template, which failed "
                                    f"({one_line(e)}); give text prompts, or a data.tokenizer with a chat "
                                    "template") from None
            else:
                text = prompt
            tokens = tokenizer.encode(text, add_special_tokens=False)
            if len(tokens) > max_prompt_tokens:
                raise UserError(f"{where}: the prompt is {len(tokens)} tokens; with rl.max_new_tokens="
                                f"{max_new_tokens} it needs {len(tokens) + max_new_tokens} positions, more than the "
                                f"model's {max_prompt_tokens + max_new_tokens} — shorten it or lower "
                                "rl.max_new_tokens")
            ids.append(tokens)
            prompts.append(prompt)
            rows.append({k: v for k, v in record.items() if k != "prompt"})
            wheres.append(where)
    if not ids:
        raise UserError(f"data.input={inputs}: no records — give a JSON/JSONL file of {{prompt, ...}} records")
    keys = sorted({k for row in rows for k in row})
    return PromptSet(ids, prompts, {k: [row.get(k) for row in rows] for k in keys}, wheres)


class PromptOrder:
    """Which prompts a step draws: draw i is prompt perm_e[i mod size] of epoch e = i // size, with perm_e a
    permutation seeded by (seed, e). Its state is the number of draws so far."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.taken = size, seed, 0
        self._epoch, self._perm = -1, None

    def take(self, count: int) -> List[int]:
        """Prompt indices of the next `count` draws (draw numbers taken .. taken + count − 1)."""
        out = []
        for i in range(self.taken, self.taken + count):
            epoch, pos = divmod(i, self.size)
            if epoch != self._epoch:
                self._epoch, self._perm = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.size)
            out.append(int(self._perm[pos]))
        self.taken += count
        return out

    def state_dict(self) -> dict:
        return {"taken": self.taken}

    def load_state_dict(self, state: dict) -> None:
        self.taken = int(state["taken"])
