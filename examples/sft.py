"""Supervised fine-tuning as the FSDP seed does it (PEFT's SFT example), on a tiny model built here: no downloads.

    # once: a tiny Llama, a tokenizer trained on examples/data/public_domain.txt and a chat set made from that text
    python examples/sft.py --make_tiny runs/tiny
    # the seed's command line with the seed's flags, on 2 CPU processes (LoRA; add the QLoRA flags for 4-bit)
    shardkit launch --config_file examples/configs/sft_fsdp.yaml --num_processes 2 examples/sft.py --seed 100 \\
        --model_name_or_path runs/tiny --dataset_name runs/tiny/chat --chat_template_format chatml \\
        --add_special_tokens False --append_concat_token False --splits "train,test" --max_seq_len 256 \\
        --num_train_epochs 1 --logging_steps 5 --log_level info --logging_strategy steps --eval_strategy epoch \\
        --save_strategy epoch --bf16 True --packing True --learning_rate 1e-4 --lr_scheduler_type cosine \\
        --weight_decay 1e-4 --warmup_steps 0 --max_grad_norm 1.0 --output_dir runs/sft-lora-fsdp \\
        --per_device_train_batch_size 8 --per_device_eval_batch_size 8 --gradient_accumulation_steps 4 \\
        --gradient_checkpointing True --use_reentrant False --dataset_text_field content --use_flash_attn True \\
        --use_peft_lora True --lora_r 8 --lora_alpha 16 --lora_dropout 0.1 --lora_target_modules all-linear \\
        --use_4bit_quantization False

What differs from the seed: ``shardkit launch`` for ``accelerate launch``; ``--eval_strategy`` for
``--evaluation_strategy`` and ``--warmup_steps 0`` for ``--warmup_ratio 0.0`` (transformers 5 removed both old
names); no ``--push_to_hub``/``--hub_*`` here (a tiny demo model has nowhere to go); ``--use_flash_attn True``
without the flash-attn package (or a GPU) runs shardkit's varlen attention instead, which keeps packed sequences
apart as FlashAttention's varlen kernel does.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardkit import seed_everything
from shardkit.sft import SFTTrainer
from shardkit.trainer import HfArgumentParser, TrainingArguments

DATA = Path(__file__).resolve().parent / "data" / "public_domain.txt"
logger = logging.getLogger("examples.sft")


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="runs/tiny", metadata={"help": "a local model directory"})
    chat_template_format: str = "none"  # chatml | zephyr | none (the text is already templated)
    lora_alpha: int = 16
    lora_dropout: float = 0.1
    lora_r: int = 64
    lora_target_modules: str = "q_proj,k_proj,v_proj,o_proj,down_proj,up_proj,gate_proj"
    use_nested_quant: bool = False
    bnb_4bit_compute_dtype: str = "float16"
    bnb_4bit_quant_type: str = "nf4"
    bnb_4bit_quant_storage_dtype: str = "uint8"
    use_flash_attn: bool = False
    use_peft_lora: bool = False
    use_8bit_quantization: bool = False
    use_4bit_quantization: bool = False
    use_reentrant: bool = False
    use_unsloth: bool = False


@dataclass
class DataTrainingArguments:
    dataset_name: str = "runs/tiny/chat"
    packing: bool = False
    dataset_text_field: str = "text"
    max_seq_length: int = 512
    append_concat_token: bool = False
    add_special_tokens: bool = False
    splits: str = "train,test"


def make_tiny(out: Path) -> None:
    """A tiny Llama (random weights), a tokenizer trained on the shipped text, and a chat set with train/test."""
    import datasets
    import transformers

    from shardkit.sft.chat import text_conversations, train_tokenizer

    tokenizer = train_tokenizer([DATA], vocab_size=512, chat_template=None)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    conversations = text_conversations(DATA.read_text())
    split = len(conversations) * 9 // 10
    datasets.Dataset.from_list(conversations[:split]).save_to_disk(str(out / "chat" / "train"))
    datasets.Dataset.from_list(conversations[split:]).save_to_disk(str(out / "chat" / "test"))
    print(f"wrote {out}: model, tokenizer, chat/train ({split}), chat/test ({len(conversations) - split})")


def create_and_prepare_model(args: ModelArguments, data_args: DataTrainingArguments,
                             training_args: TrainingArguments):
    """The seed's model, tokenizer and LoRA config (4-bit with --use_4bit_quantization)."""
    import transformers
    from peft import LoraConfig

    from shardkit.sft.chat import CHAT_TEMPLATES, SPECIAL_TOKENS

    bnb_config, quant_storage = None, None
    if args.use_4bit_quantization:
        compute_dtype = getattr(torch, args.bnb_4bit_compute_dtype)
        quant_storage = getattr(torch, args.bnb_4bit_quant_storage_dtype)
        bnb_config = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=args.bnb_4bit_quant_type, bnb_4bit_compute_dtype=compute_dtype,
            bnb_4bit_use_double_quant=args.use_nested_quant, bnb_4bit_quant_storage=quant_storage)
    attn = "sdpa"
    if args.use_flash_attn:
        try:
            import flash_attn  # noqa: F401

            attn = "flash_attention_2" if torch.cuda.is_available() else "sdpa"
        except ImportError:
            pass
        if attn != "flash_attention_2":
            logger.warning("--use_flash_attn: flash-attn needs its package and a GPU; packed batches run shardkit's "
                           "varlen attention instead (sequences kept apart as flash-attn's varlen kernel does)")
    dtype = quant_storage if quant_storage is not None and quant_storage.is_floating_point else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model_name_or_path, quantization_config=bnb_config, attn_implementation=attn, dtype=dtype,
        device_map="cpu" if bnb_config is not None and not torch.cuda.is_available() else None)
    peft_config = None
    if args.use_peft_lora:
        targets = args.lora_target_modules
        peft_config = LoraConfig(lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, r=args.lora_r,
                                 bias="none", task_type="CAUSAL_LM",
                                 target_modules=targets if targets == "all-linear" else targets.split(","))
    if args.chat_template_format in CHAT_TEMPLATES:
        special = SPECIAL_TOKENS[args.chat_template_format]
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            args.model_name_or_path, pad_token=special["pad_token"], bos_token=special["bos_token"],
            eos_token=special["eos_token"], additional_special_tokens=special["additional_special_tokens"])
        tokenizer.chat_template = CHAT_TEMPLATES[args.chat_template_format]
        # mean_resizing=False: with a 4-bit base under FSDP the embedding may not be materialised (as the seed)
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=8, mean_resizing=bnb_config is None)
    elif args.chat_template_format == "none":
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_name_or_path)
        tokenizer.pad_token = tokenizer.eos_token
    else:
        raise ValueError(f"--chat_template_format {args.chat_template_format!r}: use one of "
                         f"{sorted(CHAT_TEMPLATES)} or none")
    return model, peft_config, tokenizer


