"""Parallelism applied from outside the model: the device mesh, `parallelize`, and what the loop needs."""

from speedllm.parallel.mesh import ParallelDims
from speedllm.parallel.parallelize import ParallelModel, clip_grad_norm, materialize, output_loss_for, parallelize

__all__ = ["ParallelDims", "ParallelModel", "clip_grad_norm", "materialize", "output_loss_for", "parallelize"]
