"""Train a causal language model with shardkit's Trainer on the shipped public-domain text (no downloads).

    python examples/trainer_causal_lm.py --output_dir out/clm --max_steps 50
    python examples/trainer_causal_lm.py --model hf --output_dir out/clm-hf --max_steps 50   # tiny HF Llama
    shardkit launch --config_file examples/configs/fsdp.yaml examples/trainer_causal_lm.py --output_dir o
    python examples/trainer_causal_lm.py --output_dir out/clm --max_steps 100 --resume_from_checkpoint out/clm

Every TrainingArguments field is a flag (``--learning_rate 3e-3 --gradient_accumulation_steps 4 ...``);
the strategy comes from ``--deepspeed ds.json``, ``--fsdp full_shard`` or the launcher's --config_file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Subset

from shardkit.models import ByteTextDataset, Llama, LlamaConfig
from shardkit.trainer import HfArgumentParser, Trainer, TrainingArguments

DATA = Path(__file__).resolve().parent / "data" / "public_domain.txt"


@dataclass
class ModelArguments:
    model: str = "builtin"  # "builtin" (shardkit's Llama) or "hf" (transformers' LlamaForCausalLM from a config)
    seq_len: int = 64
    hidden_size: int = 64
    layers: int = 2
    data: str = str(DATA)


def build_model(margs: ModelArguments):
    if margs.model == "hf":
        from transformers import LlamaConfig as HfConfig
        from transformers import LlamaForCausalLM

        config = HfConfig(vocab_size=256, hidden_size=margs.hidden_size, intermediate_size=2 * margs.hidden_size,
                          num_hidden_layers=margs.layers, num_attention_heads=4, num_key_value_heads=4,
                          max_position_embeddings=margs.seq_len)
        return LlamaForCausalLM(config)
    if margs.model != "builtin":
        raise ValueError(f"--model {margs.model!r}: use 'builtin' or 'hf'")
    return Llama(LlamaConfig(hidden_size=margs.hidden_size, intermediate_size=2 * margs.hidden_size,
                             num_layers=margs.layers, num_heads=4, max_position=margs.seq_len))


def main(argv: list[str] | None = None) -> dict:
    margs, args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses(argv)
    torch.manual_seed(args.seed)
    data = ByteTextDataset(margs.data, seq_len=margs.seq_len, stride=margs.seq_len)
    split = int(len(data) * 0.9)
    trainer = Trainer(build_model(margs), args, train_dataset=Subset(data, range(split)),
                      eval_dataset=Subset(data, range(split, len(data))))
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = trainer.evaluate()
    trainer.runner.print(f"train loss {result.training_loss:.4f}, eval loss {metrics['eval_loss']:.4f}")
    trainer.save_model()
    return metrics


if __name__ == "__main__":
    main()
