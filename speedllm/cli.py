"""SpeedLLM's entry point: compose the config, validate it, freeze it, run it or spawn its ranks.

    speedllm model=qwen3_0.6b parallel=tp8          (the console script, from any directory)
    python launch.py -m model=qwen3_tiny optim.lr=1e-4,3e-4   (the same, from a checkout)
"""

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, OmegaConfBaseException

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
    """Run one config (or a `-m` sweep) from the command line; exit 1 if a sweep point failed, 2 if Hydra
    cannot compose the overrides."""
    user_wants_traces = "HYDRA_FULL_ERROR" in os.environ
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises composition errors to us instead of printing them
    try:
        run()
    except (HydraException, OmegaConfBaseException, OSError) as e:
        if user_wants_traces:
            raise
        print(f"error: {composition_error(e)}", file=sys.stderr)
        sys.exit(2)
    if failed_points:
        print(f"error: {len(failed_points)} sweep point(s) failed: {', '.join(failed_points)}", file=sys.stderr)
        sys.exit(1)


def composition_error(e: Exception) -> str:
    """What Hydra could not do with the command line, as one line naming the override and the fix."""
    if isinstance(e, OverrideParseException):
        key, eq, value = e.override.partition("=")
        if not eq:
            return (f"'{e.override}' is not an override (key=value); a value with spaces belongs inside the "
                    "previous one, quoted: 'generate.prompt=\"two words\"'")
        return (f"{e.override}: Hydra cannot parse this value (characters such as spaces, brackets, quotes or "
                f"non-ASCII letters need quoting); quote it: '{key}=\"{value}\"'")
    if isinstance(e, MissingConfigException) and e.options:
        group, _, choice = str(e.missing_cfg_file).rpartition("/")
        return f"{group}={choice} is not an option; choose {group}=<{'|'.join(e.options)}>"
    if isinstance(e, OSError) and e.filename is not None:  # Hydra making the run directory
        return (f"hydra.run.dir: cannot create the run directory {e.filename} ({e.strerror}); pass "
                "hydra.run.dir=<a new or existing folder> (hydra.sweep.dir= under -m)")
    cause = e.__cause__
    if isinstance(cause, OmegaConfBaseException) and cause.full_key:  # the schema refused a key or a value
        what = str(cause).splitlines()[0].rstrip(".")
        if isinstance(cause, ConfigAttributeError):
            return (f"{cause.full_key} is not a setting ({what}); check the spelling (`python launch.py --cfg job` "
                    "prints every key)")
        return f"{cause.full_key}: {what}; give {cause.full_key} a value of the type it holds"
    return "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
