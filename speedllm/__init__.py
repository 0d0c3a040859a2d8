"""SpeedLLM: declarative training, fine-tuning and serving of Qwen3."""

__version__ = "0.1.0"
