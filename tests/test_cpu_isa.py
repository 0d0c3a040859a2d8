"""CPU kernel paths (speedllm.native, SPEEDLLM_CPU_ISA): every path this machine runs equals the reference twin in
torch (int8 and int4 weight-only matmuls, the cpu op set); the AVX-512 path compiles where the CPU lacks it; the
aarch64 NEON path, cross-compiled, equals the reference twin under qemu-user; the variable forces a path as a user
sets it (task=doctor names it) and a bad value is refused in one line."""

import shutil
import subprocess

import numpy as np
import pytest
import torch

from speedllm.errors import UserError
from speedllm.native import ISA_ENV, ISAS, compile_command, cpu_features, isa, kernel_path, supported_isas
from speedllm.ops import batch_invariant, cpu, reference
from speedllm.quant import int4, int8

pytestmark = pytest.mark.numerics

SOURCES = {"int8": int8.KERNEL_SOURCE, "int4": int4.KERNEL_SOURCE, "ops": cpu.KERNEL_SOURCE}
NEEDS_CC = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: every kernel runs its reference twin")


def assert_reassociated(got, want):
    """Equal up to the order of fp32 additions: the error bound scales with the largest output, not each one (an
    output that cancels to near zero keeps the absolute error of the sum)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()


def int8_case(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, scale = int8.quantize_int8(torch.randn(40, 208, generator=g))  # 208 = 6 x 32 + 16: unrolled loops and tails
    return torch.randn(rows, 208, generator=g), q, scale


def int4_case(rows, group_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, scales, zeros = int4.quantize_int4(torch.randn(25, 256, generator=g), group_size)
    return torch.randn(rows, 256, generator=g), int4.pack_int4(q), scales, zeros


@NEEDS_CC
@pytest.mark.parametrize("path", ISAS)
def test_each_path_equals_the_reference_twin(path, monkeypatch):
    if path not in supported_isas():
        pytest.skip(f"this CPU runs {', '.join(supported_isas())}, not {path}")
    monkeypatch.setenv(ISA_ENV, path)
    assert kernel_path(SOURCES["int8"]) == path
    assert kernel_path(SOURCES["int4"]) == path
    assert kernel_path(SOURCES["ops"]) == f"portable C ({path} build)"
    with torch.no_grad():
        for rows in (1, 3, 11):
            x, q, scale = int8_case(rows)
            assert_reassociated(int8.int8_wo_mm(x, q, scale), int8.int8_wo_mm_reference(x, q, scale))
            for group_size in (32, 64, 128):
                x, packed, scales, zeros = int4_case(rows, group_size)
                assert_reassociated(int4.int4_wo_mm(x, packed, scales, zeros, group_size),
                                    int4.int4_wo_mm_reference(x, packed, scales, zeros, group_size))
        x, w = torch.randn(6, 96), torch.randn(96)
        torch.testing.assert_close(cpu.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
        torch.testing.assert_close(cpu.swiglu(x, w.expand(6, 96)), reference.swiglu(x, w.expand(6, 96)))
        logits, labels = torch.randn(3, 1003) * 4, torch.tensor([5, -100, 1002])
        loss, grad = cpu.cross_entropy_grad_(logits.clone(), labels)
        ref_loss, ref_grad = reference.cross_entropy_grad_(logits.clone(), labels)
        torch.testing.assert_close(loss, ref_loss)
        torch.testing.assert_close(grad, ref_grad)
    # training's bf16 attention (its softmax passes forward and backward) against the fp32 reference
    q, k, v = (torch.randn(1, n, 19, 24).bfloat16().requires_grad_() for n in (4, 2, 2))
    out = cpu.attention(q, k, v, None, 0.2)
    assert type(out.grad_fn).__name__ == "_CausalAttentionBackward"
    out.float().square().sum().backward()
    exact = [x.detach().float().requires_grad_() for x in (q, k, v)]
    want = reference.attention(*exact, None, 0.2)
    want.square().sum().backward()
    for got, ref in ((out, want), *((x.grad, y.grad) for x, y in zip((q, k, v), exact))):
        assert (got.float() - ref).abs().max() <= 2**-6 * ref.abs().max()


@NEEDS_CC
@pytest.mark.parametrize("dot", int8.INT8_DOTS)
def test_int8_dynamic_equals_its_twin_on_each_dot_product(dot):
    """int8 weights x per-row int8 activations (quant=int8_dyn): the integer sums are exact, so each dot product
    this CPU has equals the reference twin to the bit (rows 1, 3 with a zero row, 11; 208 columns: the vector
    loops and a tail); against the float layer the activations' rounding costs at most 1.5% of the largest output
    (measured 0.8-1.0% here). Dot products for instructions this CPU lacks are built into the library (target
    attributes) but skipped (an AVX2-only CPU runs generic and avx2)."""
    lacking = int8.DOT_NEEDS.get(dot, set()) - set(cpu_features())
    if lacking:
        pytest.skip(f"this CPU lacks {', '.join(sorted(lacking))}")
    with torch.no_grad():
        for rows in (1, 3, 11):
            x, q, scale = int8_case(rows, seed=rows)
            x[1 % rows] = 0
            got = int8.int8_dq_mm(x, q, scale, dot)
            assert torch.equal(got, int8.int8_dq_mm_reference(x, q, scale))
            exact = x @ (q.float() * scale[:, None]).t()
            assert (got - exact).abs().max() <= 0.015 * exact.abs().max()


def test_int8_dot_product_follows_the_kernel_path(monkeypatch):
    monkeypatch.setenv(ISA_ENV, "generic")
    assert int8.int8_dot_variant() == "generic"
    if "avx2" in supported_isas():
        monkeypatch.setenv(ISA_ENV, "avx2")
        assert int8.int8_dot_variant() == ("avxvnni" if "avx_vnni" in cpu_features() else "avx2")


def test_int4_packing_round_trips():
    q = torch.randint(0, 16, (5, 96), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = int4.pack_int4(q)
    assert packed.shape == (5, 48) and packed.dtype == torch.uint8 and torch.equal(int4.unpack_int4(packed), q)
    # the documented layout: lane i of unit 0 holds q[8k + i] in bits 4k..4k+3
    lane3 = int(packed[0, 6]) | int(packed[0, 7]) << 8
    assert [lane3 >> 4 * k & 0xF for k in range(4)] == [int(q[0, 8 * k + 3]) for k in range(4)]


@NEEDS_CC
def test_avx512_path_compiles_on_any_x86_compiler(tmp_path):
    """The AVX-512 code only runs where the CPU has it; here it is at least built (target flags forced)."""
    if shutil.which("cc") is None or subprocess.run(["cc", "-dumpmachine"], capture_output=True, text=True
                                                    ).stdout.split("-")[0] not in ("x86_64", "amd64"):
        pytest.skip("not an x86-64 compiler")
    for name, source in SOURCES.items():
        # -O0: a quick build that still needs every AVX-512 intrinsic to exist for the target
        command = compile_command(source, tmp_path / f"{name}.so", "avx512") + ["-mavx512f", "-mavx512bw", "-O0"]
        built = subprocess.run(command, capture_output=True, text=True)
        assert built.returncode == 0, built.stderr


NEON_HARNESS = r"""
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
void int8_wo_mm(const float *x, const int8_t *w, const float *s, float *y, long N, long D, long O, int threads);
void int4_wo_mm(const float *x, const uint8_t *packed, const float *s, const float *z, float *y, long N, long D,
                long O, long group, int threads);
