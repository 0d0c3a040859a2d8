"""Inference: generation with a static KV cache (engine), sampling, and the generate / chat / evaluate tasks."""
