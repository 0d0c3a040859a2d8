"""Data: tokenizers, preprocessing to Megatron `.bin/.idx`, pretraining and SFT datasets, the loader."""
