"""Build the bundled tokenizers under speedllm/assets/tokenizers/ (run once; nothing here runs at training time).

qwen3: the real Qwen3 tokenizer, converted from the BPE ranks file `qwen.tiktoken` shipped in the PyPI
       package `dashscope` (151,643 regular tokens) plus Qwen3's 26 added tokens at their exact ids.
demo:  a byte-level BPE trained on the bundled Shakespeare corpus, with Qwen3's pre-tokenizer, special
       tokens and chat template; 8,192 ids in total so it fits the tiny models' embedding.

    pip download --no-deps dashscope -d /tmp/dl && unzip -o /tmp/dl/dashscope-*.whl -d /tmp/dl/dashscope
    python tools/build_tokenizers.py /tmp/dl/dashscope/dashscope/resources/qwen.tiktoken
"""

import json
import lzma
import shutil
import sys
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from tiktoken.load import load_tiktoken_bpe
from transformers.convert_slow_tokenizer import bytes_to_unicode

from speedllm.paths import ASSETS, ROOT

PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3's added tokens in id order (after the regular vocabulary); the flag says "special".
ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
]
DEMO_TOTAL_VOCAB = 8192


def qwen_pipeline(tok: Tokenizer) -> None:
    """Give `tok` Qwen3's normalizer, pre-tokenizer, post-processor and decoder."""
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)


def add_qwen_tokens(tok: Tokenizer) -> None:
    """Append Qwen3's added tokens right after the regular vocabulary, in Qwen3's order."""
    base = tok.get_vocab_size(with_added_tokens=False)
    for i, (content, special) in enumerate(ADDED):
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
        assert tok.token_to_id(content) == base + i, content


def save(tok: Tokenizer, out: Path, model_max_length: int) -> None:
    """Write tokenizer.json and a tokenizer_config.json with Qwen3's settings and chat template."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=False)
    base = tok.get_vocab_size(with_added_tokens=False)
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(base + i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "special": s}
            for i, (c, s) in enumerate(ADDED)
        },
        "additional_special_tokens": [c for c, s in ADDED if s and c not in ("<|endoftext|>", "<|im_end|>")],
        "bos_token": None,
        "chat_template": (ROOT / "tools" / "qwen3_chat_template.jinja").read_text(),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def last_merge(ranks: dict, token: bytes) -> tuple:
    """The pair tiktoken merges last when it encodes `token`: BPE over its bytes with lower ranks only."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best = min(
            (ranks.get(parts[i] + parts[i + 1], ranks[token]), i) for i in range(len(parts) - 1)
        )
        assert best[0] < ranks[token], token
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts[0], parts[1]


def tiktoken_to_bpe(ranks_file: str) -> Tokenizer:
    """An HF BPE equal to tiktoken on these ranks: one merge per token, ordered by rank."""
    ranks = load_tiktoken_bpe(ranks_file)
    byte_encoder = bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(byte_encoder[x] for x in b)

    vocab = {to_str(t): r for t, r in ranks.items()}
    merges = [tuple(map(to_str, last_merge(ranks, t))) for t in sorted(ranks, key=ranks.get) if len(t) > 1]
    # ignore_merges: a pre-token that is itself in the vocabulary is emitted whole, as tiktoken does.
    return Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))


def build_qwen3(ranks_file: str) -> None:
    """speedllm/assets/tokenizers/qwen3 from the original ranks file, which is copied beside it."""
    tok = tiktoken_to_bpe(ranks_file)
    qwen_pipeline(tok)
    assert tok.get_vocab_size(with_added_tokens=False) == 151643
    add_qwen_tokens(tok)
    out = ASSETS / "tokenizers" / "qwen3"
    save(tok, out, model_max_length=131072)
    # The original ranks ship beside it so tests can check our tokenizer against tiktoken offline.
    shutil.copyfile(ranks_file, out / "qwen.tiktoken")
    print(f"qwen3 tokenizer: {tok.get_vocab_size()} ids -> {out}")


def build_demo() -> None:
    """speedllm/assets/tokenizers/demo: BPE trained on the bundled corpus (run tools/build_corpus.py first)."""
    tok = Tokenizer(BPE(fuse_unk=False))
    qwen_pipeline(tok)
    trainer = BpeTrainer(
        vocab_size=DEMO_TOTAL_VOCAB - len(ADDED),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with lzma.open(ASSETS / "corpus" / "shakespeare.jsonl.xz", "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    tok.train_from_iterator(texts, trainer=trainer)
    add_qwen_tokens(tok)
    assert tok.get_vocab_size() == DEMO_TOTAL_VOCAB, tok.get_vocab_size()
    out = ASSETS / "tokenizers" / "demo"
    save(tok, out, model_max_length=4096)
    print(f"demo tokenizer: {tok.get_vocab_size()} ids -> {out}")


if __name__ == "__main__":
    build_qwen3(sys.argv[1])
    build_demo()
