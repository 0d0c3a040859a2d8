"""task=chat: an interactive terminal chat with the tokenizer's chat template and multi-turn history.

    python launch.py task=chat checkpoint.load_hf=<Qwen3 dir> model=hf [generate.temperature=0.7]

Commands: /reset clears the history, /think switches Qwen3's thinking on or off (generate.enable_thinking
is the start value), /exit (or end of input) quits. Under tensor parallelism rank 0 reads the terminal
and every rank generates each reply together.
"""

from typing import List, Optional

import torch.distributed as dist
from omegaconf import DictConfig

from speedllm.data.tokenizer import pad_id_of, stop_ids_of, tokenizer_for
from speedllm.errors import UserError
from speedllm.generation.engine import Detokenizer, generate_ids
from speedllm.generation.load import load_model
from speedllm.generation.sampling import Sampling
from speedllm.hardware import DTYPES
from speedllm.models.rope import max_positions
from speedllm.planner.spec import INFERENCE
from speedllm.runtime import Runtime

PROMPT = "you> "
HELP = "/reset clears the history, /think toggles thinking, /exit quits"


def read_line(rt: Runtime) -> Optional[str]:
    """The user's next line on rank 0 (None at end of input), shared with every rank."""
    line = None
    if rt.is_main:
        try:
            line = input(PROMPT)
        except EOFError:
            print()
    if dist.is_initialized():
        shared = [line]
        dist.broadcast_object_list(shared, src=0)
        line = shared[0]
    return line


def prompt_ids(tokenizer, history: List[dict], thinking: bool, budget: int) -> List[int]:
    """The chat-templated history ending in the assistant's turn; the oldest exchanges drop out past `budget`."""
    while True:
        text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=thinking)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= budget or len(history) <= 1:
            return ids[-budget:]
        del history[:2]


def run(cfg: DictConfig, rt: Runtime) -> None:
    """task=chat: read a line, answer it with the whole conversation as context, until /exit."""
    gen = cfg.generate
    model = load_model(cfg, rt)
    tokenizer = tokenizer_for(cfg)
    if not tokenizer.chat_template:
        raise UserError(f"data.tokenizer={cfg.data.tokenizer} has no chat template; task=chat needs a tokenizer "
                        "with one (e.g. a Qwen3 tokenizer directory)")
    stop_ids, pad_id = stop_ids_of(tokenizer), pad_id_of(tokenizer)
    budget = max_positions(cfg.model) - gen.max_new_tokens
    history: List[dict] = []
    thinking = gen.enable_thinking
    if rt.is_main:
        print(f"chat with {cfg.model.name} ({HELP})", flush=True)
    turn = 0
    while True:
        line = read_line(rt)
        if line is None or line.strip() == "/exit":
            break
        command = line.strip()
        if command == "/reset":
            history = []
            if rt.is_main:
                print("(history cleared)", flush=True)
            continue
        if command == "/think":
            thinking = not thinking
            if rt.is_main:
                print(f"(thinking {'on' if thinking else 'off'})", flush=True)
            continue
        if not command:
            continue
        history.append({"role": "user", "content": line})
        ids = prompt_ids(tokenizer, history, thinking, budget)
        stream = None
        if rt.is_main:
            print("assistant> ", end="", flush=True)
            detok = Detokenizer(tokenizer, stop_ids + [pad_id], [])
            stream = lambda token: print(detok.add(token), end="", flush=True)  # noqa: E731
        (reply_ids,) = generate_ids(model, [ids], gen.max_new_tokens, Sampling.from_cfg(gen), stop_ids, pad_id,
                                    DTYPES[cfg.hardware.dtype], seed=gen.seed + turn, tp=cfg.parallel.tp,
                                    on_token=stream)
        turn += 1
        reply = tokenizer.decode([t for t in reply_ids if t not in stop_ids], skip_special_tokens=True)
        history.append({"role": "assistant", "content": reply})
        if rt.is_main:
            print(flush=True)


SPEC = INFERENCE  # a trained model under tensor and data parallelism (speedllm.planner.spec)
