"""Supervised fine-tuning: TRL's SFTTrainer and SFTConfig on shardkit's Trainer.

    from shardkit.sft import SFTConfig, SFTTrainer, train_tokenizer
    tokenizer = train_tokenizer(["examples/data/public_domain.txt"], chat_template="chatml")
    trainer = SFTTrainer(model, SFTConfig(output_dir="out", packing=True, max_length=512, assistant_only_loss=True),
                         train_dataset=conversations, processing_class=tokenizer)
    trainer.train()
"""

from shardkit.sft.chat import CHAT_TEMPLATES, set_chat_template, train_tokenizer
from shardkit.sft.collator import DataCollatorForLanguageModeling
from shardkit.sft.config import SFTConfig
from shardkit.sft.dataset import SFTTokenizer, prepare_dataset
from shardkit.sft.packing import bfd_bins, pack_bfd, pack_examples, pack_wrapped
from shardkit.sft.trainer import SFTTrainer

__all__ = ["CHAT_TEMPLATES", "DataCollatorForLanguageModeling", "SFTConfig", "SFTTokenizer", "SFTTrainer",
           "bfd_bins", "pack_bfd", "pack_examples", "pack_wrapped", "prepare_dataset", "set_chat_template",
           "train_tokenizer"]
