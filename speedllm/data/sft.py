"""Supervised fine-tuning data: alpaca / sharegpt / OpenAI-messages records -> chat-template tokens,
a loss mask (all tokens, assistant turns, or the last assistant turn), overlong handling, and packing.

Shapes: S = sequence length of one row. A row holds one sample (padded) or, packed, several samples
back to back; `position_ids` restart at 0 for every sample and `document_ids` number the samples of a
row, so attention masked by document never crosses from one sample into another.
"""

import json
import re
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import numpy as np

from speedllm.data.datasets import split_range
from speedllm.data.preprocess import expand_inputs, read_records
from speedllm.errors import UserError
from speedllm.ops import IGNORE_INDEX

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "observation": "tool", "tool": "tool", "function": "tool"}


def _bad(where: str, what: str, fix: str) -> UserError:
    err = UserError(f"{where}: {what} — {fix}")
    err.reason = what.split(" (")[0]
    return err


def to_messages(record, fmt: str, where: str) -> List[Dict[str, str]]:
    """One record of format alpaca | sharegpt | messages as OpenAI-style [{role, content}, ...]."""
    if not isinstance(record, dict):
        raise _bad(where, "not a JSON object", "write one object per record")
    if fmt == "alpaca":
        if "instruction" not in record or "output" not in record:
            raise _bad(where, "missing key instruction/output", "alpaca records need instruction, input, output")
        if not all(isinstance(record.get(k, ""), str) for k in ("instruction", "input", "output", "system")):
            raise _bad(where, "non-text field", "alpaca instruction, input, output and system must be strings")
        prompt = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
        msgs = [{"role": "system", "content": record["system"]}] if record.get("system") else []
        return msgs + [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
    if fmt == "sharegpt":
        if "conversations" not in record:
            raise _bad(where, "missing key conversations", "sharegpt records need conversations: [{from, value}]")
        msgs = []
        if not isinstance(record["conversations"], list):
            raise _bad(where, "conversations is not a list", "sharegpt records need conversations: [{from, value}]")
        for turn in record["conversations"]:
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                raise _bad(where, "bad turn", "each turn is an object {from, value} with a string value")
            role = SHAREGPT_ROLES.get(turn.get("from"))
            if role is None or "value" not in turn:
                raise _bad(where, f"bad turn (from={turn.get('from')!r})",
                           f"each turn needs from in {sorted(SHAREGPT_ROLES)} and value")
            msgs.append({"role": role, "content": turn["value"]})
        return msgs
    if fmt == "messages":
        if "messages" not in record:
            raise _bad(where, "missing key messages", "records need messages: [{role, content}]")
        if not isinstance(record["messages"], list):
            raise _bad(where, "messages is not a list", "records need messages: [{role, content}]")
        for m in record["messages"]:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise _bad(where, "bad message", "each message needs a string role and a string content")
        return [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    raise UserError(f"data.format={fmt}: must be pretrain, alpaca, sharegpt or messages")


def record_tools(record, where: str):
    """A messages or sharegpt record's `tools`: the JSON schemas its chat template shows (None without)."""
    tools = record.get("tools") if isinstance(record, dict) else None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise _bad(where, "tools is not a list of objects", "give tools as a list of JSON function schemas")
    return tools or None


def has_generation_markers(tokenizer) -> bool:
    """True when the chat template marks assistant output with {% generation %} (HF's assistant mask)."""
    return bool(re.search(r"{%-?\s*generation\s*-?%}", tokenizer.chat_template or ""))


def _assistant_mask_by_search(tokenizer, messages, text: str, where: str, tools=None) -> Tuple[List[int], List[int]]:
    """Tokens and assistant mask for templates without generation markers.

    Walks the rendered text message by message, finding each content after the previous one. An
    assistant span starts where the generation prompt of the conversation so far ends, when that
    rendering is a prefix of the text (so a think block the template adds is trained too), else at
    the content; it also covers the eos token that closes it when the template writes one right after.
    """
    spans, cursor = [], 0
    eos = tokenizer.eos_token or ""
    for i, m in enumerate(messages):
        start = text.find(m["content"], cursor)
        if start < 0:
            raise _bad(where, f"the chat template rewrites a {m['role']} message",
                       "use a template with {% generation %} markers or data.loss_on=all")
        end = start + len(m["content"])
        if eos and text.startswith(eos, end):
            end += len(eos)
        if m["role"] == "assistant":
            head = start
            if i > 0:
                prompt = tokenizer.apply_chat_template(messages[:i], tools=tools, tokenize=False,
                                                       add_generation_prompt=True)
                if text.startswith(prompt) and cursor <= len(prompt) <= start:
                    head = len(prompt)
            spans.append((head, end))
        cursor = end
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s <= a < e for s, e in spans)) for a, _ in enc["offset_mapping"]]
    return enc["input_ids"], mask


