"""SFT: chat-template rendering, label masks (all / assistant / last), formats, overlong handling, packing."""

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from speedllm.data.sft import (
    SFTDataset, SFTSamples, encode_conversation, has_generation_markers, load_sft_samples, make_row, to_messages,
)
from speedllm.errors import UserError
from speedllm.ops import IGNORE_INDEX
from speedllm.paths import ASSETS

pytestmark = pytest.mark.unit

CONV = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 10 + 7?"},
    {"role": "assistant", "content": "17"},
]
# The same conversation as ChatML pieces written by hand: (text, turn) where turn is None outside the
# assistant's output, else the index of the assistant turn. Qwen3's template writes an empty think block
# before the final answer.
PIECES = [
    ("<|im_start|>system\nYou add numbers.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n", None),
    ("<|im_start|>assistant\n", None), ("5<|im_end|>", 0), ("\n", None),
    ("<|im_start|>user\nAnd 10 + 7?<|im_end|>\n<|im_start|>assistant\n", None),
    ("<think>\n\n</think>\n\n17<|im_end|>", 1), ("\n", None),
]


@pytest.fixture(scope="module", params=["demo", "qwen3"])
def tok(request):
    return AutoTokenizer.from_pretrained(str(ASSETS / "tokenizers" / request.param))


def expected(tok, keep):
    ids, mask = [], []
    for text, turn in PIECES:
        piece = tok.encode(text, add_special_tokens=False)
        ids += piece
        mask += [int(keep(turn))] * len(piece)
    return ids, mask


@pytest.mark.parametrize("loss_on,keep", [
    ("assistant", lambda t: t is not None), ("last", lambda t: t == 1), ("all", lambda t: True),
])
def test_handcrafted_conversation_mask(tok, loss_on, keep):
    ids, mask = encode_conversation(tok, CONV, loss_on)
    ref_ids, ref_mask = expected(tok, keep)
    assert ids.tolist() == ref_ids
    assert mask.tolist() == ref_mask
    row = make_row(SFTSamples([ids], [mask]), [0], len(ids) + 3, pad_id=0)
    labels = row["labels"].tolist()
    # label of position t is token t+1 exactly where token t+1 is trained
    want = [ref_ids[t + 1] if ref_mask[t + 1] else IGNORE_INDEX for t in range(len(ref_ids) - 1)] + [IGNORE_INDEX] * 4
    assert labels == want


def test_template_without_generation_markers_gives_same_mask(tok):
    plain = AutoTokenizer.from_pretrained(tok.name_or_path)
    plain.chat_template = tok.chat_template.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    assert not has_generation_markers(plain)
    for loss_on in ("assistant", "last"):
        a, b = encode_conversation(tok, CONV, loss_on), encode_conversation(plain, CONV, loss_on)
        assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()


def test_three_formats_agree():
    alpaca = to_messages({"instruction": "Add.", "input": "2 + 3", "output": "5"}, "alpaca", "x")
    assert alpaca == [{"role": "user", "content": "Add.\n\n2 + 3"}, {"role": "assistant", "content": "5"}]
    sharegpt = json.loads((ASSETS / "sft_demo" / "sharegpt.json").read_text())
    with open(ASSETS / "sft_demo" / "messages.jsonl") as f:
        messages = [json.loads(line) for line in f]
    alpaca_rows = json.loads((ASSETS / "sft_demo" / "alpaca.json").read_text())
    assert len(sharegpt) == len(messages) == len(alpaca_rows)
    for i in range(50):
        assert to_messages(sharegpt[i], "sharegpt", "x") == to_messages(messages[i], "messages", "x")
        assert to_messages(alpaca_rows[i], "alpaca", "x")[-1] == to_messages(messages[i], "messages", "x")[-1]


def test_heldout_questions_are_new_and_answers_check():
    with open(ASSETS / "sft_demo" / "messages.jsonl") as f:
        seen = {m["content"] for line in f for m in json.loads(line)["messages"] if m["role"] == "user"}
    with open(ASSETS / "sft_demo" / "heldout.jsonl") as f:
        held = [json.loads(line) for line in f]
    assert held and all(h["question"] not in seen for h in held)
    for h in held:
        nums = [int(x) for x in h["question"].rstrip("?").replace(",", "").split() if x.isdigit()]
        q = h["question"]
        want = nums[0] + nums[1] if "+" in q else nums[0] - nums[1] if "-" in q else max(nums) if "larger" in q \
            else nums[0] + 1
        assert h["answer"] == str(want)


