"""Preference fine-tuning on shardkit's Trainer, with TRL's names."""
