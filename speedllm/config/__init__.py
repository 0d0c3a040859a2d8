from speedllm.config.schema import RunConfig, register_configs

__all__ = ["RunConfig", "register_configs"]
