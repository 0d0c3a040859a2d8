"""Output projection + cross-entropy over chunks of tokens, holding the logits of the whole batch only when
they fit a small memory budget.

At a 151,936-entry vocabulary the [tokens, vocab] fp32 logits (and their gradient) are the largest activation
of a small model. With gradients wanted, the forward pass projects one chunk of tokens at a time and turns
that chunk's logits, in place, into their gradient (softmax - one_hot), from which it takes the chunk's
gradients with respect to the hidden states and the weight right away. Only those two are kept for backward
(the sizes of the hidden states and of the weight), so at most one chunk of logits is alive at any moment
and nothing is recomputed.
"""

import torch

from speedllm.ops.reference import cross_entropy_grad_

LOGITS_BUDGET_BYTES = 128 * 2**20  # one chunk's fp32 logits, when the chunk size is left to the loss (0)


def chunk_rows(chunk_size: int, num_tokens: int, vocab: int) -> int:
    """Tokens projected at once: `chunk_size`, or for 0 as many as keep one chunk's fp32 logits within
    LOGITS_BUDGET_BYTES, which is all of them (one fused cross-entropy, no chunking) when the whole logits fit.

    A small chunk costs little speed: the weight gradient accumulates through the GEMM itself (addmm_), and a
    small buffer is cheap to fault in. A large one costs memory: on CPU a freshly touched 0.6 GB buffer
    (1,024 tokens x 151,936) is both the step's peak and ~0.15 s of page faults.
    """
    rows = chunk_size if chunk_size > 0 else max(1, LOGITS_BUDGET_BYTES // (4 * vocab))
    return min(rows, num_tokens)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Output projection + cross-entropy, chunk by chunk: each chunk's logits turn into their gradient in place
    right away, and only the gradients with respect to the hidden states and the weight are kept for backward.

    `chunk_fn(logits_NV, labels_N) -> (loss sum, grad of the logits)` turns one chunk's fp32 logits into their
    gradient in place; tensor parallelism passes a vocabulary-parallel one (speedllm.parallel.tensor). With
    `low_logits` it takes them in the GEMMs' dtype under autocast (an op set's cross_entropy_grad_): bf16 logits
    straight from the GEMM, their bf16 gradient straight into the next two, no fp32 copy of either.
    """

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, labels_N, chunk_size, chunk_fn=cross_entropy_grad_, low_logits=False):
        grad_hidden = torch.empty_like(hidden_ND)
        grad_weight = None
        total = torch.zeros((), dtype=torch.float32, device=hidden_ND.device)
        chunk_size = chunk_rows(chunk_size, hidden_ND.shape[0], weight_VD.shape[0])
        device = hidden_ND.device.type
        # under autocast (bf16 mixed precision) the three GEMMs run in its dtype, the softmax and the weight
        # gradient's sum over chunks in fp32
        amp = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        weight = weight_VD if amp is None else weight_VD.to(amp)
        # one chunk's logits (fp32, or the GEMMs' dtype for a chunk_fn taking that), reused by every chunk
        dtype = amp if amp is not None and low_logits else torch.float32
        buffer = torch.empty(chunk_size, weight_VD.shape[0], dtype=dtype, device=hidden_ND.device)
        for start in range(0, hidden_ND.shape[0], chunk_size):
            h = hidden_ND[start : start + chunk_size]
            logits = buffer[: h.shape[0]]
            if amp is not None:
                h = h.to(amp)
                if dtype == amp:
                    torch.mm(h, weight.t(), out=logits)
                else:
                    logits.copy_(h @ weight.t())
            elif weight_VD.dtype == torch.float32:
                torch.mm(h, weight_VD.t(), out=logits)
            else:
                logits.copy_(h @ weight_VD.t())
            loss, grad_logits = chunk_fn(logits, labels_N[start : start + chunk_size])
            grad_low = grad_logits.to(weight.dtype)  # under autocast: converted once, for both GEMMs
            grad_hidden[start : start + chunk_size] = grad_low @ weight
            if ctx.needs_input_grad[1]:  # a frozen output weight (LoRA, QLoRA) gets no vocabulary-sized gradient
                if amp is not None:  # one chunk's stays in amp's dtype until backward converts it once
                    chunk_grad = grad_low.t() @ h
                    grad_weight = chunk_grad if grad_weight is None else grad_weight.float().add_(chunk_grad)
                elif grad_weight is None:
                    grad_weight = grad_logits.t() @ h.float()
                else:
                    grad_weight.addmm_(grad_logits.t(), h.float())
            total += loss
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight_VD.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        # The saved gradients are not changed: zero-bubble pipeline schedules run this backward twice (input, then
        # weight gradients). A weight gradient in another dtype is converted into a new tensor, scaled in place.
        if grad_weight is not None:
            dtype = ctx.weight_dtype
            grad_weight = grad_weight * grad_total if grad_weight.dtype == dtype else \
                grad_weight.to(dtype).mul_(grad_total)
        return grad_hidden * grad_total, grad_weight, None, None, None, None


def chunked_cross_entropy(hidden_ND, weight_VD, labels_N, chunk_size, ops):
    """Sum of token cross-entropies of `hidden_ND @ weight_VD.T` against `labels_N` (IGNORE_INDEX = no loss), fp32.

    Args:
        chunk_size: tokens projected at once (0: see chunk_rows); the extra memory is about
            chunk_size x vocab x 4 bytes.
        ops: the op set (speedllm.ops.Ops): its `cross_entropy` when no gradient is wanted (evaluation), its
            in-place `cross_entropy_grad_` on each chunk's logits with gradients.
    """
    if torch.is_grad_enabled() and (hidden_ND.requires_grad or weight_VD.requires_grad):
        return ChunkedLinearCrossEntropy.apply(hidden_ND, weight_VD, labels_N, chunk_size, ops.cross_entropy_grad_,
                                               True)
    total = torch.zeros((), dtype=torch.float32, device=hidden_ND.device)
    chunk_size = chunk_rows(chunk_size, hidden_ND.shape[0], weight_VD.shape[0])
    for start in range(0, hidden_ND.shape[0], chunk_size):
        logits = hidden_ND[start : start + chunk_size] @ weight_VD.t()
        total += ops.cross_entropy(logits, labels_N[start : start + chunk_size])
    return total
