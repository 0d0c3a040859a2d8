"""C kernels built at first use with the host's compiler, cached per source, CPU and kernel path, loaded with ctypes.

`cc -O3 -march=native -fopenmp -DSPEEDLLM_ISA_<PATH>`: the build is for this CPU, so the CPU's flags are part of
the cache key (a shared cache never hands an AVX-512 build to a CPU without it). The kernel path (`isa()`) is the
best this CPU supports: avx512 > avx2 (with FMA) on x86-64, neon on aarch64, else generic (portable C the compiler
vectorizes for the host). SPEEDLLM_CPU_ISA forces a lower one, so every path can be built and tested on one
machine; it is read at each kernel call (cheap), so a process can switch paths. Every kernel has a reference twin
in torch that runs where no library can be built (no compiler): `load` then warns once and returns None.
"""

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path

from speedllm.errors import UserError

ISA_ENV = "SPEEDLLM_CPU_ISA"
ISAS = ("avx512", "avx2", "neon", "generic")  # fastest first
# beyond -march=native: the avx2 path on an AVX-512 host must not let the compiler use AVX-512 either
_ISA_FLAGS = {"avx2": ["-mno-avx512f"]}


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "speedllm" / "kernels"  # "": unset


def _cpuinfo(field: str) -> str:
    """The value of the first `field` line of /proc/cpuinfo ("" where there is none, e.g. not Linux)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((line for line in cpuinfo.splitlines() if line.split(":")[0].strip() == field), "")
    return line.partition(":")[2].strip()


def _cpu_flags() -> str:
    return _cpuinfo("flags") or platform.processor()


# CPU features the hardware layer reports and the kernels select on: /proc/cpuinfo's x86 flag, or aarch64 Features
_FEATURES = {"amx_bf16": "amx_bf16", "amx_int8": "amx_int8", "avx512_bf16": "avx512_bf16",
             "avx512_vnni": "avx512_vnni", "avx_vnni": "avx_vnni", "avx512f": "avx512f", "avx512bw": "avx512bw", "avx2": "avx2",
             "fma": "fma", "neon": "asimd", "sve": "sve", "bf16": "bf16", "i8mm": "i8mm", "dotprod": "asimddp"}


@functools.cache
def cpu_features() -> tuple:
    """This CPU's features of `_FEATURES` (ISA extensions that decide kernels and dtypes), by name."""
    found = set(_cpu_flags().split()) | set(_cpuinfo("Features").split())
    return tuple(name for name, flag in _FEATURES.items() if flag in found)


# glibc's mallopt parameters (malloc.h) and their defaults
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_MALLOC_DEFAULTS = {_M_TRIM_THRESHOLD: 128 * 1024, _M_MMAP_MAX: 65536}
_KEEP = {_M_TRIM_THRESHOLD: 2**31 - 1, _M_MMAP_MAX: 0}


def keep_freed_memory(keep: bool = True) -> bool:
    """Have glibc's malloc serve every allocation from its heap and keep freed memory for the next allocation
    (up to 2 GiB free at the heap's top before any is returned); keep=False restores glibc's defaults.

    By default glibc maps each allocation over 32 MiB (a vocabulary-sized logit or weight gradient, a layer's
    activations) afresh from the kernel and unmaps it when freed, so every training step faults its pages in
    again: on a 2-core Xeon with AMX that was 20% of the bf16 step of the 41.6M benchmark model (0.58 -> 0.46 s)
    and 6% of the fp32 one. jemalloc and tcmalloc, which Intel's PyTorch launcher preloads, keep memory by
    design. Returns False where the C library has no mallopt (musl, macOS): nothing changes there.
    """
    mallopt = _mallopt()
    if mallopt is None:
        return False
    values = _KEEP if keep else _MALLOC_DEFAULTS
    return all(mallopt(param, value) == 1 for param, value in values.items())


@functools.cache
def _mallopt():
    return getattr(ctypes.CDLL(None), "mallopt", None)


