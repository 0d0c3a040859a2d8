"""The `speedllm` console script: the same as `python launch.py ...` from the repository root."""

import runpy

from speedllm.config.schema import ROOT


def main() -> None:
    runpy.run_path(str(ROOT / "launch.py"), run_name="__main__")
