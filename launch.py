"""SpeedLLM's entry point: compose the config, validate it, freeze it, run or spawn the ranks."""

import hydra
from omegaconf import DictConfig

from speedllm.config import register_configs

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from speedllm.launcher import launch

    launch(cfg)


if __name__ == "__main__":
    main()
