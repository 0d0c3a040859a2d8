"""Parallelism applied from outside the model: the device mesh, `parallelize`, and what the loop needs."""

from speedllm.parallel.parallelize import clip_grad_norm, materialize, model_parts, parallelize

__all__ = ["clip_grad_norm", "materialize", "model_parts", "parallelize"]
