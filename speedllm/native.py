"""C kernels built at first use with the host's compiler, cached per source and CPU, loaded with ctypes.

`cc -O3 -march=native -fopenmp`: the build is for this CPU, so the CPU's flags are part of the cache key (a shared
cache never hands an AVX-512 build to a CPU without it). Every kernel has a reference twin in torch that runs
where no library can be built (no compiler): `load` then warns once and returns None.
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


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "speedllm" / "kernels"


def _cpu_flags() -> str:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    return next((line for line in cpuinfo.splitlines() if line.startswith("flags")), platform.processor())


@functools.cache
def load(source: Path):
    """The shared library built from the C file `source` (ctypes.CDLL), or None where it cannot be built."""
    try:
        code = source.read_bytes()
    except OSError as e:  # an install without the package's C sources
        warnings.warn(f"{source.name} not found ({e}); its reference twin in torch runs instead (slower)")
        return None
    key = hashlib.sha256(code + _cpu_flags().encode()).hexdigest()[:16]
    library = cache_dir() / f"{source.stem}_{key}.so"
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
            command = [os.environ.get("CC", "cc"), "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
                       str(source), "-o", str(built)]
            try:
                subprocess.run(command, check=True, capture_output=True)
            except (OSError, subprocess.CalledProcessError) as e:
                warnings.warn(f"{source.name} not built ({' '.join(command)}: {e}); its reference twin in torch "
                              "runs instead (slower)")
                return None
            built.rename(library)
    return ctypes.CDLL(str(library))