def last_run(mask: np.ndarray) -> np.ndarray:
    """Keep only the last contiguous run of ones (the last assistant turn)."""
    ones = np.flatnonzero(mask)
    out = np.zeros_like(mask)
    if len(ones):
        end = ones[-1]
        start = end
        while start > 0 and mask[start - 1]:
            start -= 1
        out[start:end + 1] = 1
    return out


def encode_conversation(tokenizer, messages, loss_on: str, where: str = "",
                        tools=None) -> Tuple[np.ndarray, np.ndarray]:
    """(token ids [n], loss mask [n]) of one conversation rendered with the tokenizer's chat template.

    loss_on: "all" trains on every token, "assistant" on every assistant turn (its content and closing
    end-of-turn token, not the role header), "last" on the last assistant turn only.
    tools: JSON schemas the template shows (its `tools=`), or None.
    """
    if loss_on not in ("all", "assistant", "last"):
        raise UserError(f"data.loss_on={loss_on}: must be all, assistant or last")
    if not any(m["role"] == "assistant" for m in messages):
        raise _bad(where, "no assistant turn", "every SFT sample needs at least one assistant message")
    if has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = out["input_ids"], out["assistant_masks"]
    else:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        ids, mask = _assistant_mask_by_search(tokenizer, messages, text, where, tools)
    ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.int64)
    if loss_on == "all":
        mask = np.ones_like(mask)
    elif loss_on == "last":
        mask = last_run(mask)
    return ids, mask


@dataclass
class SFTSamples:
    """Encoded samples of one split and what happened to the rest."""

    ids: List[np.ndarray] = field(default_factory=list)
    masks: List[np.ndarray] = field(default_factory=list)
    truncated: int = 0
    dropped: int = 0
    skipped: Dict[str, int] = field(default_factory=dict)


def load_sft_samples(inputs, fmt: str, tokenizer, loss_on: str, seq_len: int, overlong: str, on_error: str,
                     split="1,0,0", split_name: str = "train") -> SFTSamples:
    """Read, render and mask the records of one split; samples longer than seq_len are truncated or
    dropped (counted; one whose first seq_len tokens train nothing is dropped). The split is contiguous over the
    records, as data.split weights say."""
    if overlong not in ("truncate", "drop"):
        raise UserError(f"data.overlong={overlong}: must be truncate or drop")
    out = SFTSamples()
    records = [(w, r) for path in expand_inputs(inputs) for w, r in read_records(path)]
    start, end = split_range(len(records), split, split_name)
    for where, record in records[start:end]:
        try:
            if isinstance(record, UserError):
                raise record
            ids, mask = encode_conversation(tokenizer, to_messages(record, fmt, where), loss_on, where,
                                            record_tools(record, where))
        except UserError as e:
            if on_error == "fail" or not hasattr(e, "reason"):
                raise
            out.skipped[e.reason] = out.skipped.get(e.reason, 0) + 1
            continue
        if len(ids) > seq_len:
            if overlong == "drop" or not mask[:seq_len].any():  # nothing left to learn from a truncated one
                out.dropped += 1
                continue
            ids, mask = ids[:seq_len], mask[:seq_len]
            out.truncated += 1
        out.ids.append(ids)
        out.masks.append(mask)
    return out


