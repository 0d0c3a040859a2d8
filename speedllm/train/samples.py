"""A few greedy samples printed at the end of a training run, so the user sees what the model learned."""

from typing import List

from omegaconf import DictConfig
from torch import nn

# Openings in the style of the bundled corpus (task=pretrain data=demo).
PRETRAIN_PROMPTS = ["ROMEO:\n", "First Citizen:\n", "KING HENRY:\nWhat"]


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
        messages = to_messages(record, cfg.data.format, where)
        # the whole conversation up to its last assistant turn, which the model is asked to write
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
        prompts.append(tokenizer.apply_chat_template(messages[:last], tokenize=False, add_generation_prompt=True))
    return prompts


def print_samples(model: nn.Module, cfg: DictConfig, is_main: bool) -> None:
    """Generate on every rank (a sharded model needs them all), print on the main one."""
    from speedllm.data.tokenizer import load_tokenizer
    from speedllm.generation.complete import sample_texts

    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.trust_remote_code)
    prompts = sample_prompts(cfg, tokenizer)[: cfg.generate.num_samples]
    texts = sample_texts(model, tokenizer, prompts, cfg)
    if is_main:
        print("\nsamples (greedy):")
        for prompt, text in zip(prompts, texts):
            print(f"--- {prompt}{text}")
