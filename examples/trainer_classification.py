"""Fine-tune a small Hugging Face sequence classifier, built from a config, on locally generated data.

    python examples/trainer_classification.py --output_dir out/cls --num_train_epochs 3
    shardkit launch --config_file examples/configs/fsdp.yaml examples/trainer_classification.py --output_dir o

The task: does a sequence of random tokens contain token 7 more often than token 9? Accuracy comes
from compute_metrics; the model is a 2-layer Llama classifier with random weights (nothing downloaded).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from shardkit.trainer import HfArgumentParser, Trainer, TrainingArguments


@dataclass
class DataArguments:
    num_train: int = 512
    num_eval: int = 128
    seq_len: int = 24
    vocab_size: int = 32


class CountingTask(Dataset):
    """Rows of random tokens labelled 1 when token 7 occurs more often than token 9."""

    def __init__(self, rows: int, seq_len: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (rows, seq_len), generator=g)
        self.labels = ((self.ids == 7).sum(1) > (self.ids == 9).sum(1)).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "label": self.labels[i]}


def accuracy(pred) -> dict:
    logits, labels = pred
    return {"accuracy": float((np.argmax(logits, -1) == labels).mean())}


def main(argv: list[str] | None = None) -> dict:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    dargs, args = HfArgumentParser((DataArguments, TrainingArguments)).parse_args_into_dataclasses(argv)
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=dargs.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=dargs.seq_len,
                         num_labels=2, pad_token_id=0)
    model = LlamaForSequenceClassification(config)
    train = CountingTask(dargs.num_train, dargs.seq_len, dargs.vocab_size, seed=1)
    val = CountingTask(dargs.num_eval, dargs.seq_len, dargs.vocab_size, seed=2)
    trainer = Trainer(model, args, train_dataset=train, eval_dataset=val, compute_metrics=accuracy)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = trainer.evaluate()
    trainer.runner.print(f"eval accuracy {metrics['eval_accuracy']:.3f} (majority class "
                         f"{max(val.labels.float().mean().item(), 1 - val.labels.float().mean().item()):.3f})")
    return metrics


if __name__ == "__main__":
    main()
