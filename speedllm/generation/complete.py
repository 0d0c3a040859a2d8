"""Prompts in, completion rows out: encoding (optionally in the chat template), batched generation and
decoding, for task=generate and for the samples a training run prints at its end."""

import copy
from typing import List

import torch
from omegaconf import DictConfig
from torch import nn

from speedllm.data.tokenizer import pad_id_of, stop_ids_of
from speedllm.errors import UserError
from speedllm.generation.engine import StopStrings, generate_ids
from speedllm.generation.sampling import Sampling
from speedllm.hardware import DTYPES


def encode(tokenizer, prompt: str, gen: DictConfig) -> List[int]:
    """Token ids of a prompt, wrapped in the chat template as one user turn when generate.chat_template=true."""
    if gen.chat_template:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True, enable_thinking=gen.enable_thinking)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    if not ids:
        raise UserError("generate: an empty prompt; give every prompt some text")
    return ids


def complete(model: nn.Module, tokenizer, prompts: List[str], gen: DictConfig, dtype: torch.dtype, tp: int = 1,
             stream=None) -> List[dict]:
    """Result rows {prompt, completion, completion_ids} for `prompts`, in batches of generate.batch_size."""
    stop_ids, pad_id = stop_ids_of(tokenizer), pad_id_of(tokenizer)
    stops = StopStrings(tokenizer, gen.stop) if gen.stop else None
    rows = []
    for start in range(0, len(prompts), gen.batch_size):
        batch = prompts[start:start + gen.batch_size]
        ids = generate_ids(model, [encode(tokenizer, p, gen) for p in batch], gen.max_new_tokens,
                           Sampling.from_cfg(gen), stop_ids, pad_id, dtype, seed=gen.seed + start, tp=tp,
                           stop_strings=stops, on_token=stream)
        for prompt, completion_ids in zip(batch, ids):
            text_ids = [t for t in completion_ids if t not in stop_ids]
            text = tokenizer.decode(text_ids, skip_special_tokens=True)
            rows.append({"prompt": prompt, "completion": stops.cut(text) if stops else text,
                         "completion_ids": completion_ids})
    return rows


def sample_texts(model: nn.Module, tokenizer, prompts: List[str], cfg: DictConfig) -> List[str]:
    """Greedy completions (up to generate.max_new_tokens tokens) of `prompts`, e.g. at the end of a training run.

    Every rank of a sharded model must call this with the same prompts (its forwards are collective).
    """
    from torch.distributed.fsdp import FSDPModule

    was_training = model.training
    model.eval()
    # FSDP computes in its mixed-precision dtype; a plain model in the dtype of its weights.
    dtype = DTYPES[cfg.hardware.dtype] if isinstance(model, FSDPModule) else next(model.parameters()).dtype
    gen = copy.copy(cfg.generate)
    gen.temperature, gen.stop, gen.chat_template = 0.0, [], False
    rows = complete(model, tokenizer, prompts, gen, dtype, tp=cfg.parallel.tp)
    model.train(was_training)
    return [row["completion"] for row in rows]
