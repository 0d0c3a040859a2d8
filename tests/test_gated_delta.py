"""The gated delta rule (speedllm.ops.gated_delta, the cpu set's gated_delta_cpu): the chunked and recurrent forms of
the reference and cpu op sets against the rule written token by token (gated_delta_rule_math) and against
transformers' torch fallbacks, forward and the gradients of all six inputs; fp32 to 1e-5, bf16 to its rounding;
chunk-unaligned lengths, grouped key heads, packed documents, prefill then decode; each C kernel path."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                          torch_recurrent_gated_delta_rule)

from speedllm.native import ISA_ENV, supported_isas
from speedllm.ops import gated_delta_cpu, get_ops
from speedllm.ops.gated_delta import gated_delta_rule_math

pytestmark = pytest.mark.numerics

SETS = ["reference", "cpu"]
HK, H, K, V = 2, 4, 16, 8  # grouped: each key head serves two value heads


def draw(B, S, seed=0, dtype=torch.float32):
    """(q, k, v, g, beta, initial_state): q, k, v in `dtype`, g and beta fp32 (as the model passes them), g in
    the model's range (-exp(A_log) softplus(.)), the state fp32."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, S, HK, K, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(B, S, H, V, generator=gen).to(dtype)
    g = -F.softplus(torch.randn(B, S, H, generator=gen)) * torch.rand(H, generator=gen) * 2
    beta = torch.rand(B, S, H, generator=gen)
    return q, k, v, g, beta, torch.randn(B, H, K, V, generator=gen) * 0.5


def forward_backward(fn, inputs, weights=None):
    """(output, final state, gradients of every input) of fn(*inputs) under the loss sum(out * weights[0]) +
    sum(state * weights[1]) (default: random weights)."""
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out, state = fn(*inputs)
    gen = torch.Generator().manual_seed(1)
    weights = weights or (torch.randn(out.shape, generator=gen), torch.randn(state.shape, generator=gen))
    loss = (out.float() * weights[0]).sum() + (state * weights[1]).sum()
    return out, state, torch.autograd.grad(loss, inputs)


def assert_close(got, want, rel):
    """Equal within `rel` of the largest reference value (errors of sums scale with the sum, not each term)."""
    assert got.shape == want.shape
    err, scale = (got.float() - want.float()).abs().max(), want.float().abs().max()
    assert err <= rel * scale, f"{err} > {rel} * {scale}"


def assert_all_close(got, want, rel):
    for a, b in zip((got[0], got[1], *got[2]), (want[0], want[1], *want[2])):
        assert_close(a, b, rel)


def transformers_chunk(q, k, v, g, beta, state):
    return torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)


def transformers_recurrent(q, k, v, g, beta, state):
    return torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("name", SETS)
@pytest.mark.parametrize("S", [1, 63, 65, 150])
def test_chunked_form_equals_the_rule_and_transformers_fp32(name, S):
    ops = get_ops(name)
    inputs = draw(2, S, seed=S)
    got = forward_backward(ops.chunk_gated_delta_rule, inputs)
    if name == "cpu":
        _, state = ops.chunk_gated_delta_rule(*(x.requires_grad_() for x in draw(1, 3)))
        assert type(state.grad_fn).__name__ == "_ChunkGatedDeltaBackward"  # the analytic backward, not a fallback
    assert_all_close(got, forward_backward(gated_delta_rule_math, inputs), 1e-5)
    assert_all_close(got, forward_backward(transformers_chunk, inputs), 1e-5)


@pytest.mark.parametrize("name", SETS)
def test_chunked_form_in_bf16_is_the_fp32_rule_rounded(name):
    """bf16 q, k, v (and beta) under fp32 arithmetic: the results within two bf16 roundings (2^-8 relative) of
    the rule in fp32 on the same bf16 values; a wrong term is off by far more."""
    inputs = draw(2, 100, dtype=torch.bfloat16)
    inputs = (*inputs[:4], inputs[4].bfloat16(), inputs[5])
    got = forward_backward(get_ops(name).chunk_gated_delta_rule, inputs)
    assert got[0].dtype == torch.bfloat16 and [x.dtype for x in got[2]] == [x.dtype for x in inputs]
    exact = forward_backward(gated_delta_rule_math, [x.float() for x in inputs])
    assert_all_close(got, exact, 2**-8)