def test_overlong_truncate_and_drop(tmp_path, tok):
    src = tmp_path / "m.jsonl"
    long = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 200}]}
    unanswered = {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]}
    short = {"messages": CONV}
    src.write_text("".join(json.dumps(r) + "\n" for r in (short, long, unanswered)))
    t = load_sft_samples(str(src), "messages", tok, "assistant", 64, "truncate", "fail")
    # the unanswered one's first 64 tokens hold no assistant token: nothing to train, so it is dropped
    assert (len(t.ids), t.truncated, t.dropped) == (2, 1, 1) and max(map(len, t.ids)) == 64 and t.masks[1].any()
    d = load_sft_samples(str(src), "messages", tok, "assistant", 64, "drop", "fail")
    assert (len(d.ids), d.truncated, d.dropped) == (1, 0, 2)
    src.write_text(json.dumps(unanswered) + "\n")
    with pytest.raises(UserError, match=r"all 1 samples dropped, .* train.seq_len=64 — raise train.seq_len"):
        SFTDataset(load_sft_samples(str(src), "messages", tok, "assistant", 64, "truncate", "fail"), 64, 0, True, 0)


def test_bad_records(tmp_path, tok):
    src = tmp_path / "m.jsonl"
    src.write_text(json.dumps({"messages": CONV}) + "\n" + json.dumps({"msgs": []}) + "\n{oops\n")
    with pytest.raises(UserError, match=r"m.jsonl:2: missing key messages"):
        load_sft_samples(str(src), "messages", tok, "assistant", 128, "truncate", "fail")
    s = load_sft_samples(str(src), "messages", tok, "assistant", 128, "truncate", "skip")
    assert len(s.ids) == 1 and s.skipped == {"missing key messages": 1, "malformed JSON line": 1}


def test_packing_boundaries(tok):
    samples = load_sft_samples(str(ASSETS / "sft_demo" / "messages.jsonl"), "messages", tok, "assistant",
                               96, "truncate", "fail", "969,30,1", "valid")
    assert len(samples.ids) + samples.dropped == 66  # 3% of the 2,200 records; tool ones are too long
    ds = SFTDataset(samples, 96, pad_id=tok.pad_token_id, packing=True, seed=3)
    seen = []
    for k in range(len(ds)):
        row = ds[k]
        doc, pos, tokens, labels = (row[n].tolist() for n in ("document_ids", "position_ids", "tokens", "labels"))
        # attention allowed from i to j iff j <= i and same document: block-diagonal causal
        allowed = np.tril(np.equal.outer(row["document_ids"], row["document_ids"]))
        for d in sorted(set(doc)):
            span = [i for i, x in enumerate(doc) if x == d]
            assert span == list(range(span[0], span[-1] + 1)), "a document is one contiguous span"
            assert [pos[i] for i in span] == list(range(len(span))), "positions restart per document"
            assert allowed[span[0]:span[-1] + 1, : span[0]].sum() == 0, "no attention into earlier samples"
            if d < max(doc) or tokens[span[-1]] != tok.pad_token_id:
                match = [i for i in range(len(samples.ids)) if samples.ids[i].tolist() == [tokens[i] for i in span]]
                assert match, "each document is exactly one sample"
                seen.append(match[0])
                assert labels[span[-1]] == IGNORE_INDEX, "no label crosses into the next sample"
        assert sum(1 for x in labels if x != IGNORE_INDEX) > 0
    assert sorted(seen) == list(range(len(samples.ids))), "one epoch packs every sample exactly once"


def test_end_of_run_samples_render_the_whole_multi_turn_prompt(tmp_path):
    from omegaconf import OmegaConf

    from speedllm.train.samples import sample_prompts

    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
             {"role": "assistant", "content": "6"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
    cfg = OmegaConf.create({"data": {"format": "messages", "input": str(tmp_path / "chat.jsonl"), "split": "0,1,0"},
                            "generate": {"num_samples": 1}})
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tokenizers" / "qwen3")
    expected = tokenizer.apply_chat_template(turns[:4], tokenize=False, add_generation_prompt=True)
    assert sample_prompts(cfg, tokenizer) == [expected]
    assert "2+2?" in expected and "4" in expected and "and 3+3?" in expected


def test_tool_samples_show_the_schema_and_train_the_call_not_the_tools_answer(tok):
    from speedllm.data.sft import record_tools

    with open(ASSETS / "sft_demo" / "messages.jsonl") as f:
        record = next(r for r in map(json.loads, f) if "<tool_call>" in json.dumps(r))
    ids, mask = encode_conversation(tok, to_messages(record, "messages", "x"), "assistant", "x",
                                    record_tools(record, "x"))
    text = tok.apply_chat_template(record["messages"], tools=record["tools"], tokenize=False)
    assert '<tools>\n{"type": "function", "function": {"name": "calculator"' in text
    assert ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]
    call, answer = record["messages"][2]["content"], record["messages"][4]["content"]
    assert tok.decode(ids[mask == 1]) == f"{call}<|im_end|><think>\n\n</think>\n\n{answer}<|im_end|>"
