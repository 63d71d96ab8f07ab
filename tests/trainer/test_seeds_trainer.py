"""The Trainer page's snippets and the FSDP page's SFT flags, as written, on a tiny local model (issue 23 items
3 and 6): only the imports change; names transformers 5 removed fail naming what replaced them."""

import dataclasses
import logging

import pytest
import torch
from trainer_tiny import Tokens, tiny_llama

from shardkit.trainer import HfArgumentParser, Trainer, TrainerCallback, TrainingArguments


def _changed(model, before):
    return {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}


@pytest.mark.parametrize("optim,extra", [
    ("galore_adamw", {}), ("galore_adamw", {"optim_args": "rank=64, update_proj_gap=100, scale=0.10"}),
    ("galore_adamw_layerwise", {}),
])
def test_galore_seed(tmp_path, optim, extra):
    args = TrainingArguments(output_dir=str(tmp_path / "test-galore"), max_steps=2, per_device_train_batch_size=2,
                             optim=optim, optim_target_modules=[r".*.attn.*", r".*.mlp.*"], **extra)
    model = tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    Trainer(model=model, args=args, train_dataset=Tokens(8)).train()
    changed = _changed(model, before)
    assert any(".self_attn." in n for n in changed) and any(".mlp." in n for n in changed)


def test_lomo_seed(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path / "test-lomo"), max_steps=2, per_device_train_batch_size=4,
                             optim="adalomo", gradient_checkpointing=True, logging_strategy="steps", logging_steps=1,
                             learning_rate=2e-6, save_strategy="no", run_name="lomo-imdb")
    model = tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(8))
    trainer.train()
    assert _changed(model, before) and len([h for h in trainer.state.log_history if "loss" in h]) == 2


def test_neftune_and_optimizer_cls_and_kwargs_seeds(tmp_path):
    training_args = TrainingArguments(output_dir=str(tmp_path / "nef"), max_steps=1, neftune_noise_alpha=0.1)
    trainer = Trainer(model=tiny_llama(), args=training_args, train_dataset=Tokens(8))
    trainer.train()
    assert not trainer.model.get_input_embeddings()._forward_hooks  # the noise hook is gone after training
    optimizer_cls = torch.optim.AdamW
    optimizer_kwargs = {"lr": 4e-3, "betas": (0.9, 0.999), "weight_decay": 0.05}
    trainer = Trainer(model=tiny_llama(), args=TrainingArguments(output_dir=str(tmp_path / "o"), max_steps=1),
                      train_dataset=Tokens(8), optimizer_cls_and_kwargs=(optimizer_cls, optimizer_kwargs))
    trainer.train()
    assert type(trainer.optimizer) is torch.optim.AdamW and trainer.get_learning_rates()[0] == 0.0  # linear decay
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.05, 0.0]


class WeightedClasses(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"input_ids": torch.arange(i, i + 6) % 64, "labels": torch.tensor(i % 3)}


def test_custom_compute_loss_and_dict_returning_callback_seeds(tmp_path):
    from torch import nn
    from transformers import LlamaConfig, LlamaForSequenceClassification

    class CustomTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False):
            labels = inputs.pop("labels")
            # forward pass
            outputs = model(**inputs)
            logits = outputs.get("logits")
            # compute custom loss for 3 labels with different weights
            loss_fct = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0], device=model.device))
            loss = loss_fct(logits.view(-1, self.model.config.num_labels), labels.view(-1))
            return (loss, outputs) if return_outputs else loss

    class EarlyStoppingCallback(TrainerCallback):
        def __init__(self, num_steps=10):
            self.num_steps = num_steps

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= self.num_steps:
                return {"should_training_stop": True}
            else:
                return {}

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=3, pad_token_id=0)
    trainer = CustomTrainer(model=LlamaForSequenceClassification(config),
                            args=TrainingArguments(output_dir=str(tmp_path / "c"), per_device_train_batch_size=2,
                                                   num_train_epochs=3),
                            train_dataset=WeightedClasses(), callbacks=[EarlyStoppingCallback(num_steps=2)])
    trainer.train()
    assert trainer.state.global_step == 2


