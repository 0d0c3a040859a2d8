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

from speedllm.ops import IGNORE_INDEX

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


def _loss_and_grad_(logits_NV: torch.Tensor, labels_N: torch.Tensor):
    """Summed cross-entropy of fp32 logits and d(sum)/d(logits), computed in the logits' own storage.

    The loss is log-softmax + NLL, as torch's cross_entropy computes it. torch's CPU and CUDA log-softmax
    kernels read each element before writing the same element, so they run in place (one pass instead of
    max / subtract / exp / sum / divide); exp_ then turns the log-probabilities into the softmax. Other
    devices (torch_npu) make no such promise and get a copy.
    """
    keep = (labels_N != IGNORE_INDEX).unsqueeze(1)
    targets = labels_N.clamp(min=0).unsqueeze(1)
    if logits_NV.device.type in ("cpu", "cuda"):
        logprobs = torch.log_softmax(logits_NV, dim=1, out=logits_NV)
    else:
        logprobs = logits_NV.copy_(torch.log_softmax(logits_NV, dim=1))
    loss = -(logprobs.gather(1, targets) * keep).sum()
    probs = logprobs.exp_()
    probs.scatter_add_(1, targets, torch.full(targets.shape, -1.0, device=probs.device))
    return loss, zero_unlabeled_(probs, keep.squeeze(1))


def zero_unlabeled_(grad_NV: torch.Tensor, keep_N: torch.Tensor) -> torch.Tensor:
    """grad_NV with the rows of tokens without a label (keep_N False) zeroed in place: on CPU those rows only, not
    a pass over every logit; on an accelerator a mask multiply (no host sync for the row indices)."""
    if grad_NV.device.type == "cpu":
        return grad_NV.index_fill_(0, torch.nonzero(~keep_N).squeeze(1), 0.0)
    return grad_NV.mul_(keep_N[:, None])


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Output projection + cross-entropy, chunk by chunk: each chunk's logits turn into their gradient in place
    right away, and only the gradients with respect to the hidden states and the weight are kept for backward.

    `chunk_fn(logits_NV, labels_N) -> (loss sum, grad of the logits)` turns one chunk's fp32 logits into their
    gradient in place; tensor parallelism passes a vocabulary-parallel one (speedllm.parallel.tensor).
    """

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, labels_N, chunk_size, chunk_fn=_loss_and_grad_):
        grad_hidden = torch.empty_like(hidden_ND)
        grad_weight = None
        total = torch.zeros((), dtype=torch.float32, device=hidden_ND.device)
        chunk_size = chunk_rows(chunk_size, hidden_ND.shape[0], weight_VD.shape[0])
        # one chunk's fp32 logits, reused by every chunk of this call and freed with it
        buffer = torch.empty(chunk_size, weight_VD.shape[0], dtype=torch.float32, device=hidden_ND.device)
        device = hidden_ND.device.type
        # under autocast (bf16 mixed precision) the three GEMMs run in its dtype, the softmax and the weight
        # gradient's sum over chunks in fp32
        amp = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        weight = weight_VD if amp is None else weight_VD.to(amp)
        for start in range(0, hidden_ND.shape[0], chunk_size):
            h = hidden_ND[start : start + chunk_size]
            logits = buffer[: h.shape[0]]
            if amp is not None:
                h = h.to(amp)
                logits.copy_(h @ weight.t())
            elif weight_VD.dtype == torch.float32:
                torch.mm(h, weight_VD.t(), out=logits)
            else:
                logits.copy_(h @ weight_VD.t())
            loss, grad_logits = chunk_fn(logits, labels_N[start : start + chunk_size])
            grad_low = grad_logits.to(weight.dtype)  # under autocast: converted once, for both GEMMs
            grad_hidden[start : start + chunk_size] = grad_low @ weight
            if ctx.needs_input_grad[1]:  # a frozen output weight (LoRA, QLoRA) gets no vocabulary-sized gradient
                if amp is not None:
                    chunk_grad = (grad_low.t() @ h).float()
                    grad_weight = chunk_grad if grad_weight is None else grad_weight.add_(chunk_grad)
                elif grad_weight is None:
                    grad_weight = grad_logits.t() @ h.float()
                else:
                    grad_weight.addmm_(grad_logits.t(), h.float())
            total += loss
        ctx.save_for_backward(grad_hidden, None if grad_weight is None else grad_weight.to(weight_VD.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        # Not in place: zero-bubble pipeline schedules run this backward twice (input, then weight gradients).
        return (grad_hidden * grad_total, None if grad_weight is None else grad_weight * grad_total,
                None, None, None)


def chunked_cross_entropy(hidden_ND, weight_VD, labels_N, chunk_size, cross_entropy):
    """Sum of token cross-entropies of `hidden_ND @ weight_VD.T` against `labels_N` (IGNORE_INDEX = no loss), fp32.

    Args:
        chunk_size: tokens projected at once (0: see chunk_rows); the extra memory is about
            chunk_size x vocab x 4 bytes.
        cross_entropy: the op set's `cross_entropy(logits_NV, labels_N) -> sum`, used when no gradient is
            wanted (evaluation); with gradients the fused in-place loss-and-gradient above is used.
    """
    if torch.is_grad_enabled() and (hidden_ND.requires_grad or weight_VD.requires_grad):
        return ChunkedLinearCrossEntropy.apply(hidden_ND, weight_VD, labels_N, chunk_size)
    total = torch.zeros((), dtype=torch.float32, device=hidden_ND.device)
    chunk_size = chunk_rows(chunk_size, hidden_ND.shape[0], weight_VD.shape[0])
    for start in range(0, hidden_ND.shape[0], chunk_size):
        logits = hidden_ND[start : start + chunk_size] @ weight_VD.t()
        total += cross_entropy(logits, labels_N[start : start + chunk_size])
    return total
