"""LoRA adapters (applied from outside the model, like parallelism) and the PEFT names and files they map to."""
