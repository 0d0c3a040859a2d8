"""task=sft through the training loop: the loss covers exactly the assistant tokens (checked against a mask
found independently in the token ids), and a short run raises held-out answer accuracy."""

import pytest
import torch
from test_train_loop import config

from speedllm.checkpoint.dcp import latest_checkpoint, load_checkpoint
from speedllm.data.loader import build_loader
from speedllm.data.tokenizer import load_tokenizer
from speedllm.runtime import Runtime
from speedllm.tasks.pretrain import run
from speedllm.train.build import build_model
from speedllm.train.optimizer import build_optimizer
from speedllm.train.schedule import build_scheduler
from speedllm.train.step import train_step

pytestmark = pytest.mark.numerics

SFT = ["task=sft", "train.seq_len=128", "train.micro_batch_size=4", "train.global_batch_size=4"]


def assistant_targets(tokens, tokenizer) -> set:
    """Positions whose NEXT token is the assistant's turn: everything after the `<|im_start|>assistant\\n` header
    (the template's empty thinking block and the answer) up to and including the closing `<|im_end|>`."""
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids, targets = tokens.tolist(), set()
    for start in range(len(ids) - len(header) + 1):
        if ids[start:start + len(header)] == header:
            t = start + len(header)
            while t < len(ids):
                targets.add(t - 1)
                if ids[t] == end:
                    break
                t += 1
    return targets


def test_sft_loss_is_on_assistant_tokens_only(tmp_path):
    cfg = config(tmp_path, *SFT)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    batch = next(build_loader(cfg, "train", 0, 1, 4, 128, cfg.seed))
    pm = build_model(cfg, Runtime())
    model = pm.module

    with torch.no_grad():
        logits_BSV = model(batch["tokens"], position_ids=batch["position_ids"], document_ids=batch["document_ids"])
    logp_BSV = torch.log_softmax(logits_BSV.double(), dim=-1)
    manual, count = 0.0, 0
    for row in range(4):
        targets = assistant_targets(batch["tokens"][row], tokenizer)
        assert targets == set((batch["labels"][row] != -100).nonzero().flatten().tolist())
        for t in targets:
            manual -= logp_BSV[row, t, batch["tokens"][row, t + 1]].item()
        count += len(targets)
    assert 0 < count < (batch["tokens"] != tokenizer.pad_token_id).sum() / 4  # a small share of the tokens

    optimizer = build_optimizer(model, cfg.optim)
    loss, _, ok = train_step(pm, optimizer, build_scheduler(optimizer, cfg.optim, 1), [batch], cfg, 1, None,
                             torch.autocast("cpu", enabled=False))
    assert ok and loss == pytest.approx(manual / count, rel=1e-5)


@torch.no_grad()
def answer_accuracy(model, cfg) -> float:
    """Share of the held-out (valid split) answer tokens, the number and its closing `<|im_end|>`, that the model
    predicts exactly (teacher forced). The template's constant empty thinking block is left out: it is too easy."""
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    answer_ids = torch.tensor([*(tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)),
                               tokenizer.convert_tokens_to_ids("<|im_end|>")])
    right = total = 0
    for batch in build_loader(cfg, "valid", 0, 1, 4, 128, cfg.seed):
        if total >= 200:
            break
        logits_BSV = model(batch["tokens"], position_ids=batch["position_ids"], document_ids=batch["document_ids"])
        answer = torch.isin(batch["labels"], answer_ids)
        right += (logits_BSV.argmax(-1) == batch["labels"])[answer].sum().item()
        total += answer.sum().item()
    return right / total


def test_short_sft_run_raises_held_out_accuracy(tmp_path):
    cfg = config(tmp_path, *SFT, "train.steps=40", "optim.warmup_steps=5", "optim.lr=5e-3")
    before = answer_accuracy(build_model(cfg, Runtime()).module, cfg)
    run(cfg, Runtime())
    model = build_model(cfg, Runtime()).module
    load_checkpoint(latest_checkpoint(cfg.checkpoint.dir), model, build_optimizer(model, cfg.optim))
    after = answer_accuracy(model, cfg)
    assert before < 0.1 and after > 0.3, (before, after)
