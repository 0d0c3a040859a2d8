"""task=chat driven through a pseudo-terminal: two turns with history, /reset, a fresh turn, then /exit; every
reply equals transformers' greedy reply to the same chat-templated history."""

import os
import pty
import select
import subprocess
import time

import pytest
import torch

from speedllm.data.tokenizer import load_tokenizer
from speedllm.paths import ASSETS

pytestmark = pytest.mark.numerics

DEMO_TOKENIZER = ASSETS / "tokenizers" / "demo"
NEW_TOKENS = 8


class Terminal:
    """A process on a pseudo-terminal: read its output up to a marker, type lines into it."""

    def __init__(self, argv, cwd):
        self.fd, child = pty.openpty()
        self.proc = subprocess.Popen(argv, stdin=child, stdout=child, stderr=child, cwd=cwd, close_fds=True)
        os.close(child)
        self.seen = ""

    def read_until(self, marker: str, timeout: float = 180) -> str:
        """Output up to and including the next `marker` (the text read past it is kept for the next call)."""
        deadline = time.monotonic() + timeout
        while marker not in self.seen:
            assert time.monotonic() < deadline, f"no {marker!r} in output:\n{self.seen}"
            ready, _, _ = select.select([self.fd], [], [], 1.0)
            if ready:
                try:
                    self.seen += os.read(self.fd, 4096).decode("utf-8", errors="replace")
                except OSError:  # the child closed the terminal
                    assert marker in self.seen, f"process ended without {marker!r}:\n{self.seen}"
        head, _, self.seen = self.seen.partition(marker)
        return head

    def type(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())


def reference_reply(hf, tok, history, thinking=False):
    """transformers' greedy reply to the chat-templated history (stopping at the end of turn)."""
    text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    out = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
    return tok.decode([t for t in out if t != tok.eos_token_id], skip_special_tokens=True)


def test_chat_two_turns_then_exit(tmp_path, save_tiny_hf, launch_argv):
    tok = load_tokenizer(str(DEMO_TOKENIZER))
    hf = save_tiny_hf(tmp_path / "hf", vocab_size=len(tok), max_position_embeddings=512, rope_theta=1e6,
                      tie_word_embeddings=True)

    term = Terminal(launch_argv(tmp_path / "run", "hardware=cpu", "task=chat", "model=hf",
                                f"checkpoint.load_hf={tmp_path}/hf", f"generate.max_new_tokens={NEW_TOKENS}"),
                    cwd=tmp_path)
    assert "/reset" in term.read_until("you> ")
    history = []
    for line in ["Good morrow, sweet prince", "What news?", "/reset", "What news?"]:
        term.type(line)
        if line == "/reset":
            assert "(history cleared)" in term.read_until("you> ")
            history = []
            continue
        term.read_until("assistant> ")
        reply = term.read_until("you> ").strip()
        history.append({"role": "user", "content": line})
        expected = reference_reply(hf, tok, history)
        assert reply == expected.strip()
        history.append({"role": "assistant", "content": expected})
    term.type("/exit")
    assert term.proc.wait(timeout=60) == 0
