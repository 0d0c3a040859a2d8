"""SpeedLLM's benchmarks, one module each, run from the repository root as `python -m benchmarks <name> [args]`.

`python -m benchmarks --list` lists them; every one takes `--dry`, its smallest form (seconds on a CPU), which
tests/test_benchmarks.py runs so that none can rot. Timing, peak memory, interleaving and the pieces several
benchmarks share live in benchmarks/common.py.
"""

import ast
import pkgutil
from pathlib import Path

NOT_BENCHMARKS = ("common", "__main__")


def name_of(module: str) -> str:
    """The command-line name of a benchmark module: `benchmarks.bench_model` -> `model`."""
    return module.rpartition(".")[2].removeprefix("bench_")


def benchmarks() -> dict:
    """{name: module name} of every benchmark, sorted by name."""
    found = {name_of(m.name): f"{__name__}.{m.name}" for m in pkgutil.iter_modules(__path__)
             if m.name not in NOT_BENCHMARKS}
    return dict(sorted(found.items()))


def summary(module: str) -> str:
    """The first paragraph of a benchmark's docstring on one line, read without importing it."""
    path = Path(__path__[0]) / f"{module.rpartition('.')[2]}.py"
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())
