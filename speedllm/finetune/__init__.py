"""Fine-tuning methods beyond full fine-tuning: LoRA / QLoRA adapters (PEFT format) and DPO."""
