"""Checkpoints: atomic DCP save/resume (dcp.py); HF import/export."""