def test_autocast_leaves_the_cpu_op_in_fp32():
    inputs = draw(1, 70)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = forward_backward(get_ops("cpu").chunk_gated_delta_rule, inputs)
    assert_all_close(got, forward_backward(gated_delta_rule_math, inputs), 1e-5)


@pytest.mark.parametrize("name", SETS)
def test_packed_documents_equal_each_document_alone(name, monkeypatch):
    """Documents of 37, 64, 1 and 100 tokens back to back (cu_seqlens): each one's output, final state and
    gradients are those of the document run alone from its own initial state. The cpu op works on blocks of 3
    chunks here, so that blocks end inside documents."""
    monkeypatch.setattr(gated_delta_cpu, "BLOCK", 3)
    fn = get_ops(name).chunk_gated_delta_rule
    lengths = [37, 64, 1, 100]
    q, k, v, g, beta, _ = draw(1, sum(lengths), seed=3)
    initial = draw(len(lengths), 1, seed=4)[5]
    cu_seqlens = torch.tensor([0, 37, 101, 102, 202], dtype=torch.int32)
    gen = torch.Generator().manual_seed(2)
    weights = torch.randn(1, 202, H, V, generator=gen), torch.randn(4, H, K, V, generator=gen)
    packed = forward_backward(lambda *x: fn(*x, cu_seqlens), (q, k, v, g, beta, initial), weights)
    alone = [forward_backward(fn, [x[:, lo:hi] for x in (q, k, v, g, beta)] + [initial[i:i + 1]],
                              (weights[0][:, lo:hi], weights[1][i:i + 1]))
             for i, (lo, hi) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))]
    want = (torch.cat([a[0] for a in alone], 1), torch.cat([a[1] for a in alone]),
            [torch.cat([a[2][i] for a in alone], 0 if i == 5 else 1) for i in range(6)])
    assert_all_close(packed, want, 1e-5)


@pytest.mark.parametrize("name", SETS)
def test_recurrent_form_equals_the_rule_and_transformers(name):
    ops = get_ops(name)
    for S in (1, 3):
        inputs = draw(3, S, seed=S)
        got = forward_backward(ops.recurrent_gated_delta_rule, inputs)
        assert_all_close(got, forward_backward(gated_delta_rule_math, inputs), 1e-5)
        assert_all_close(got, forward_backward(transformers_recurrent, inputs), 1e-5)


@pytest.mark.parametrize("name", SETS)
def test_prefill_then_decode_equals_the_whole_sequence(name):
    """Chunked prefill of 70 tokens, then decode token by token (and 3 at once) from its state: the outputs and the
    final state of the chunked form over all 75."""
    ops = get_ops(name)
    q, k, v, g, beta, initial = draw(2, 75, seed=5)
    with torch.no_grad():
        whole, whole_state = ops.chunk_gated_delta_rule(q, k, v, g, beta, initial)
        outs, state = ops.chunk_gated_delta_rule(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70], initial)
        outs = [outs]
        for lo, hi in ((70, 71), (71, 72), (72, 75)):
            out, state = ops.recurrent_gated_delta_rule(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi],
                                                        beta[:, lo:hi], state)
            outs.append(out)
    assert_close(torch.cat(outs, 1), whole, 1e-5)
    assert_close(state, whole_state, 1e-5)


@pytest.mark.parametrize("path", ["avx512", "avx2", "generic"])
def test_each_kernel_path_inverts_the_ut_system(path, monkeypatch):
    """The C inverse of (I + strictly_lower(a)) on each kernel path this CPU runs, against torch's triangular solve,
    and the op on that path against the rule."""
    if path not in supported_isas():
        pytest.skip(f"this CPU runs {', '.join(supported_isas())}, not {path}")
    monkeypatch.setenv(ISA_ENV, path)
    if gated_delta_cpu.kernel() is None:
        pytest.skip("no C compiler: the cpu set runs the reference twin")
    a = torch.randn(5, 64, 64, generator=torch.Generator().manual_seed(0)) * 0.2
    system = a.tril(-1) + torch.eye(64)
    want = torch.linalg.solve_triangular(system, torch.eye(64).expand(5, 64, 64), upper=False)
    assert_close(gated_delta_cpu.tril_unit_inverse(a), want, 1e-5)
    inputs = draw(1, 65, seed=6)
    assert_all_close(forward_backward(gated_delta_cpu.chunk_gated_delta_rule, inputs),
                     forward_backward(gated_delta_rule_math, inputs), 1e-5)
