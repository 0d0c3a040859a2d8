"""Every op implementation runnable here against the reference set; the chunked loss against full logits."""

import importlib
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from speedllm.ops import batch_invariant, get_ops, reference
from speedllm.ops.loss import chunked_cross_entropy

pytestmark = pytest.mark.numerics

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
IMPLS = ["cpu", "cuda"] + (["npu"] if importlib.util.find_spec("torch_npu") else [])


def check(impl_fn, ref_fn, inputs, atol):
    """Outputs and input gradients of impl_fn equal ref_fn's within atol."""
    a_in = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    b_in = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    a, b = impl_fn(*a_in), ref_fn(*b_in)
    assert (a.float() - b.float()).abs().max() <= atol
    grad = torch.randn_like(a)
    a.backward(grad)
    b.backward(grad)
    for x, y in zip(a_in, b_in):
        if x.is_floating_point():
            assert (x.grad.float() - y.grad.float()).abs().max() <= atol


def rand(*shape, device="cpu"):
    return torch.randn(*shape, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_elementwise_ops_match_reference(impl, device):
    ops = get_ops(impl)
    check(lambda x, w: ops.rms_norm(x, w, 1e-6), lambda x, w: reference.rms_norm(x, w, 1e-6),
          [rand(2, 5, 3, 64, device=device), rand(64, device=device)], 1e-5)
    cos, sin = rand(2, 5, 64, device=device), rand(2, 5, 64, device=device)
    check(lambda x: ops.rotary(x, cos, sin), lambda x: reference.rotary(x, cos, sin),
          [rand(2, 5, 3, 64, device=device)], 1e-5)
    check(ops.swiglu, reference.swiglu, [rand(4, 7, 48, device=device), rand(4, 7, 48, device=device)], 1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_rms_norm_of_a_bf16_input_with_an_fp32_weight_stays_fused(impl, device):
    """As under bf16 autocast: a mixed-dtype call would fall back to unfused ops (torch warns) on a GPU."""
    x, w = rand(2, 5, 64, device=device).bfloat16(), rand(64, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = get_ops(impl).rms_norm(x, w, 1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference.rms_norm(x, w, 1e-6).bfloat16())  # bf16 tolerances


def fused_and_reference(fn, ref_fn, inputs, grad_of=None):
    """(outputs, input gradients) of fn and of ref_fn on copies of `inputs`; grad_of: which inputs want one."""
    grad_of = grad_of or [True] * len(inputs)
    results = []
    for f in (fn, ref_fn):
        xs = [x.detach().clone().requires_grad_(g) for x, g in zip(inputs, grad_of)]
        out = f(*xs)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
        results.append((out, [x.grad for x in xs]))
    return results


def test_cpu_kernels_match_reference_tightly():
    """The fused C kernels run (their own autograd nodes) and equal the reference within fp32 reassociation:
    row widths that are not a multiple of the vector width, fewer rows than threads, an MLP-sized SwiGLU with
    large gates (sigmoid saturation), a frozen norm weight; the same values without autograd (inference)."""
    from speedllm.ops import cpu

    assert cpu.kernels() is not None, "cc could not build speedllm/ops/cpu_kernels.c"
    ops, tight = get_ops("cpu"), dict(rtol=1e-5, atol=1e-6)
    gen = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    cos, sin = randn(3, 5, 40), randn(3, 5, 40)
    cases = [
        ("_RMSNorm", lambda x, w: ops.rms_norm(x, w, 1e-6), lambda x, w: reference.rms_norm(x, w, 1e-6),
         [randn(3, 5, 4, 40) * 3, randn(40)], None),
        ("_RMSNorm", lambda x, w: ops.rms_norm(x, w, 1e-6), lambda x, w: reference.rms_norm(x, w, 1e-6),
         [randn(1, 515), randn(515)], None),
        ("_RMSNorm", lambda x, w: ops.rms_norm(x, w, 1e-6), lambda x, w: reference.rms_norm(x, w, 1e-6),
         [randn(7, 64), randn(64)], [True, False]),
        ("_Rotary", lambda x: ops.rotary(x, cos, sin), lambda x: reference.rotary(x, cos, sin),
         [randn(3, 5, 4, 40)], None),
        ("_SwiGLU", ops.swiglu, reference.swiglu, [randn(4, 33, 1537) * 30, randn(4, 33, 1537)], None),
    ]
    for node, fn, ref_fn, inputs, grad_of in cases:
        (out, grads), (ref_out, ref_grads) = fused_and_reference(fn, ref_fn, inputs, grad_of)
        assert type(out.grad_fn).__name__ == node + "Backward"
        torch.testing.assert_close(out, ref_out, **tight)
        for g, ref_g in zip(grads, ref_grads):
            assert (g is None) == (ref_g is None)
            if g is not None:
                torch.testing.assert_close(g, ref_g, **tight)
        again_out, again_grads = fused_and_reference(fn, ref_fn, inputs, grad_of)[0]
        assert torch.equal(again_out, out) and all(a is None or torch.equal(a, b) for a, b in zip(again_grads, grads))
        with torch.no_grad():  # inference calls the kernel without an autograd node: the same values
            assert torch.equal(fn(*inputs), out)


def test_cpu_kernels_take_bf16_activations_rounding_once():
    """bf16 activations (fp32 weights and cos/sin, as under autocast) run the fused kernels' bf16 versions: the
    values and input gradients are the fp32 reference's on the same bf16 inputs, rounded to bf16 (within 2^-8
    of the largest value: the output's rounding, and for gradients the incoming gradient's; measured 2^-9)."""
    ops = get_ops("cpu")
    gen = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    cos, sin = randn(3, 5, 40), randn(3, 5, 40)
    cases = [
        ("_RMSNorm", lambda x, w: ops.rms_norm(x, w, 1e-6), lambda x, w: reference.rms_norm(x, w, 1e-6),
         [randn(3, 5, 4, 40) * 3, randn(40)]),
        ("_Rotary", lambda x: ops.rotary(x, cos.bfloat16(), sin.bfloat16()),
         lambda x: reference.rotary(x, cos.bfloat16(), sin.bfloat16()), [randn(3, 5, 4, 40)]),
        ("_SwiGLU", ops.swiglu, reference.swiglu, [randn(4, 33, 1537) * 30, randn(4, 33, 1537)]),
    ]
    for node, fn, ref_fn, inputs in cases:
        bf16 = [inputs[0].bfloat16(), *[t.bfloat16() if node == "_SwiGLU" else t for t in inputs[1:]]]
        out, grads = fused_and_reference(fn, ref_fn, bf16)[0]
        assert type(out.grad_fn).__name__ == node + "Backward" and out.dtype == torch.bfloat16
        exact, exact_grads = fused_and_reference(ref_fn, ref_fn, [t.float() for t in bf16])[0]
        for got, want in [(out, exact), *zip(grads, exact_grads)]:
            error = (got.float() - want).abs().max() / want.abs().max()
            assert error <= 2**-8, (node, error)


def test_cpu_op_set_falls_back_to_reference_where_no_kernel_applies():
    """fp16, a non-contiguous input and cos/sin that want a gradient take the reference path, with its values."""
    ops = get_ops("cpu")
    x, w = rand(6, 8, 32).half(), rand(32).half()
    assert ops.rms_norm(x, w, 1e-6).grad_fn is None and torch.equal(ops.rms_norm(x, w, 1e-6),
                                                                    reference.rms_norm(x, w, 1e-6))
    check(lambda x, w: ops.rms_norm(x.transpose(0, 1), w, 1e-6),
          lambda x, w: reference.rms_norm(x.transpose(0, 1), w, 1e-6), [rand(6, 8, 32), rand(32)], 1e-5)
    check(lambda x, c, s: ops.rotary(x, c, s), reference.rotary, [rand(2, 3, 4, 8), rand(2, 3, 8), rand(2, 3, 8)],
          1e-5)


def attention_cases(device):
    """(q, k, v, mask): causal, packed documents with padding, cached decode where S < T, and a one-query
    decode step without a mask."""
    B, H, K, S, Dh = 2, 4, 2, 12, 16
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 12], device=device)
    pos = torch.arange(S, device=device)
    doc_mask = (pos[None, :] <= pos[:, None]) & (docs[:, None, :, None] == docs[:, None, None, :])
    doc_mask[1, :, :, :3] = False
    doc_mask |= torch.eye(S, dtype=torch.bool, device=device)
    decode_mask = torch.ones(B, 1, 3, S, dtype=torch.bool, device=device)
    decode_mask[0, :, :, :4] = False
    kv = lambda: (rand(B, K, S, Dh, device=device), rand(B, K, S, Dh, device=device))  # noqa: E731
    return [
        (rand(B, H, S, Dh, device=device), *kv(), None),
        (rand(B, H, S, Dh, device=device), *kv(), doc_mask),
        (rand(B, H, 3, Dh, device=device), *kv(), decode_mask),
        (rand(B, H, 1, Dh, device=device), *kv(), None),
    ]


def test_one_query_without_mask_sees_every_key():
    q, k, v = rand(2, 4, 1, 16), rand(2, 2, 12, 16), rand(2, 2, 12, 16)
    every_key = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    check(lambda q, k, v: reference.attention(q, k, v, None, 0.25),
          lambda q, k, v: reference.attention_math(q, k, v, every_key, 0.25), [q, k, v], 1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_reference_attention_is_the_written_formula(device):
    for q, k, v, mask in attention_cases(device):
        fn = lambda q, k, v: reference.attention(q, k, v, mask, 0.25)  # noqa: E731
        math = lambda q, k, v: reference.attention_math(q, k, v, mask, 0.25)  # noqa: E731
        check(fn, math, [q, k, v], 1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_attention_matches_reference(impl, device):
    ops = get_ops(impl)
    for q, k, v, mask in attention_cases(device):
        check(lambda q, k, v: ops.attention(q, k, v, mask, 0.25),
              lambda q, k, v: reference.attention_math(q, k, v, mask, 0.25), [q, k, v], 1e-5)


def test_cpu_training_attention_in_bf16_is_as_close_to_fp32_as_sdpa():
    """Training's causal attention in bf16 (the cpu set's _CausalAttention: the scores and dp = do v^T in fp32, p and
    ds in bf16 for the other three GEMMs, two fused passes) against the fp32 reference on the same bf16 inputs; GQA,
    lengths and head dims no multiple of the vector width. The output within 2^-7 of its largest value (p is rounded
    to bf16 before p v; measured 0.0036-0.0045); each input gradient at most twice as far from the fp32 one as
    SDPA's own bf16 backward (measured x0.4-1.4) and within 2^-6. Masked, fp32 and inference calls take the
    reference, with its values."""
    ops = get_ops("cpu")
    gen = torch.Generator().manual_seed(0)
    for B, H, K, S, Dh in ((2, 4, 2, 37, 40), (3, 6, 2, 100, 32)):
        q, k, v = (torch.randn(B, n, S, Dh, generator=gen).bfloat16() for n in (H, K, K))
        causal = lambda q, k, v: reference.attention(q, k, v, None, 0.3)  # noqa: E731
        (out, grads), (_, sdpa_grads) = fused_and_reference(lambda q, k, v: ops.attention(q, k, v, None, 0.3),
                                                            causal, [q, k, v])
        assert type(out.grad_fn).__name__ == "_CausalAttentionBackward" and out.dtype == torch.bfloat16
        exact, exact_grads = fused_and_reference(causal, causal, [q.float(), k.float(), v.float()])[0]
        distance = lambda got, want: ((got.float() - want).abs().max() / want.abs().max()).item()  # noqa: E731
        assert distance(out, exact) <= 2**-7
        for got, theirs, want in zip(grads, sdpa_grads, exact_grads):
            assert got.dtype == torch.bfloat16
            assert distance(got, want) <= min(2 * distance(theirs, want), 2**-6)
        masked = ops.attention(q.clone().requires_grad_(), k, v, torch.ones(S, S, dtype=torch.bool).tril(), 0.3)
        fp32 = ops.attention(q.float().requires_grad_(), k.float(), v.float(), None, 0.3)
        assert "_CausalAttention" not in type(masked.grad_fn).__name__ + type(fp32.grad_fn).__name__
        with torch.no_grad():
            assert torch.equal(ops.attention(q, k, v, None, 0.3), reference.attention(q, k, v, None, 0.3))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["reference"] + IMPLS)
def test_grouped_mm_matches_per_expert_matmul(impl, device):
    counts = torch.tensor([3, 0, 6, 1], device=device)  # an expert with no tokens too
    x, w = rand(10, 16, device=device), rand(4, 8, 16, device=device)

    def per_expert(x, w):
        rows = torch.arange(10, device=device)
        expert_of_row = torch.repeat_interleave(torch.arange(4, device=device), counts)
        return torch.stack([w[expert_of_row[r]] @ x[r] for r in rows.tolist()])

    check(lambda x, w: get_ops(impl).grouped_mm(x, w, counts), per_expert, [x, w], 1e-5)


@pytest.mark.skipif(not batch_invariant.mixed_available(), reason="no packed bf16 kernel here (needs AMX or "
                    "AVX512-BF16): the experts compute in their inputs' dtype, as the fp32 test above checks")
def test_grouped_mm_under_bf16_autocast_runs_bf16_products_with_fp32_weight_gradients():
    """The cpu op set's experts under bf16 autocast: bf16 outputs equal to the products of the bf16-rounded
    operands (float64 reference, rounded once to bf16), input gradients in the inputs' dtype, and the weight
    gradients in fp32 straight from the kernel: the float64 sums of bf16-rounded dy and x within fp32 rounding,
    finer than bf16 (no cast of the weights or their gradients outside the kernel); an expert without rows gets
    zeros."""
    counts = torch.tensor([37, 0, 64, 3])
    x, w = rand(104, 96).requires_grad_(), rand(4, 40, 96).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = get_ops("cpu").grouped_mm(x, w, counts)
    dy = rand(*y.shape).bfloat16()
    y.backward(dy)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == w.grad.dtype == torch.float32
    rounded = lambda t: t.detach().bfloat16().double()  # noqa: E731
    expert = torch.repeat_interleave(torch.arange(4), counts)
    y_ref = torch.einsum("nd,nod->no", rounded(x), rounded(w)[expert])
    dx_ref = torch.einsum("no,nod->nd", dy.double(), rounded(w)[expert])
    dw_ref = torch.stack([dy[expert == e].double().t() @ rounded(x)[expert == e] for e in range(4)])
    assert ((y.double() - y_ref).abs() <= 2 ** -8 * y_ref.abs() + 1e-5 * y_ref.abs().max()).all()  # bf16 rounding
    torch.testing.assert_close(x.grad.double(), dx_ref, rtol=1e-5, atol=1e-5 * dx_ref.abs().max().item())
    torch.testing.assert_close(w.grad.double(), dw_ref, rtol=1e-5, atol=1e-5 * dw_ref.abs().max().item())
    assert torch.equal(w.grad[1], torch.zeros(40, 96))
    assert not torch.equal(w.grad, w.grad.bfloat16().float())  # fp32 sums, not rounded to bf16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["reference"] + IMPLS)
def test_cross_entropy_is_sum_ignoring_minus_100(impl, device):
    labels = torch.tensor([3, -100, 0, 9, -100, 4], device=device)
    expected = lambda logits: F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")  # noqa: E731
    check(lambda logits: get_ops(impl).cross_entropy(logits, labels), expected, [rand(6, 10, device=device)], 1e-5)


def test_cpu_cross_entropy_grad_is_the_reference_in_one_pass():
    """The fused loss-and-gradient kernel against the reference twin, in place, on fp32 and bf16 logits: a vocabulary
    that is no multiple of the vector width, an ignored row (zero gradient, no loss), labels at both ends. fp32:
    within reassociation; bf16: the same loss (fp32 arithmetic on the same bf16 logits) and the gradient within
    one bf16 rounding of the largest entry. A label outside the vocabulary raises, as the reference's gather."""
    from speedllm.ops import cpu

    gen = torch.Generator().manual_seed(0)
    labels = torch.tensor([3, -100, 0, 1002, 7, 500])
    for dtype, grad_tol in ((torch.float32, 1e-6), (torch.bfloat16, 2**-8)):
        logits = (torch.randn(6, 1003, generator=gen) * 4).to(dtype)
        fused = logits.clone()
        loss, grad = cpu.cross_entropy_grad_(fused, labels)
        ref_loss, ref_grad = reference.cross_entropy_grad_(logits.clone(), labels)
        assert grad.data_ptr() == fused.data_ptr() and grad.dtype == dtype and loss.dtype == torch.float32
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        assert (grad.float() - ref_grad.float()).abs().max() <= grad_tol * ref_grad.float().abs().max()
        assert not grad[1].any()
        expected = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    with pytest.raises(IndexError):
        cpu.cross_entropy_grad_(torch.randn(2, 10), torch.tensor([1, 10]))


@pytest.mark.parametrize("chunk_size", [1, 5, 64, 0])
def test_chunked_loss_equals_full_logits(chunk_size):
    hidden, weight = rand(23, 16), rand(50, 16)
    labels = torch.randint(0, 50, (23,))
    labels[[2, 7, 8]] = -100
    full = lambda h, w: F.cross_entropy(h @ w.t(), labels, ignore_index=-100, reduction="sum")  # noqa: E731
    check(lambda h, w: chunked_cross_entropy(h, w, labels, chunk_size, get_ops("reference")), full,
          [hidden, weight], 1e-4)
    with torch.no_grad():  # the evaluation path, through the op set's cross_entropy
        loss = chunked_cross_entropy(hidden, weight, labels, chunk_size, get_ops("reference"))
        assert abs(loss - full(hidden, weight)) <= 1e-4


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_chunked_loss_under_bf16_autocast(impl):
    """bf16 mixed precision on CPU, over several chunks: the GEMMs take bf16 operands and give bf16 logits, so the
    loss is the fp32 softmax of the bf16-rounded logits of the bf16-rounded hidden states and weight (up to a
    logit rounded the other way: the GEMM's order of additions); the gradients come back fp32 within bf16's
    precision of those; the weight gradient is summed over chunks in fp32. The cpu op set's fused kernel takes
    the bf16 logits as they are and writes their gradient in bf16. Each gradient element is within 2^-7 of
    |dlogits| @ |other operand|: the logit gradient rounded to bf16 (2^-9), the GEMM's bf16 output (2^-9) and a
    logit rounded the other way. Over 3,000 random draws the worst element came to 0.0073 of that scale (2^-7 =
    0.0078); the former band, 2^-8 of the largest element, failed 4% of draws."""
    hidden, weight = rand(23, 16), rand(50, 16)
    labels = torch.randint(0, 50, (23,))
    labels[[2, 7, 8]] = -100
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_cross_entropy(h, w, labels, 5, get_ops(impl))
    loss.backward()
    h_ref, w_ref = hidden.bfloat16().float().requires_grad_(), weight.bfloat16().float().requires_grad_()
    logits = h_ref @ w_ref.t()
    logits.retain_grad()
    rounded = logits + (logits.detach().bfloat16().float() - logits.detach())  # the value rounded, the gradient not
    ref = F.cross_entropy(rounded, labels, ignore_index=-100, reduction="sum")
    ref.backward()
    assert loss.dtype == h.grad.dtype == w.grad.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=0)
    g = logits.grad.abs()
    for got, want, scale in ((h.grad, h_ref.grad, g @ w_ref.abs()), (w.grad, w_ref.grad, g.t() @ h_ref.abs())):
        assert ((got - want).abs() <= 2**-7 * scale).all()


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_loss_in_place_log_softmax_over_shapes_and_dtypes(device):
    """Calls of several shapes and dtypes in a row, each against torch's out-of-place cross-entropy."""
    labels = torch.randint(0, 50, (23,), device=device)
    labels[[2, 7, 8]] = -100
    for vocab, dtype, chunk_size in [(50, torch.float32, 64), (4096, torch.float32, 5), (50, torch.bfloat16, 7),
                                     (50, torch.float32, 3)]:
        hidden = rand(23, 16, device=device).to(dtype).requires_grad_()
        weight = rand(vocab, 16, device=device).to(dtype).requires_grad_()
        loss = chunked_cross_entropy(hidden, weight, labels, chunk_size, get_ops("reference"))
        loss.backward()
        h, w = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
        expected = F.cross_entropy((h @ w.t()).to(dtype).float(), labels, ignore_index=-100, reduction="sum")
        expected.backward()
        tol = 1e-4 if dtype == torch.float32 else 0.1
        assert abs(loss.item() - expected.item()) <= tol * max(1.0, abs(expected.item()))
        torch.testing.assert_close(hidden.grad.float(), h.grad, atol=tol, rtol=tol)
        torch.testing.assert_close(weight.grad.float(), w.grad, atol=tol, rtol=tol)


def test_chunk_size_0_is_one_chunk_within_the_logits_budget(monkeypatch):
    from speedllm.ops import loss

    assert loss.chunk_rows(0, 1024, 32000) == 1024  # 125 MiB of logits: one fused cross-entropy
    assert loss.chunk_rows(0, 1024, 151936) * 151936 * 4 <= loss.LOGITS_BUDGET_BYTES < 1024 * 151936 * 4
    assert loss.chunk_rows(7, 1024, 151936) == 7  # an explicit size wins
    monkeypatch.setattr(loss, "LOGITS_BUDGET_BYTES", 50 * 4 * 5)  # 5 rows of a 50-entry vocabulary
    assert loss.chunk_rows(0, 23, 50) == 5
    hidden, weight = rand(23, 16), rand(50, 16)
    labels = torch.randint(0, 50, (23,))
    full = lambda h, w: F.cross_entropy(h @ w.t(), labels, ignore_index=-100, reduction="sum")  # noqa: E731
    check(lambda h, w: chunked_cross_entropy(h, w, labels, 0, get_ops("reference")), full, [hidden, weight], 1e-4)


def test_chunked_loss_keeps_no_full_logits():
    """What the loss keeps for backward is the gradients of hidden and weight, not N x V logits."""
    hidden, weight = rand(512, 8).requires_grad_(), rand(4096, 8).requires_grad_()
    labels = torch.randint(0, 4096, (512,))
    loss = chunked_cross_entropy(hidden, weight, labels, 64, get_ops("reference"))
    assert sorted(t.shape for t in loss.grad_fn.saved_tensors) == [hidden.shape, weight.shape]


def test_chunked_loss_with_a_frozen_weight_builds_no_weight_gradient():
    """LoRA/QLoRA freeze the output weight: the loss keeps only the hidden states' gradient, which is torch's."""
    hidden, weight = rand(64, 8).requires_grad_(), rand(4096, 8)
    labels = torch.randint(0, 4096, (64,))
    loss = chunked_cross_entropy(hidden, weight, labels, 16, get_ops("reference"))
    assert [t.shape for t in loss.grad_fn.saved_tensors if t is not None] == [hidden.shape]
    loss.backward()
    h = hidden.detach().requires_grad_()
    expected = F.cross_entropy(h @ weight.t(), labels, reduction="sum")
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-4 * abs(expected.item())
    torch.testing.assert_close(hidden.grad, h.grad, atol=1e-5, rtol=1e-4)


def test_npu_ops_need_torch_npu_only_when_selected():
    code = (
        "import sys, speedllm.ops, speedllm.models\n"
        "from speedllm.errors import UserError\n"
        "assert 'torch_npu' not in sys.modules\n"
        "try:\n    speedllm.ops.get_ops('npu')\nexcept UserError as e:\n    print(e)\n"
    )
    if importlib.util.find_spec("torch_npu"):
        pytest.skip("torch_npu is installed here")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "hardware.ops=npu needs torch_npu" in out and "\n" == out[-1] and out.count("\n") == 1
