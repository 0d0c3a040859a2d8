"""Tokenizer loading (any HF tokenizer directory) and a cheap vocabulary-size probe for config checks."""

import json
from functools import lru_cache
from pathlib import Path

from speedllm.errors import UserError, reading

FIX = "the tokenizer files are damaged; save the tokenizer again with save_pretrained"


def _check_dir(path: str) -> Path:
    p = Path(path)
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
        raise UserError(
            f"data.tokenizer={path}: no tokenizer.json or tokenizer_config.json there — "
            "point data.tokenizer at an HF tokenizer directory (e.g. assets/tokenizers/qwen3)"
        )
    return p


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """Load an HF tokenizer directory with `transformers.AutoTokenizer` (offline: local files only)."""
    from transformers import AutoTokenizer

    _check_dir(path)
    with reading(f"data.tokenizer={path}", FIX):
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code, local_files_only=True)


@lru_cache(maxsize=None)
def tokenizer_vocab_size(path: str) -> int:
    """Number of token ids the tokenizer can emit (largest id + 1, added tokens included).

    Reads `tokenizer.json` with the `tokenizers` library when present (no transformers import), else
    falls back to loading the tokenizer. Used by config validation before launch.
    """
    p = _check_dir(path)
    if (p / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        with reading(f"data.tokenizer={path}: tokenizer.json", FIX):
            tok = Tokenizer.from_file(str(p / "tokenizer.json"))
        size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
        config = p / "tokenizer_config.json"
        if config.is_file():
            with reading(f"data.tokenizer={path}: tokenizer_config.json", FIX):
                added = json.loads(config.read_text()).get("added_tokens_decoder", {})
                size = max([size] + [int(i) + 1 for i in added])
        return size
    tok = load_tokenizer(str(p))
    return max(tok.get_vocab().values()) + 1
