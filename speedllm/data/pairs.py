"""Preference pairs for DPO (data.format=pairs): records -> (prompt turns, chosen reply, rejected reply) -> two
rows rendered with the chat template whose labels cover the reply only (its content and end-of-turn token).

Record layouts, recognized per record:
    {"prompt": str | messages, "chosen": str | messages, "rejected": str | messages, "system"?: str}
    alpaca pairwise (LLaMA-Factory, MindSpeed-LLM): {"instruction", "input"?, "system"?, "chosen", "rejected"}
    sharegpt pairwise (LLaMA-Factory, MindSpeed-LLM): {"conversations": [{from, value}], "chosen": {from, value},
        "rejected": {from, value}}
    chat messages (TRL): {"chosen": [messages], "rejected": [messages]}, the same prompt turns, then the replies
A reply given as messages is its last assistant message. A dataset item is {"tokens", "labels"} of shape [2, S]
(row 0 chosen, row 1 rejected); the loader stacks items into [B, 2, S].
"""

from typing import Dict, List, Tuple

import numpy as np

from speedllm.data.datasets import split_range
from speedllm.data.preprocess import expand_inputs, read_records
from speedllm.data.sft import SFTSamples, _bad, encode_conversation, make_row, to_messages
from speedllm.errors import UserError


def _reply(value, side: str, where: str) -> str:
    """A reply as text: a string, a {from, value} turn, or messages ending in the assistant's."""
    if isinstance(value, dict):
        value = value.get("value", value.get("content"))
    elif isinstance(value, list):
        value = value[-1].get("content") if value and isinstance(value[-1], dict) else None
    if not isinstance(value, str) or not value.strip():
        raise _bad(where, f"empty {side} reply", f"give every pair a non-empty {side} answer or drop the record")
    return value


def to_pair(record, where: str) -> Tuple[List[Dict[str, str]], str, str]:
    """(prompt messages, chosen text, rejected text) of one record in any of the layouts above."""
    if not isinstance(record, dict) or "chosen" not in record or "rejected" not in record:
        raise _bad(where, "missing key chosen/rejected", "preference records need chosen and rejected (and a "
                   "prompt, instruction or conversations)")
    chosen, rejected = _reply(record["chosen"], "chosen", where), _reply(record["rejected"], "rejected", where)
    system = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    if "prompt" in record:
        prompt = record["prompt"]
        prompt = system + ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt))
    elif "instruction" in record:
        prompt = to_messages({**record, "output": ""}, "alpaca", where)[:-1]
    elif "conversations" in record:
        prompt = to_messages(record, "sharegpt", where)
    elif isinstance(record["chosen"], list):
        prompt = list(record["chosen"][:-1])
    else:
        raise _bad(where, "missing key prompt", "give prompt (or instruction, or conversations) with the pair")
    if not prompt or not any(str(m.get("content", "")).strip() for m in prompt):
        raise _bad(where, "empty prompt", "give every pair a non-empty prompt")
    return prompt, chosen, rejected


class PairDataset:
    """Infinite, seeded sequence of pairs: epoch e visits every pair once in the order drawn with (seed, e)."""

    def __init__(self, rows: SFTSamples, seq_len: int, pad_id: int, seed: int):
        if not rows.ids:
            raise UserError("data.format=pairs: no pairs in this split — check data.input and data.split")
        self.rows, self.seq_len, self.pad_id, self.seed = rows, seq_len, pad_id, seed
        self.num_pairs = len(rows.ids) // 2

    def __getitem__(self, k: int) -> Dict[str, np.ndarray]:
        epoch, index = divmod(k, self.num_pairs)
        pair = int(np.random.default_rng([self.seed, epoch]).permutation(self.num_pairs)[index])
        chosen, rejected = (make_row(self.rows, [2 * pair + side], self.seq_len, self.pad_id) for side in (0, 1))
        return {key: np.stack([chosen[key], rejected[key]]) for key in ("tokens", "labels")}


def load_pairs(inputs, tokenizer, seq_len: int, split="1,0,0", split_name: str = "train") -> SFTSamples:
    """Encode every pair of one split as two rows (chosen at 2i, rejected at 2i+1); replies longer than the
    room the prompt leaves are truncated, a prompt that leaves no room is an error naming its record."""
    rows = SFTSamples()
    records = [(w, r) for path in expand_inputs(inputs) for w, r in read_records(path)]
    start, end = split_range(len(records), split, split_name)
    for where, record in records[start:end]:
        if isinstance(record, UserError):
            raise record
        prompt, *replies = to_pair(record, where)
        for reply in replies:
            ids, mask = encode_conversation(tokenizer, prompt + [{"role": "assistant", "content": reply}], "last",
                                            where)
            prompt_len = int(np.argmax(mask))
            if prompt_len >= seq_len - 1:
                raise UserError(f"{where}: the prompt is {prompt_len} tokens but train.seq_len={seq_len} — raise "
                                "train.seq_len or shorten the prompt")
            if len(ids) > seq_len:
                ids, mask = ids[:seq_len], mask[:seq_len]
                rows.truncated += 1
            rows.ids.append(ids)
            rows.masks.append(mask)
    return rows
