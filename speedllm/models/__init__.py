"""Qwen3 model definition (single device), its KV cache and the transformers name/config map."""

from speedllm.models.kv_cache import KVCache
from speedllm.models.qwen3 import Qwen3, num_params

__all__ = ["Qwen3", "KVCache", "num_params"]
