"""SpeedLLM's entry point: compose the config, validate it, freeze it, run it or spawn its ranks.

    speedllm model=qwen3_0.6b parallel=tp8          (the console script, from any directory)
    python launch.py -m model=qwen3_tiny optim.lr=1e-4,3e-4   (the same, from a checkout)
"""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from speedllm.config import register_configs
from speedllm.paths import CONF

register_configs()
failed_points: list[str] = []


@hydra.main(config_path=str(CONF), config_name="config", version_base=None)
def run(cfg: DictConfig) -> None:
    from speedllm.launcher import launch

    status = launch(cfg)
    if status == 0:
        return
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        sys.exit(status)
    # A sweep goes on past a failed point; the launcher's exit status reports it at the end.
    failed_points.append(f"#{hc.job.num} ({' '.join(hc.overrides.task)})")


def main() -> None:
    """Run one config (or a `-m` sweep) from the command line; exit 1 if a sweep point failed."""
    run()
    if failed_points:
        print(f"error: {len(failed_points)} sweep point(s) failed: {', '.join(failed_points)}", file=sys.stderr)
        sys.exit(1)