def cpu_name() -> str:
    """The CPU's model name, for reports."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


@functools.cache
def supported_isas() -> tuple:
    """The kernel paths this CPU can run, fastest first (generic always)."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):  # NEON is part of every aarch64 CPU
        return ("neon", "generic")
    flags = set(_cpu_flags().split())
    x86 = [isa for isa, needs in (("avx512", {"avx512f"}), ("avx2", {"avx2", "fma"})) if needs <= flags]
    return (*x86, "generic") if machine in ("x86_64", "amd64") else ("generic",)


def isa() -> str:
    """The kernel path the C kernels are built for: SPEEDLLM_CPU_ISA where set, else the best this CPU supports."""
    return _isa(os.environ.get(ISA_ENV, ""))


@functools.cache
def _isa(forced: str) -> str:
    supported = supported_isas()
    if not forced:
        return supported[0]
    if forced not in supported:
        what = "is not a kernel path" if forced not in ISAS else "is not supported by this CPU"
        raise UserError(f"{ISA_ENV}={forced} {what}; set it to one of {', '.join(supported)} (this CPU; all paths: "
                        f"{', '.join(ISAS)}) or unset it for the best")
    return forced


def compile_command(source: Path, out: Path, path: str) -> list:
    """The host compiler's command line that builds `source` for kernel path `path` on this CPU."""
    # -fno-trapping-math: FP exceptions are never read here, and without it GCC will not vectorize a loop whose
    # float compare (exp_f32's clamp in cpu_kernels.c) might trap: SwiGLU ran scalar at a third of the speed
    return [os.environ.get("CC", "cc"), "-O3", "-march=native", "-fno-trapping-math", *_ISA_FLAGS.get(path, []),
            f"-DSPEEDLLM_ISA_{path.upper()}", f'-DSPEEDLLM_ISA="{path}"', "-fopenmp", "-shared", "-fPIC",
            str(source), "-o", str(out)]


@functools.cache
def load(source: Path, path: str):
    """The shared library built from the C file `source` for kernel path `path` (one of supported_isas(); callers
    pass isa()) as a ctypes.CDLL, or None where it cannot be built."""
    try:
        code = source.read_bytes()
    except OSError as e:  # an install without the package's C sources
        warnings.warn(f"{source.name} not found ({e}); its reference twin in torch runs instead (slower)")
        return None
    command = compile_command(source, Path("built.so"), path)
    key = hashlib.sha256(code + _cpu_flags().encode() + " ".join(command).encode()).hexdigest()[:16]
    library = cache_dir() / f"{source.stem}_{path}_{key}.so"
    if not library.exists():
        try:
            library.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(library.parent, os.W_OK):
                raise PermissionError(f"{library.parent} is not writable")
        except OSError as e:  # a read-only home or cache: build for this process only
            library = Path(tempfile.mkdtemp(prefix="speedllm-kernels-")) / library.name
            warnings.warn(f"kernel cache {cache_dir()} cannot be written ({e}); building {source.name} into "
                          f"{library.parent} for this run (set XDG_CACHE_HOME to a writable folder to keep it)")
        with tempfile.TemporaryDirectory(dir=library.parent) as tmp:  # build aside, then rename: atomic
            built = Path(tmp) / library.name
            command = compile_command(source, built, path)
            try:
                subprocess.run(command, check=True, capture_output=True)
            except (OSError, subprocess.CalledProcessError) as e:
                warnings.warn(f"{source.name} not built ({' '.join(command)}: {e}); its reference twin in torch "
                              "runs instead (slower)")
                return None
            built.rename(library)
    return ctypes.CDLL(str(library))


def kernel_path(source: Path) -> str:
    """Which code the library built from `source` runs on this machine now (its `speedllm_path()`), or "reference
    twin" where it cannot be built; for task=doctor."""
    lib = load(source, isa())
    if lib is None:
        return "reference twin (not built)"
    lib.speedllm_path.restype = ctypes.c_char_p
    return lib.speedllm_path().decode()


def c_function(source: Path, name: str, argtypes: tuple):
    """The C function `name` (returning void) of `source`, built for the current kernel path (isa()), as a ctypes
    function with `argtypes`; None where it cannot be built."""
    return _c_function(source, name, argtypes, isa())


@functools.cache
def _c_function(source: Path, name: str, argtypes: tuple, path: str):
    lib = load(source, path)
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.restype = None
    fn.argtypes = list(argtypes)
    return fn
