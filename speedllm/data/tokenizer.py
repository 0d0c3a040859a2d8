"""Tokenizer loading (any HF tokenizer directory), the ids generation needs (stop, pad), and a cheap
vocabulary-size probe for config checks."""

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
            "point data.tokenizer at an HF tokenizer directory (e.g. '${asset:tokenizers/qwen3}', the bundled one)"
        )
    return p


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """Load an HF tokenizer directory with `transformers.AutoTokenizer` (offline: local files only)."""
    from transformers import AutoTokenizer

    _check_dir(path)
    with reading(f"data.tokenizer={path}", FIX):
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code, local_files_only=True)


def tokenizer_for(cfg):
    """The tokenizer of data.tokenizer (for a checkpoint: the one it was trained with)."""
    return load_tokenizer(str(cfg.data.tokenizer), cfg.data.trust_remote_code)


def stop_ids_of(tokenizer) -> list:
    """Token ids that end a completion: eos, Qwen's end of turn and end of text, when the tokenizer has them."""
    ids = {tokenizer.eos_token_id}
    for token in ("<|im_end|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)


def pad_id_of(tokenizer) -> int:
    """The id that fills left padding and finished rows (never attended to, never returned)."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return tid
    return 0


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