static void *slurp(const char *path) {
    FILE *f = fopen(path, "rb"); fseek(f, 0, SEEK_END); long n = ftell(f); rewind(f);
    void *p = malloc(n); if (fread(p, 1, n, f) != (size_t)n) exit(3); fclose(f); return p;
}
int main(int argc, char **argv) {  /* dir N D O group: reads the inputs, writes y8 and y4 */
    char p[512]; const char *d = argv[1];
    long N = atol(argv[2]), D = atol(argv[3]), O = atol(argv[4]), group = atol(argv[5]);
    float *y = malloc(sizeof(float) * N * O);
#define IN(name) (snprintf(p, sizeof p, "%s/" name, d), slurp(p))
    int8_wo_mm(IN("x"), IN("q8"), IN("s8"), y, N, D, O, 1);
    snprintf(p, sizeof p, "%s/y8", d); FILE *f = fopen(p, "wb"); fwrite(y, sizeof(float), N * O, f); fclose(f);
    int4_wo_mm(IN("x"), IN("q4"), IN("s4"), IN("z4"), y, N, D, O, group, 1);
    snprintf(p, sizeof p, "%s/y4", d); f = fopen(p, "wb"); fwrite(y, sizeof(float), N * O, f); fclose(f);
    return 0;
}
"""


def test_neon_path_equals_the_reference_twin_under_qemu(tmp_path):
    """aarch64 NEON kernels cross-compiled and run under qemu-user on a small matrix (int8 and int4)."""
    gcc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if gcc is None or qemu is None:
        pytest.skip("needs aarch64-linux-gnu-gcc and qemu-aarch64: apt-get install -y gcc-aarch64-linux-gnu qemu-user")
    (tmp_path / "harness.c").write_text(NEON_HARNESS)
    binary = tmp_path / "neon"
    objects = []
    for name in ("int8", "int4"):  # one object each: both define speedllm_path()
        objects.append(str(tmp_path / f"{name}.o"))
        built = subprocess.run([gcc, "-O2", "-c", "-DSPEEDLLM_ISA_NEON", f"-Dspeedllm_path={name}_path",
                                "-Wno-unknown-pragmas", str(SOURCES[name]), "-o", objects[-1]],
                               capture_output=True, text=True)
        assert built.returncode == 0, built.stderr
    built = subprocess.run([gcc, "-O2", "-static", *objects, str(tmp_path / "harness.c"), "-o", str(binary)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    (N, D, O), group_size = (3, 256, 24), 64
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(O, D, generator=g)
    x = torch.randn(N, D, generator=g)
    q8, s8 = int8.quantize_int8(weight)
    q4, s4, z4 = int4.quantize_int4(weight, group_size)
    packed = int4.pack_int4(q4)
    for name, t in dict(x=x, q8=q8, s8=s8, q4=packed, s4=s4, z4=z4).items():
        t.contiguous().numpy().tofile(tmp_path / name)
    ran = subprocess.run([qemu, str(binary), str(tmp_path), str(N), str(D), str(O), str(group_size)],
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr

    def result(name):
        return torch.from_numpy(np.fromfile(tmp_path / name, dtype=np.float32).reshape(N, O))

    assert_reassociated(result("y8"), int8.int8_wo_mm_reference(x, q8, s8))
    assert_reassociated(result("y4"), int4.int4_wo_mm_reference(x, packed, s4, z4, group_size))


def test_the_variable_forces_a_path_that_doctor_names(launch, tmp_path, monkeypatch):
    monkeypatch.setenv(ISA_ENV, "generic")
    code, out, err = launch(tmp_path, "task=doctor")
    assert code == 0, err
    assert (f"({ISA_ENV}=generic; paths here: {', '.join(supported_isas())}): int8 matmul generic, int4 matmul "
            f"generic, rms_norm/swiglu/rotary portable C (generic build)") in out
    if batch_invariant.available():  # the forced path leaves the packed bf16 kernels (AMX, AVX512-BF16) out too
        assert f"batch-invariant bf16 matmul fp32 lanes; not AMX: {ISA_ENV} is set" in out


def test_a_path_this_cpu_cannot_run_is_refused_in_one_line(launch, tmp_path, monkeypatch):
    allowed = f"set it to one of {', '.join(supported_isas())} (this CPU; all paths: avx512, avx2, neon, generic)"
    monkeypatch.setenv(ISA_ENV, "avx9")
    code, out, err = launch(tmp_path, "task=doctor")
    assert code == 2
    assert err.strip().splitlines()[-1] == (f"error: {ISA_ENV}=avx9 is not a kernel path; {allowed} or unset it "
                                            "for the best")
    lacking = next(path for path in ISAS if path not in supported_isas())  # every CPU lacks avx512 or neon
    monkeypatch.setenv(ISA_ENV, lacking)
    with pytest.raises(UserError) as refused:
        isa()
    assert str(refused.value) == f"{ISA_ENV}={lacking} is not supported by this CPU; {allowed} or unset it for the best"
