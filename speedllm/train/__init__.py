"""Training: the pretrain/SFT loop, optimizer, LR schedules, metrics and fault handling."""