def test_process_log_level_seed():
    import transformers

    training_args = TrainingArguments(log_level="warning", log_level_replica="error")
    logger = logging.getLogger(__name__)
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    assert log_level == logging.WARNING


@dataclasses.dataclass
class ScriptArguments:
    """What the FSDP page's train.py adds beside TrainingArguments (its own dataclasses, condensed)."""

    model_name_or_path: str = ""
    dataset_name: str = ""
    chat_template_format: str = "none"
    add_special_tokens: bool = False
    append_concat_token: bool = False
    splits: str = "train,test"
    max_seq_len: int = 2048
    packing: bool = False
    use_reentrant: bool = False
    dataset_text_field: str = "text"
    use_flash_attn: bool = False
    use_peft_lora: bool = False
    lora_r: int = 64
    lora_alpha: int = 16
    lora_dropout: float = 0.1
    lora_target_modules: str = ""
    use_4bit_quantization: bool = False


SFT_FLAGS = """--seed 100 --model_name_or_path meta-llama/Llama-2-70b-hf --dataset_name smangrul/ultrachat-10k-chatml
--chat_template_format chatml --add_special_tokens False --append_concat_token False --splits train,test
--max_seq_len 2048 --num_train_epochs 1 --logging_steps 5 --log_level info --logging_strategy steps
--evaluation_strategy epoch --save_strategy epoch --push_to_hub --hub_private_repo True --hub_strategy every_save
--bf16 True --packing True --learning_rate 1e-4 --lr_scheduler_type cosine --weight_decay 1e-4 --warmup_ratio 0.0
--max_grad_norm 1.0 --output_dir llama-sft-lora-fsdp --per_device_train_batch_size 8 --per_device_eval_batch_size 8
--gradient_accumulation_steps 4 --gradient_checkpointing True --use_reentrant False --dataset_text_field content
--use_flash_attn True --use_peft_lora True --lora_r 8 --lora_alpha 16 --lora_dropout 0.1
--lora_target_modules all-linear --use_4bit_quantization False""".split()


def test_fsdp_page_sft_flags(tmp_path):
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    with pytest.raises(ValueError) as err:  # as written: the two names transformers 5 removed are named
        parser.parse_args_into_dataclasses(SFT_FLAGS)
    assert "--evaluation_strategy: it was renamed eval_strategy" in str(err.value)
    assert "--warmup_ratio: transformers 5 folded it into warmup_steps" in str(err.value)
    flags = [{"--evaluation_strategy": "--eval_strategy", "--warmup_ratio": "--warmup_steps"}.get(f, f)
             for f in SFT_FLAGS]
    flags[flags.index("--output_dir") + 1] = str(tmp_path / "llama-sft-lora-fsdp")
    script, args = parser.parse_args_into_dataclasses(flags)
    assert (args.eval_strategy, args.hub_strategy, args.bf16, args.gradient_checkpointing) == ("epoch", "every_save",
                                                                                                True, True)
    Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(8), eval_dataset=Tokens(4))  # uploads: test_hub_saves
    args.push_to_hub = False  # nothing may reach the Hub here
    args.per_device_train_batch_size = args.per_device_eval_batch_size = 2
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(8), eval_dataset=Tokens(4))
    trainer.accelerator.print(f"{type(trainer.model).__name__}")
    assert getattr(trainer.accelerator.state, "fsdp_plugin", None) is None and not trainer.is_fsdp_enabled
    trainer.train(resume_from_checkpoint=None)
    trainer.save_model()
    assert (tmp_path / "llama-sft-lora-fsdp" / "model.safetensors").is_file()
    assert [h["epoch"] for h in trainer.state.log_history if "eval_loss" in h] == [1.0]