def create_datasets(tokenizer, data_args: DataTrainingArguments, training_args: TrainingArguments,
                    apply_chat_template: bool = False):
    """The seed's splits from a local directory (``load_from_disk(dataset_name/split)``), rendered to ``content``."""
    import datasets

    splits = {}
    for split in data_args.splits.split(","):
        path = Path(data_args.dataset_name) / split
        if not path.is_dir():
            raise FileNotFoundError(f"--dataset_name {data_args.dataset_name}: no {split} split at {path} (nothing is "
                                    "downloaded: make one with python examples/sft.py --make_tiny DIR)")
        kind = "train" if "train" in split else "test" if "test" in split else None
        if kind is None:
            raise ValueError(f"split {split!r} is neither a train nor a test split")
        splits[kind] = datasets.load_from_disk(str(path))
    raw = datasets.DatasetDict(splits)
    if apply_chat_template:
        def render(samples):
            return {"content": [tokenizer.apply_chat_template(c, tokenize=False) for c in samples["messages"]]}

        raw = raw.map(render, batched=True, remove_columns=raw["train"].column_names)
    logger.info("train set: %d, validation set: %d", len(raw["train"]), len(raw["test"]))
    return raw["train"], raw["test"]


def main(model_args: ModelArguments, data_args: DataTrainingArguments, training_args: TrainingArguments):
    seed_everything(training_args.seed)
    model, peft_config, tokenizer = create_and_prepare_model(model_args, data_args, training_args)
    model.config.use_cache = not training_args.gradient_checkpointing
    if training_args.gradient_checkpointing:
        training_args.gradient_checkpointing_kwargs = {"use_reentrant": model_args.use_reentrant}
    train_dataset, eval_dataset = create_datasets(tokenizer, data_args, training_args,
                                                  apply_chat_template=model_args.chat_template_format != "none")
    trainer = SFTTrainer(
        model=model,
        tokenizer=tokenizer,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config,
        packing=data_args.packing,
        dataset_kwargs={
            "append_concat_token": data_args.append_concat_token,
            "add_special_tokens": data_args.add_special_tokens,
        },
        dataset_text_field=data_args.dataset_text_field,
        max_seq_length=data_args.max_seq_length,
    )
    # The seed's lines below read the Trainer's Accelerate view (trainer.accelerator, issue 23's). A Trainer
    # without it prints the same; the FSDP plugin settings change nothing in shardkit either way (its FSDP wraps
    # the repeated blocks itself, and save_model writes the full state dict).
    accelerator_view = hasattr(trainer, "accelerator")
    if accelerator_view:
        trainer.accelerator.print(f"{trainer.model}")
    else:
        trainer.runner.print(f"{trainer.model}")
    if model_args.use_peft_lora:
        trainer.model.print_trainable_parameters()
        if accelerator_view and getattr(trainer.accelerator.state, "fsdp_plugin", None):
            from peft.utils.other import fsdp_auto_wrap_policy

            fsdp_plugin = trainer.accelerator.state.fsdp_plugin
            fsdp_plugin.auto_wrap_policy = fsdp_auto_wrap_policy(trainer.model)
    checkpoint = None
    if training_args.resume_from_checkpoint is not None:
        checkpoint = training_args.resume_from_checkpoint
    result = trainer.train(resume_from_checkpoint=checkpoint)
    if accelerator_view and trainer.is_fsdp_enabled:
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model()
    return trainer, result


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--make_tiny":
        make_tiny(Path(sys.argv[2]))
        sys.exit(0)
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(os.path.abspath(sys.argv[1]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    main(model_args, data_args, training_args)
