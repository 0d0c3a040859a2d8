"""A few greedy samples printed at the end of a training run, so the user sees what the model learned."""

from typing import List

import torch
from omegaconf import DictConfig
from torch import nn

# Openings in the style of the bundled corpus (task=pretrain data=demo).
PRETRAIN_PROMPTS = ["ROMEO:\n", "First Citizen:\n", "KING HENRY:\nWhat"]


@torch.no_grad()
def greedy_complete(model: nn.Module, prompt_ids: List[int], max_new_tokens: int, stop_ids: set) -> List[int]:
    """Greedy continuation of one prompt, re-running the full sequence each token (tiny models only).

    Every rank must call this with the same prompt: a sharded (FSDP) model gathers its weights collectively.
    """
    device = next(model.parameters()).device
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits_BSV = model(torch.tensor([ids], device=device))
        next_id = int(logits_BSV[0, -1].argmax())
        if next_id in stop_ids:
            break
        ids.append(next_id)
    return ids[len(prompt_ids):]


def sample_texts(model: nn.Module, tokenizer, prompts: List[str], cfg: DictConfig) -> List[str]:
    """Greedy completions of `prompts` (up to generate.max_new_tokens tokens each)."""
    stop_ids = {i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None}
    was_training = model.training
    model.eval()
    texts = [tokenizer.decode(greedy_complete(model, tokenizer.encode(p), cfg.generate.max_new_tokens, stop_ids))
             for p in prompts]
    model.train(was_training)
    return texts


def sample_prompts(cfg: DictConfig, tokenizer) -> List[str]:
    """Prompts for the end-of-run samples: corpus openings, or (SFT) held-out questions in the chat template."""
    if cfg.data.format == "pretrain":
        return PRETRAIN_PROMPTS
    from speedllm.data.datasets import split_range
    from speedllm.data.preprocess import expand_inputs, read_records
    from speedllm.data.sft import to_messages

    records = [(w, r) for path in expand_inputs(cfg.data.input) for w, r in read_records(path)]
    start, end = split_range(len(records), cfg.data.split, "valid")
    prompts = []
    for where, record in records[start:end][: cfg.generate.num_samples]:
        question = [m for m in to_messages(record, cfg.data.format, where) if m["role"] != "assistant"]
        prompts.append(tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True))
    return prompts


def print_samples(model: nn.Module, cfg: DictConfig, is_main: bool) -> None:
    """Generate on every rank (a sharded model needs them all), print on the main one."""
    import importlib.util

    from speedllm.data.tokenizer import load_tokenizer

    generate = sample_texts
    if importlib.util.find_spec("speedllm.infer.generate") is not None:  # the inference package, when present
        from speedllm.infer.generate import sample_texts as generate
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.trust_remote_code)
    prompts = sample_prompts(cfg, tokenizer)[: cfg.generate.num_samples]
    texts = generate(model, tokenizer, prompts, cfg)
    if is_main:
        print("\nsamples (greedy):")
        for prompt, text in zip(prompts, texts):
            print(f"--- {prompt}{text}")
