"""Generation: the static-KV-cache engine, sampling, continuous batching, the inference model loader and
the lm-eval backend, shared by the generate / chat / serve / evaluate tasks."""
