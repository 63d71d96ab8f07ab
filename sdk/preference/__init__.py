"""Preference fine-tuning: TRL's DPOTrainer and DPOConfig on shardkit's Trainer, the base the family shares, and
the family on it: KTOTrainer/KTOConfig, ORPOTrainer/ORPOConfig, CPOTrainer/CPOConfig (SimPO: loss_type="simpo").

    from shardkit.preference import DPOConfig, DPOTrainer
    trainer = DPOTrainer(model, args=DPOConfig(output_dir="out", beta=0.1), train_dataset=pairs,
                         processing_class=tokenizer)
    trainer.train()
"""

from shardkit.preference.base import PreferenceTrainer
from shardkit.preference.config import DPOConfig
from shardkit.preference.cpo import CPOConfig
from shardkit.preference.data import DataCollatorForPreference, PreferenceTokenizer
from shardkit.preference.dpo import DPOTrainer
from shardkit.preference.kto import KTOConfig
from shardkit.preference.kto_trainer import KTOTrainer
from shardkit.preference.logps import SequenceLogps
from shardkit.preference.losses import DPO_LOSS_TYPES, PAIR_LOSSES, PairLogps, dpo_rewards, pair_loss
from shardkit.preference.orpo import ORPOConfig
from shardkit.preference.reference_free import CPOTrainer, ORPOTrainer

__all__ = ["CPOConfig", "CPOTrainer", "DPO_LOSS_TYPES", "DPOConfig", "DPOTrainer", "DataCollatorForPreference",
           "KTOConfig", "KTOTrainer", "ORPOConfig", "ORPOTrainer", "PAIR_LOSSES", "PairLogps", "PreferenceTokenizer",
           "PreferenceTrainer", "SequenceLogps", "dpo_rewards", "pair_loss"]