def pack(lengths: List[int], order: np.ndarray, seq_len: int) -> List[List[int]]:
    """Group sample ids (in `order`) into rows of at most seq_len tokens, filling each row in turn."""
    rows, row, used = [], [], 0
    for i in order:
        n = lengths[i]
        if row and used + n > seq_len:
            rows.append(row)
            row, used = [], 0
        row.append(int(i))
        used += n
    if row:
        rows.append(row)
    return rows


def make_row(samples: SFTSamples, members: List[int], seq_len: int, pad_id: int) -> Dict[str, np.ndarray]:
    """One row of S = seq_len positions from the samples `members`, already shifted for next-token loss.

    Position t of a sample predicts its token t+1 when that token is in the loss mask; a sample's last
    position predicts nothing, so no loss crosses into the next sample. Padding is its own document.
    """
    tokens = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    position_ids = np.arange(seq_len, dtype=np.int64)
    document_ids = np.full(seq_len, len(members), dtype=np.int64)
    at = 0
    for doc, i in enumerate(members):
        ids, mask = samples.ids[i], samples.masks[i]
        n = len(ids)
        tokens[at:at + n] = ids
        labels[at:at + n - 1] = np.where(mask[1:] == 1, ids[1:], IGNORE_INDEX)
        position_ids[at:at + n] = np.arange(n)
        document_ids[at:at + n] = doc
        at += n
    position_ids[at:] = np.arange(seq_len - at)
    return {"tokens": tokens, "labels": labels, "position_ids": position_ids, "document_ids": document_ids}


class SFTDataset:
    """Infinite, seeded sequence of rows: epoch e shuffles the samples with (seed, e) and packs them
    (or takes one sample per row when packing is off); `ds[k]` is row k counted across epochs."""

    def __init__(self, samples: SFTSamples, seq_len: int, pad_id: int, packing: bool, seed: int):
        if samples.dropped and not samples.ids:
            raise UserError(f"SFT data: all {samples.dropped} samples dropped, none trains a token within "
                            f"train.seq_len={seq_len} — raise train.seq_len")
        if not samples.ids:
            raise UserError("SFT data: no usable samples in this split — check data.input, data.format, data.split")
        self.samples, self.seq_len, self.pad_id = samples, seq_len, pad_id
        self.packing, self.seed = packing, seed
        self.lengths = [len(x) for x in samples.ids]
        self._epochs: List[List[List[int]]] = []
        self._starts = [0]

    def _rows(self, epoch: int) -> List[List[int]]:
        while len(self._epochs) <= epoch:
            e = len(self._epochs)
            order = np.random.default_rng([self.seed, e]).permutation(len(self.lengths))
            rows = pack(self.lengths, order, self.seq_len) if self.packing else [[int(i)] for i in order]
            self._epochs.append(rows)
            self._starts.append(self._starts[-1] + len(rows))
        return self._epochs[epoch]

    def __len__(self) -> int:
        return len(self._rows(0))

    def __getitem__(self, k: int) -> Dict[str, np.ndarray]:
        epoch = 0
        while self._starts[-1] <= k:
            self._rows(len(self._epochs))
        while self._starts[epoch + 1] <= k:
            epoch += 1
        members = self._rows(epoch)[k - self._starts[epoch]]
        row = make_row(self.samples, members, self.seq_len, self.pad_id)
        # One sample per row needs no document structure: causal attention already ends at the padding.
        return row if self.packing else {"tokens": row["tokens"], "labels": row["labels"]}


def describe(samples: SFTSamples) -> str:
    """One line of counts for the log."""
    return json.dumps({"samples": len(samples.ids), "truncated": samples.truncated, "dropped": samples.dropped,
                       "skipped": samples.skipped})
