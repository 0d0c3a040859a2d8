"""Hardware profiles: their schema (HardwareConfig), `hardware=auto` detection, loading one from conf/hardware/;
what this CPU computes and how fast (ISA features, a GEMM probe per dtype, cached per machine), from which a CPU
profile's `peak_tflops` and `hardware.dtype=auto` are resolved.
"""

import hashlib
import importlib.util
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from speedllm.native import cache_dir, cpu_features, cpu_name
from speedllm.paths import CONF

# hardware.dtype (and convert.dtype) names
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO = "auto"  # hardware.dtype=auto: bfloat16 on accelerators, on a CPU what its probe shows faster (cpu_dtype)
PROBED = ("float32", "bfloat16")  # the dtypes a CPU's probe measures
# bf16 compute (with fp32 master weights) only where its GEMMs are this much faster than fp32's: the elementwise
# ops, the casts and the optimizer step stay at memory speed, so a small GEMM gain is lost (a 2-core Zen 5 with
# AVX512-BF16: 5.2x; AVX2-only CPUs emulate bf16: ~1/20 of fp32)
BF16_GAIN = 1.5
# a measured gain within BF16_GAIN divided or multiplied by this is too close to call from a timing (a busy box
# measured an AMX Xeon's 6.2 as 1.5-1.6): there the ISA decides (native bf16: bfloat16), so that `auto` does not flip
# between machines of one kind for a small difference
BF16_MARGIN = 1.25
NATIVE_BF16 = ("amx_bf16", "avx512_bf16", "bf16")
PROBE_ROWS, PROBE_K, PROBE_N = 256, 1024, 1024  # the probe's GEMM [rows x K] . [K x N] (probe_rows)
PROBE_S = 0.05  # seconds of timed calls per round
PROBE_ROUNDS = 6  # at most this many rounds per dtype, until the two best agree within PROBE_AGREE
PROBE_AGREE = 0.05


@dataclass
class HardwareConfig:
    """A device profile: what to run on and how fast it is (used for MFU and the planner)."""

    name: str = "auto"
    device: str = "cpu"  # cpu | cuda | npu
    backend: str = "gloo"  # gloo | nccl | hccl
    ops: str = "reference"  # op implementations: reference | cpu | cuda | npu
    dtype: str = "float32"  # compute dtype (bf16 with fp32 master weights); auto: resolve_dtype picks
    memory_gb: float = 16.0  # memory per device
    host_memory_gb: float = 64.0  # host RAM per node the job may use (parallel.offload, train.activation_offload)
    host_link_bandwidth_gbps: float = 16.0  # host <-> device copies, per device and direction (PCIe)
    host_memory_bandwidth_gbps: float = 100.0  # host RAM per node (the update of offloaded parameters runs there)
    # dense FLOP/s per dtype, for MFU and the planner: a data sheet's on accelerators, the GEMM probe's on CPUs
    peak_tflops: Dict[str, float] = field(default_factory=lambda: {"float32": 0.1, "bfloat16": 0.01})
    memory_bandwidth_gbps: float = 20.0
    intra_node_bandwidth_gbps: float = 10.0
    inter_node_bandwidth_gbps: float = 1.0
    devices_per_node: int = 8
    env: Dict[str, str] = field(default_factory=dict)
    float8: bool = False  # float8 matmuls (NVIDIA SM 8.9+: H100/H200/L40/RTX 40xx); gates quant=float8
    # every matmul and attention in one fixed summation order (speedllm.ops.batch_invariant; CPUs): a token's values
    # do not depend on its batch, so rollout and training log-probabilities are equal to the bit. None: the task's
    # choice on a CPU in bfloat16 (TaskSpec.batch_invariant; speedllm.config.resolve.resolve_batch_invariant), else off
    batch_invariant: Optional[bool] = None

def npu_available() -> bool:
    """True when torch_npu is installed and sees a device. Imported only if present: it needs the Ascend toolkit."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401

    return torch.npu.is_available()


def detect() -> str:
    """The profile `hardware=auto` stands for: npu if torch_npu sees a device, else cuda (h100/h200 by name), else cpu."""
    if npu_available():
        return "npu_a3" if "910C" in torch.npu.get_device_name(0) else "npu_a2"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return "h200" if "H200" in name else "h100" if "H100" in name else "cuda"
    return "cpu"


def load_profile(name: str) -> DictConfig:
    """A profile from conf/hardware/<name>.yaml, typed by the schema."""
    return OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(CONF / "hardware" / f"{name}.yaml"))


def isa_features() -> tuple:
    """This CPU's ISA features (speedllm.native.cpu_features), where torch can tell also checked by torch
    (which asks the OS too: AMX tiles must be enabled by the kernel). torch versions without a check skip it."""
    features = set(cpu_features())
    for names, check in ((("amx_bf16", "amx_int8"), "_is_amx_tile_supported"),
                         (("avx512_bf16",), "_is_avx512_bf16_supported"), (("avx512_vnni",), "_is_vnni_supported")):
        fn = getattr(torch.cpu, check, None)
        if fn is not None and not fn():
            features -= set(names)
    return tuple(f for f in cpu_features() if f in features)


def _gemm_gflops(dtype: torch.dtype, rows: int) -> float:
    """GFLOP/s of torch.mm in `dtype` at [rows x PROBE_K] . [PROBE_K x PROBE_N]: the best of rounds of calls timed
    for PROBE_S each (after a warm call), stopping once the two best rounds agree within PROBE_AGREE."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(rows, PROBE_K, generator=gen).to(dtype)
    b = torch.randn(PROBE_K, PROBE_N, generator=gen).to(dtype)
    torch.mm(a, b)  # the first call of a shape sets up its kernel
    rates = []
    while len(rates) < PROBE_ROUNDS:
        calls, start = 0, time.perf_counter()
        while calls == 0 or time.perf_counter() - start < PROBE_S:
            torch.mm(a, b)
            calls += 1
        rates.append(2 * rows * PROBE_K * PROBE_N * calls / (time.perf_counter() - start) / 1e9)
        best, second = sorted(rates)[-2:] if len(rates) > 1 else (0.0, rates[0])
        if second - best <= PROBE_AGREE * second:
            break
    return max(rates)


def cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def busy() -> float:
    """The one-minute load average when it is at least the cores this process has (others compete for them and a
    timing is low), else 0."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return load if load >= cores() else 0.0


def probe_rows(name: str, features: tuple) -> int:
    """The probe's rows for dtype `name`: a training-like PROBE_ROWS, but an emulated bfloat16 (no AMX,
    AVX512-BF16 or Arm BF16) at 32, where its rate is the same and a call takes 1/8 of a second, not 1."""
    native = name != "bfloat16" or set(NATIVE_BF16) & set(features)
    return PROBE_ROWS if native else 32


def probe_file(name: str = "gemm", detail: str = ""):
    """Where this machine's measurement `name` (of `detail`, e.g. a model and shape) is cached: per CPU (name and
    features), torch version and thread count."""
    key = f"{cpu_name()}|{' '.join(cpu_features())}|{torch.__version__}|{torch.get_num_threads()}{detail}"
    return cache_dir().parent / "probe" / f"{name}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def measured_once(name: str, measure, detail: str = "", valid=lambda value: True):
    """What `measure()` returns (JSON), measured once per machine and cached beside the kernel cache (probe_file;
    measured anew where the cache cannot be written), so that every run on a machine sees the same figures. A
    cache that is not JSON, or whose value is not `valid`, is measured again (with a one-line note).

    A dict measured while the box was busy (load average at least its cores) is cached with `"busy": <load>` and
    measured again by the next run that finds the box quiet, which caches its figures for good."""
    path = probe_file(name, detail and f"|{detail}")
    cached = None
    try:
        cached = json.loads(path.read_text())
        if not valid(cached):
            print(f"note: {path} holds no valid measurement ({str(cached)[:60]}); measuring again")
            cached = None
        elif not (isinstance(cached, dict) and cached.get("busy")) or busy():
            return cached
    except OSError:
        pass
    except ValueError:
        print(f"note: {path} is not JSON; measuring again")
    load = busy()
    value = measure()
    if isinstance(value, dict) and load:
        if cached is not None:
            return cached  # still busy: no better figure than the cached one
        value["busy"] = round(load, 2)
        print(f"note: {name} measured under load {load:.1f} on {cores()} cores (its figures may be low); "
              "measured again by the next run on a quiet box")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{time.monotonic_ns()}.tmp")
        tmp.write_text(json.dumps(value))
        tmp.rename(path)  # atomic: a concurrent reader sees all of it or none
    except OSError:
        pass
    return value


def cpu_probe() -> Dict[str, float]:
    """GEMM GFLOP/s per dtype of PROBED on this CPU at torch's thread count, measured once per machine."""
    gflops = measured_once("gemm", lambda: {name: round(_gemm_gflops(DTYPES[name], probe_rows(name, isa_features())),
                                                        2) for name in PROBED}, valid=positive_rates(PROBED))
    return {name: float(gflops[name]) for name in PROBED}


def positive_rates(names) -> Callable:
    """A check of a cached measurement: a dict with a finite positive number for each of `names`."""
    def valid(value) -> bool:
        return isinstance(value, dict) and all(
            isinstance(value.get(n), (int, float)) and not isinstance(value.get(n), bool)
            and math.isfinite(value[n]) and value[n] > 0 for n in names)
    return valid


def cpu_dtype(gflops: Dict[str, float], features: tuple = ()) -> str:
    """hardware.dtype=auto on a CPU: bfloat16 where its GEMMs are BF16_GAIN x float32's, else float32; a gain
    within BF16_MARGIN of that is decided by whether the CPU (`features`) computes bf16 natively."""
    gain = gflops["bfloat16"] / gflops["float32"]
    if gain >= BF16_GAIN * BF16_MARGIN or gain <= BF16_GAIN / BF16_MARGIN:
        return "bfloat16" if gain >= BF16_GAIN else "float32"
    return "bfloat16" if set(NATIVE_BF16) & set(features) else "float32"


def cpu_peaks() -> Dict[str, float]:
    """This CPU's peak_tflops per dtype: its probe's GEMM rates (per core count in use: torch's threads)."""
    return {name: rate / 1000 for name, rate in cpu_probe().items()}


def resolve_dtype(hw: DictConfig) -> None:
    """hardware.dtype=auto typed for a profile, in place: on a CPU what its probe shows faster (cpu_dtype, as
    conf/hardware/cpu.yaml's default), elsewhere bfloat16."""
    if hw.dtype == AUTO:
        hw.dtype = cpu_dtype(cpu_probe(), isa_features()) if hw.device == "cpu" else "bfloat16"
