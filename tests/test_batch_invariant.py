"""Batch-invariant mode (hardware.batch_invariant, speedllm.ops.batch_invariant): each output row of M = 1 equals
the same row computed among 64, bit for bit, for the matmul, the attention (a decode step against a cache against
the full sequence) and the fused norm; values against torch's; the packed matmuls (fp32 FMA; bf16 AMX, else
AVX512-BF16; the AMX kernel also on emulated tiles) across layouts and tails; the lower kernel paths alike; the model's
forward of one sequence equals it inside a batch of four, and a rollout's decode log-probabilities equal the
training forward's, for the hybrid models too; through launch.py, GRPO's rl/logprob_diff is exactly 0 at every
step, fp32 and bf16, in one process and under fsdp2, tp2 and (MoE) ep2, where without the mode it is not, and on
a hybrid MoE in bf16."""

import ctypes
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from speedllm.native import c_function, compile_command, cpu_features, supported_isas
from speedllm.ops import batch_invariant as bi
from speedllm.ops import cpu
from speedllm.ops.reference import attention_math
from speedllm.paths import ROOT

pytestmark = [pytest.mark.numerics, pytest.mark.skipif(not bi.available(), reason="no C compiler: no kernels")]

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_matmul_rows_do_not_depend_on_their_batch(dtype):
    gen = torch.Generator().manual_seed(0)
    for N, K in [(8, 5), (96, 33), (256, 64), (1000, 257), (128, 1024)]:
        x = torch.randn(64, K, generator=gen).to(dtype)
        w = torch.randn(N, K, generator=gen).to(dtype)
        full = bi.mm(x, w.t())
        for m in (1, 2, 3, 5, 17, 63):
            assert torch.equal(bi.mm(x[m - 1:m], w.t()), full[m - 1:m]), (N, K, m)
            assert torch.equal(bi.mm(x[:m], w.t()), full[:m]), (N, K, m)
        expected = x.double() @ w.double().t()
        tol = 2e-6 if dtype == torch.float32 else 1e-2  # fp32 sums; bf16 output rounding
        torch.testing.assert_close(full.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_attention_decode_against_a_cache_equals_the_full_sequence(dtype):
    """Query t alone against keys 0..t (a decode step) gives the bits of row t of the causal full-sequence
    attention; a padding mask likewise; values within rounding of the reference math, and its gradient."""
    gen = torch.Generator().manual_seed(1)
    B, H, KV, T, D = 2, 4, 2, 37, 24
    q, k, v = (torch.randn(B, n, T, D, generator=gen).to(dtype) for n in (H, KV, KV))
    full = bi.attention(q, k, v, None, None)
    for t in (0, 1, 16, T - 1):
        step = bi.attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], None, None)
        assert torch.equal(step, full[:, :, t:t + 1]), t
    pad = torch.ones(B, 1, T, T, dtype=torch.bool).tril()
    pad[0, :, :, :5] = False  # the first row's first 5 keys are left padding
    masked = bi.attention(q, k, v, pad, None)
    for t in (5, 20, T - 1):
        step = bi.attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], pad[:, :, t:t + 1, :t + 1], None)
        assert torch.equal(step, masked[:, :, t:t + 1]), t
    ref = attention_math(q.double(), k.double(), v.double(), None, D ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(full.double(), ref, rtol=tol, atol=tol)

    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    torch.autograd.grad(bi.attention(*leaves, None, None).sum(), leaves)  # runs
    grads = torch.autograd.grad(bi.attention(*leaves, None, None).square().sum(), leaves)
    expected = torch.autograd.grad(attention_math(*leaves, None, D ** -0.5).square().sum(), leaves)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_fused_norm_rows_do_not_depend_on_their_batch(dtype):
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(64, 257, generator=gen).to(dtype), torch.randn(257, generator=gen)
    full = cpu.rms_norm(x, w, 1e-6)
    for m in (1, 2, 7, 64):
        assert torch.equal(cpu.rms_norm(x[m - 1:m], w, 1e-6), full[m - 1:m])


@pytest.mark.parametrize("path", [p for p in supported_isas() if p != "avx512" or "amx_bf16" in cpu_features()])
def test_the_lower_kernel_paths_are_batch_invariant_too(path):
    """SPEEDLLM_CPU_ISA=avx2 (or generic) builds the portable lanes, and on an AMX machine =avx512 the AVX512-BF16
    twin of its tiles: each invariant on its own, fp32 and bf16 (run in a subprocess, as a user forcing the path
    would)."""
    code = """if True:
        import torch
        from speedllm.ops import batch_invariant as bi
        assert bi.amx_missing()
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(40, 70, generator=g), torch.randn(33, 70, generator=g)
        for t, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            a, b = x.to(t), w.to(t).t()
            f = bi.mm(a, b)
            assert all(torch.equal(bi.mm(a[i:i + 1], b), f[i:i + 1]) for i in range(40))
            torch.testing.assert_close(f.double(), a.double() @ b.double(), rtol=tol, atol=tol * 30)
        print("ok")"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "SPEEDLLM_CPU_ISA": path})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_packed_matmul_rows_do_not_depend_on_batch_layout_or_tails(dtype):
    """The packed kernels (fp32 FMA; bf16 AMX tiles, else vdpbf16ps): K tails (33, past the 512-deep chunk at
    1100), columns past one L2 pass (1040), operands in any layout (a row-major or transposed, b a linear weight's
    transpose or row-major), so either operand takes the first role: a row among M equals the row alone, bit for
    bit, against float64 at the dtype's rounding; bf16: fp32 operands rounded as they are packed give the bits of
    bf16 ones, and fp32 results the sums before the rounding."""
    if not bi._packed_kernel(dtype):
        pytest.skip(f"no packed {dtype} matmul here (avx512 path only; bf16: {bi.bf16_path()})")
    check_packed_matmul(dtype)


@pytest.mark.skipif(not {"avx512f", "avx512bw", "avx512_bf16"} <= set(cpu_features()) or not bi.available(),
                    reason="the AMX kernel's emulated build needs an AVX512-BF16 CPU and a C compiler")
def test_the_amx_kernel_on_emulated_tiles(tmp_path, monkeypatch):
    """bi_amx_mm on any AVX512-BF16 CPU: its source built with the tile instructions in plain C
    (tests/amx_emulator.c), so its packing, blocking, K chunks and transposed writes are checked where there is no
    AMX (the hardware's order inside one tdpbf16ps is not emulated), as the packed test checks the real one."""
    library = tmp_path / "amx_emulated.so"
    command = compile_command(ROOT / "tests" / "amx_emulator.c", library, "avx512")
    subprocess.run([*command[:-3], f'-DKERNEL_SOURCE="{bi.SOURCE}"', *command[-3:]], check=True)
    kernel = ctypes.CDLL(str(library)).bi_amx_mm
    kernel.argtypes, kernel.restype = bi._PACKED_MM, None
    monkeypatch.setattr(bi, "_packed_kernel", lambda dtype: "bi_amx_mm" if dtype == torch.bfloat16 else "")
    monkeypatch.setattr(bi, "c_function", lambda source, name, argtypes: kernel if name == "bi_amx_mm" else
                        c_function(source, name, argtypes))
    check_packed_matmul(torch.bfloat16)


def check_packed_matmul(dtype):
    gen = torch.Generator().manual_seed(0)
    for N, K in [(40, 33), (1040, 64), (96, 1100), (33, 1024)]:
        x32, w32 = torch.randn(64, K, generator=gen), torch.randn(N, K, generator=gen)
        x, w = x32.to(dtype), w32.to(dtype)
        layouts = [(x, w.t()), (x.t().contiguous().t(), w.t()), (x, w.t().contiguous()),
                   (x.t().contiguous().t(), w.t().contiguous())]
        full = bi.mm(x, w.t())
        for a, b in layouts:
            assert torch.equal(bi.mm(a, b), full), (N, K, a.stride(), b.stride())
            for m in (1, 17, 63):
                assert torch.equal(bi.mm(a[m - 1:m], b), full[m - 1:m]), (N, K, m, a.stride(), b.stride())
                assert torch.equal(bi.mm(a[:m], b), full[:m]), (N, K, m, a.stride(), b.stride())
        if dtype == torch.bfloat16:  # fp32 operands rounded as they are packed; fp32 sums out, unrounded
            for a, b in [(x32, w32.t()), (x32.t().contiguous().t(), w.t().contiguous()), (x, w32.t())]:
                for m in (1, 17, 64):
                    low, sums = torch.empty(1, m, N, dtype=dtype), torch.empty(1, m, N)
                    bi.mixed_bmm(a[None, :m], b[None], low)
                    bi.mixed_bmm(a[None, :m], b[None], sums)
                    assert torch.equal(low[0], full[:m]) and torch.equal(sums[0].to(dtype), full[:m]), (N, K, m)
        expected = x.double() @ w.double().t()
        tol = 2e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(full.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_model_forward_and_decode_are_batch_invariant(dtype, hf_pair):
    """Our Qwen3 under the mode: a sequence's logits alone equal its logits among four (micro-batch 1 against 4),
    and a rollout's decode log-probabilities equal the training forward's on the same tokens, to the bit."""
    from speedllm.generation.rollout import completion_logprobs, rollout
    from speedllm.generation.sampling import Sampling

    _, _, ours = hf_pair(seed=5, ops="cpu")
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(10, 96, (4, 21), generator=gen)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    with bi.mode(), torch.no_grad(), autocast:
        batch = ours(tokens)
        for i in range(4):
            assert torch.equal(ours(tokens[i:i + 1]), batch[i:i + 1]), i
        prompts = [torch.randint(10, 96, (n,), generator=gen).tolist() for n in (3, 8)]
        generators = [torch.Generator().manual_seed(s) for s in (1, 2)]
        ro = rollout(ours, prompts, 3, 10, Sampling(temperature=0.9), generators, [7, 8, 9], 0, dtype)
        trained, _ = completion_logprobs(ours, ro, 0.9)
    assert torch.equal(trained, ro.logprobs) and bool(ro.completion_mask.any())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_hybrid_forward_and_decode_are_batch_invariant(kind, dtype):
    """The hybrid models (Gated DeltaNet beside gated attention; Qwen3-Next's MoE with a shared expert) likewise:
    the mode runs the rule token by token in prefill and training too, so a decode step's state update is the
    training forward's. Without the mode the chunked prefill departs from the decode steps."""
    from test_hybrid import hf_model, ours_for

    from speedllm.generation.rollout import completion_logprobs, rollout
    from speedllm.generation.sampling import Sampling

    ours = ours_for(hf_model(kind, seed=4))
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 100, (4, 21), generator=gen)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    prompts = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in (3, 8)]

    def rollout_and_training_forward():
        generators = [torch.Generator().manual_seed(s) for s in (1, 2)]
        ro = rollout(ours, prompts, 3, 10, Sampling(temperature=0.9), generators, [0], 0, dtype)
        return ro, completion_logprobs(ours, ro, 0.9)[0]

    with bi.mode(), torch.no_grad(), autocast:
        batch = ours(tokens)
        for i in range(4):
            assert torch.equal(ours(tokens[i:i + 1]), batch[i:i + 1]), i
        ro, trained = rollout_and_training_forward()
    assert torch.equal(trained, ro.logprobs) and bool(ro.completion_mask.any())
    with torch.no_grad(), autocast:
        ro, trained = rollout_and_training_forward()
    assert not torch.equal(trained, ro.logprobs)  # what the mode removes


DENSE = ["model=qwen3_tiny", "model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2",
         "model.head_dim=16"]
MOE = ["model=qwen3_moe_tiny", "model.hidden_size=64", "model.num_hidden_layers=2", "model.head_dim=16",
       "model.moe_intermediate_size=32"]
RL = ["task=grpo", "hardware=cpu", "rl.group_size=4", "rl.max_new_tokens=6",
      "rl.kl_coef=0.05", "rl.mini_batches=2", "optim.lr=1e-3", "optim.warmup_steps=0", "logging.progress_bar=false",
      "logging.tensorboard=false", "checkpoint.save_final=false",
      "rl.rewards=[{_target_: test_grpo_task.vowels, weight: 1.0}]"]


HYBRID_MOE = ["model=qwen3_5_moe_tiny", "model.hidden_size=64", "model.moe_intermediate_size=32",
              "model.shared_expert_intermediate_size=32", "model.head_dim=16", "model.linear_key_head_dim=16",
              "model.linear_value_head_dim=16"]  # 3 Gated DeltaNet layers, 1 gated attention, a shared expert


def grpo(tmp_path, launch, name, *overrides, prompts=2):
    run_dir = tmp_path / name
    code, _, err = launch(run_dir, *RL, f"rl.prompts_per_step={prompts}", *overrides, timeout=900)
    assert code == 0, err[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def rewards_importable(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'tests'}:{ROOT}")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grpo_logprob_diff_is_zero_for_30_steps(dtype, tmp_path, launch, rewards_importable):
    # in bf16 the mode is task=grpo's default on a CPU (hardware.batch_invariant unset); fp32 asks for it
    on = grpo(tmp_path, launch, "on", *DENSE, "train.steps=30", f"hardware.dtype={dtype}",
              *(["hardware.batch_invariant=true"] if dtype == "float32" else []))
    assert len(on) == 30 and all(r["rl/logprob_diff"] == 0.0 for r in on), [r["rl/logprob_diff"] for r in on]
    assert on[-1]["rl/kl"] > 0  # it trained
    assert yaml.safe_load((tmp_path / "on" / "config.yaml").read_text())["hardware"]["batch_invariant"] is True
    off = grpo(tmp_path, launch, "off", *DENSE, "train.steps=3", f"hardware.dtype={dtype}",
               "hardware.batch_invariant=false", prompts=4)
    assert max(r["rl/logprob_diff"] for r in off) > 0  # what the mode removes


@pytest.mark.slow
def test_grpo_logprob_diff_is_zero_on_a_hybrid_moe_in_bf16(tmp_path, launch, rewards_importable):
    records = grpo(tmp_path, launch, "hybrid", *HYBRID_MOE, "train.steps=3", "rl.max_new_tokens=4",
                   "hardware.dtype=bfloat16", "hardware.batch_invariant=true")
    assert len(records) == 3 and all(r["rl/logprob_diff"] == 0.0 for r in records), records


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "ep2"])
def test_grpo_logprob_diff_is_zero_under_layouts(layout, tmp_path, launch, rewards_importable):
    model = MOE if layout == "ep2" else DENSE
    # tp2 bf16: q_norm / k_norm run on head-sharded DTensors; their output must stay bf16 (speedllm.ops.cpu.rms_norm)
    # or the attention falls back to SDPA, whose causal path differs between a decode step and the full sequence
    # (step 3 of this run, the first whose prompts have no padding)
    for dtype in ("float32", "bfloat16"):
        records = grpo(tmp_path, launch, dtype, *model, "train.steps=3", f"hardware.dtype={dtype}",
                       "hardware.batch_invariant=true", f"parallel={layout}")
        assert all(r["rl/logprob_diff"] == 0.0 for r in records), (dtype, [r["rl/logprob_diff"] for r in records])
