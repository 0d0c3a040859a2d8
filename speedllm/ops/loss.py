"""Output projection + cross-entropy over chunks of tokens, never holding the logits of the whole batch.

At a 151,936-entry vocabulary the [tokens, vocab] fp32 logits (and their gradient) are the largest activation
of a small model. With gradients wanted, the forward pass projects one chunk of tokens at a time and turns
that chunk's logits, in place, into their gradient (softmax - one_hot), from which it takes the chunk's
gradients with respect to the hidden states and the weight right away. Only those two are kept for backward
(the sizes of the hidden states and of the weight), so at most one chunk of logits is alive at any moment
and nothing is recomputed.
"""

import torch


def _loss_and_grad_(logits_NV: torch.Tensor, labels_N: torch.Tensor):
    """Summed cross-entropy of fp32 logits and d(sum)/d(logits), computed in the logits' own storage."""
    keep = (labels_N != -100).unsqueeze(1)
    targets = labels_N.clamp(min=0).unsqueeze(1)
    picked = logits_NV.gather(1, targets)
    row_max = logits_NV.amax(dim=1, keepdim=True)
    probs = logits_NV.sub_(row_max).exp_()
    row_sum = probs.sum(dim=1, keepdim=True)
    probs.div_(row_sum)
    loss = ((row_sum.log() + row_max - picked) * keep).sum()
    probs.scatter_add_(1, targets, torch.full_like(picked, -1.0))
    return loss, probs.mul_(keep)


def _local_chunk(h_ND, weight_VD, labels_N):
    return _loss_and_grad_((h_ND @ weight_VD.t()).float(), labels_N)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Output projection + cross-entropy, chunk by chunk: each chunk's logits turn into their gradient in place
    right away, and only the gradients with respect to the hidden states and the weight are kept for backward.

    `chunk_fn(h_ND, weight_VD, labels_N) -> (loss sum, grad of the logits)` does one chunk; tensor parallelism
    passes a vocabulary-parallel one (speedllm.parallel.tensor).
    """

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, labels_N, chunk_size, chunk_fn=_local_chunk):
        grad_hidden = torch.empty_like(hidden_ND)
        grad_weight = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden_ND.device)
        for start in range(0, hidden_ND.shape[0], chunk_size):
            h = hidden_ND[start : start + chunk_size]
            loss, grad_logits = chunk_fn(h, weight_VD, labels_N[start : start + chunk_size])
            grad_hidden[start : start + chunk_size] = grad_logits.to(weight_VD.dtype) @ weight_VD
            grad_weight.addmm_(grad_logits.t(), h.float())
            total += loss
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight_VD.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_total, grad_weight * grad_total, None, None, None


def chunked_cross_entropy(hidden_ND, weight_VD, labels_N, chunk_size, cross_entropy):
    """Sum of token cross-entropies of `hidden_ND @ weight_VD.T` against `labels_N` (-100 = ignore), fp32.

    Args:
        chunk_size: tokens projected at once; the extra memory is about chunk_size x vocab x 4 bytes.
        cross_entropy: the op set's `cross_entropy(logits_NV, labels_N) -> sum`, used when no gradient is
            wanted (evaluation); with gradients the fused in-place loss-and-gradient above is used.
    """
    if torch.is_grad_enabled() and (hidden_ND.requires_grad or weight_VD.requires_grad):
        return ChunkedLinearCrossEntropy.apply(hidden_ND, weight_VD, labels_N, chunk_size)
    total = torch.zeros((), dtype=torch.float32, device=hidden_ND.device)
    for start in range(0, hidden_ND.shape[0], chunk_size):
        logits = hidden_ND[start : start + chunk_size] @ weight_VD.t()
        total += cross_entropy(logits, labels_N[start : start + chunk_size])
    return total
