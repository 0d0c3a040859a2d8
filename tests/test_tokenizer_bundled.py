"""The bundled tokenizers: Qwen3 equals tiktoken over the original `qwen.tiktoken` ranks; demo fits 8192 ids."""

import pytest
import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import AutoTokenizer

from speedllm.data.tokenizer import load_tokenizer, tokenizer_vocab_size
from speedllm.errors import UserError
from speedllm.paths import ASSETS

pytestmark = pytest.mark.unit

QWEN = ASSETS / "tokenizers" / "qwen3"
DEMO = ASSETS / "tokenizers" / "demo"
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Reference ids from shared/reference/qwen3.md (id: content).
SPECIAL = {
    151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>", 151646: "<|object_ref_start|>",
    151647: "<|object_ref_end|>", 151648: "<|box_start|>", 151649: "<|box_end|>", 151650: "<|quad_start|>",
    151651: "<|quad_end|>", 151652: "<|vision_start|>", 151653: "<|vision_end|>", 151654: "<|vision_pad|>",
    151655: "<|image_pad|>", 151656: "<|video_pad|>", 151657: "<tool_call>", 151658: "</tool_call>",
    151659: "<|fim_prefix|>", 151660: "<|fim_middle|>", 151661: "<|fim_suffix|>", 151662: "<|fim_pad|>",
    151663: "<|repo_name|>", 151664: "<|file_sep|>", 151665: "<tool_response>", 151666: "</tool_response>",
    151667: "<think>", 151668: "</think>",
}
SAMPLE = (
    "The quick brown fox jumps over the lazy dog. It's 12:30, isn't it? They'll say we've won.\n"
    "你好，世界！今天天气很好。机器学习和深度学习。\n"
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # O(2**n)\n"
    "Digits 3.14159265358979 and 1,000,000 and 2026-11-29T20:15:00Z\n"
    "spaces:     five, tabs:\t\t\ttwo, newlines:\n\n\n\nend   \n"
    "Ünïcödé café — naïve façade; Привет мир; 😀🚀 émoji\n"
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|><|endoftext|>"
)


@pytest.fixture(scope="module")
def qwen():
    return AutoTokenizer.from_pretrained(str(QWEN))


@pytest.fixture(scope="module")
def reference():
    ranks = load_tiktoken_bpe(str(QWEN / "qwen.tiktoken"))
    assert len(ranks) == 151643
    return tiktoken.Encoding("qwen3-ref", pat_str=QWEN_PATTERN, mergeable_ranks=ranks,
                             special_tokens={v: k for k, v in SPECIAL.items()})


def test_qwen3_matches_tiktoken_on_multilingual_sample(qwen, reference):
    ours = qwen.encode(SAMPLE, add_special_tokens=False)
    ref = reference.encode(SAMPLE, allowed_special="all")
    assert ours == ref
    assert qwen.decode(ours) == SAMPLE


def test_qwen3_matches_tiktoken_on_corpus_text(qwen, reference):
    import json
    import lzma

    with lzma.open(ASSETS / "corpus" / "shakespeare.jsonl.xz", "rt", encoding="utf-8") as f:
        text = json.loads(f.readline())["text"][:20000]
    assert qwen.encode(text) == reference.encode(text, disallowed_special=())


def test_qwen3_special_tokens(qwen):
    for i, content in SPECIAL.items():
        assert qwen.convert_tokens_to_ids(content) == i
        assert qwen.encode(content) == [i]
    assert qwen.eos_token == "<|im_end|>" and qwen.pad_token == "<|endoftext|>" and qwen.bos_token is None
    assert len(qwen) == 151669 == tokenizer_vocab_size(str(QWEN))


def test_qwen3_chat_template_renders_chatml(qwen):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    text = qwen.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    msgs.append({"role": "assistant", "content": "A"})
    assert qwen.apply_chat_template(msgs, tokenize=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\nA<|im_end|>\n"
    )


def test_demo_tokenizer_fits_tiny_models():
    demo = load_tokenizer(str(DEMO))
    assert tokenizer_vocab_size(str(DEMO)) == len(demo) == 8192
    for offset, content in enumerate(SPECIAL.values()):
        assert demo.convert_tokens_to_ids(content) == 8192 - len(SPECIAL) + offset
    text = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer"
    ids = demo.encode(text)
    assert demo.decode(ids) == text
    assert len(ids) < len(text) / 2.5, "a BPE trained on Shakespeare compresses Shakespeare"
    assert demo.chat_template == load_tokenizer(str(QWEN)).chat_template


def test_missing_tokenizer_dir_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="data.tokenizer="):
        tokenizer_vocab_size(str(tmp_path))
