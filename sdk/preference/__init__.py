"""Preference fine-tuning: TRL's DPOTrainer and DPOConfig on shardkit's Trainer, and the base the family shares.

    from shardkit.preference import DPOConfig, DPOTrainer
    trainer = DPOTrainer(model, args=DPOConfig(output_dir="out", beta=0.1), train_dataset=pairs,
                         processing_class=tokenizer)
    trainer.train()
"""

from shardkit.preference.base import PreferenceTrainer
from shardkit.preference.config import DPOConfig
from shardkit.preference.data import DataCollatorForPreference, PreferenceTokenizer
from shardkit.preference.dpo import DPOTrainer
from shardkit.preference.logps import SequenceLogps
from shardkit.preference.losses import DPO_LOSS_TYPES, PAIR_LOSSES, PairLogps, dpo_rewards, pair_loss

__all__ = ["DPO_LOSS_TYPES", "DPOConfig", "DPOTrainer", "DataCollatorForPreference", "PAIR_LOSSES", "PairLogps",
           "PreferenceTokenizer", "PreferenceTrainer", "SequenceLogps", "dpo_rewards", "pair_loss"]
