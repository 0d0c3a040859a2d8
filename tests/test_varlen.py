"""Variable-length attention for packed sequences, held against masked attention over the whole row.

Op level: every available implementation equals the written-out formula with a block-diagonal causal mask.
Model level: a packed SFT batch's loss and every gradient through the varlen path (the default with
document_ids) equal the masked-attention path (the [S, S] document mask through ops.attention).
"""

import importlib.util

import pytest
import torch
from omegaconf import OmegaConf

from speedllm.models.config import ModelConfig
from speedllm.models.qwen3 import Qwen3, document_bounds, masked_attention
from speedllm.ops import get_ops, reference

IMPLS = ["reference", "cuda"] + (["npu"] if importlib.util.find_spec("torch_npu") else [])


def packed_rows(B, S, gen, max_doc=40):
    """document_ids and per-document position_ids of B rows of back-to-back documents of random length."""
    doc_ids, pos_ids = torch.zeros(B, S, dtype=torch.long), torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        at, doc = 0, 0
        while at < S:
            n = min(int(torch.randint(1, max_doc, (1,), generator=gen)), S - at)
            doc_ids[b, at:at + n], pos_ids[b, at:at + n] = doc, torch.arange(n)
            at, doc = at + n, doc + 1
    return doc_ids, pos_ids


@pytest.mark.parametrize("impl", IMPLS)
def test_varlen_attention_equals_block_diagonal_causal_formula(impl):
    gen = torch.Generator().manual_seed(0)
    doc_ids, _ = packed_rows(1, 96, gen)
    cu_seqlens, max_seqlen = document_bounds(doc_ids)
    q = torch.randn(96, 4, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(96, 2, 16, generator=gen, requires_grad=True) for _ in range(2))
    out = get_ops(impl).varlen_attention(q, k, v, cu_seqlens, max_seqlen, 0.25)
    same_doc = doc_ids[0, :, None] == doc_ids[0, None, :]
    mask = (same_doc & torch.ones(96, 96, dtype=torch.bool).tril())[None, None]
    expected = reference.attention_math(*(x.transpose(0, 1)[None] for x in (q, k, v)), mask, 0.25)[0].transpose(0, 1)
    assert (out - expected).abs().max().item() <= 1e-5
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    assert all((a - b).abs().max().item() <= 1e-5 for a, b in zip(grads, expected_grads))


def test_packed_sft_loss_and_grads_equal_masked_attention():
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), dict(
        name="tiny", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0))
    model = Qwen3(cfg)
    model.init_weights(seed=0)
    gen = torch.Generator().manual_seed(1)
    B, S = 2, 128
    doc_ids, pos_ids = packed_rows(B, S, gen)
    tokens = torch.randint(0, 128, (B, S), generator=gen)
    labels = torch.where(pos_ids[:, 1:] == 0, -100, tokens[:, 1:])  # no loss across a document boundary
    labels = torch.cat([labels, torch.full((B, 1), -100)], dim=1)
    mask = model.attention_mask(B, S, 0, doc_ids, None, None, "cpu")

    def loss_and_grads(**attend):
        model.zero_grad()
        ce_sum, _ = model(tokens, labels=labels, position_ids=pos_ids, document_ids=doc_ids, **attend)
        ce_sum.backward()
        return ce_sum.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    varlen_loss, varlen_grads = loss_and_grads()
    masked_loss, masked_grads = loss_and_grads(attend=masked_attention(model.ops.attention, mask))
    assert abs(varlen_loss.item() - masked_loss.item()) <= 1e-5 * abs(masked_loss.item())
    for name, grad in masked_grads.items():
        assert (varlen_grads[name] - grad).abs().max().item() <= 1e-5 * max(grad.abs().max().item(), 1.0), name
