"""SFTTrainer: supervised fine-tuning on shardkit's Trainer, with TRL's API.

    trainer = SFTTrainer(model, args=SFTConfig(output_dir="out", packing=True, max_length=2048),
                         train_dataset=chat_data, processing_class=tokenizer, peft_config=LoraConfig(...))
    trainer.train()

The FSDP seed's older spelling runs as written too: a ``TrainingArguments`` as ``args`` and the SFT settings as
keywords (``tokenizer=``, ``packing=``, ``dataset_text_field=``, ``max_seq_length=``, ``dataset_kwargs=``).

What it adds to the Trainer: the data (tokenized, chat-templated, masked, packed; see :mod:`shardkit.sft.dataset`),
the collator (padded or padding-free), LoRA/QLoRA from ``peft_config``, and packed attention for Hugging Face models
(``sdpa``/``eager`` switched to :mod:`shardkit.sft.hf_attention`'s varlen path). The loss is the Trainer's: the
token-weighted cross-entropy of the whole optimizer step, its label count summed over micro-batches and ranks.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.utils.data import DataLoader
from typing_extensions import override

from shardkit.data.streaming import ChunkedStream
from shardkit.sft.collator import DataCollatorForLanguageModeling
from shardkit.sft.config import SFTConfig
from shardkit.sft.dataset import SFTTokenizer, prepare_dataset
from shardkit.trainer.arguments import TrainingArguments
from shardkit.trainer.peft_support import base_model_of, is_peft_model
from shardkit.trainer.trainer import Trainer

__all__ = ["SFTTrainer"]

logger = logging.getLogger("shardkit.sft")


class SFTTrainer(Trainer):
    """Supervised fine-tuning (TRL's ``SFTTrainer``) on shardkit's Trainer.

    Args:
        model: a torch module, a Hugging Face model, or a local path/name for ``AutoModelForCausalLM``.
        args: an :class:`SFTConfig` (or a TrainingArguments, completed from ``**sft_kwargs``).
        data_collator: default :class:`DataCollatorForLanguageModeling` (padded, or padding-free).
        train_dataset, eval_dataset: text, conversations or prompt/completion data, raw or tokenized; a
            ``datasets.Dataset``, a list of dicts, or a stream (``IterableDataset``; train with ``max_steps``).
        processing_class: the tokenizer (``tokenizer=`` is the older name).
        peft_config: a ``peft`` config (e.g. ``LoraConfig``); the model is wrapped with ``get_peft_model``.
        formatting_func: ``f(example) -> str``, the text to train on.
        **sft_kwargs: SFTConfig fields given as keywords (the seed's ``packing=``, ``max_seq_length=`` ...).
        Other arguments: as :class:`shardkit.trainer.Trainer`.
    """

    def __init__(self, model: Any = None, args: TrainingArguments | None = None, data_collator: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 compute_loss_func: Any = None, compute_metrics: Any = None, callbacks: Any = None,
                 optimizers: tuple = (None, None), preprocess_logits_for_metrics: Any = None, peft_config: Any = None,
                 formatting_func: Any = None, *, tokenizer: Any = None, strategy: Any = None, precision: Any = None,
                 **sft_kwargs: Any):
        args = _sft_config(args, sft_kwargs)
        if processing_class is not None and tokenizer is not None and processing_class is not tokenizer:
            raise ValueError("SFTTrainer got both processing_class and tokenizer: pass one (tokenizer= is TRL's "
                             "older name of processing_class)")
        model = _load_model(model, args)
        tokenizer = _prepare_tokenizer(processing_class or tokenizer, model, args)
        model = _apply_peft(model, peft_config, args)
        self._packed_attention = _packed_attention(model, args)
        _check_lengths(model, args)
        tokenize = _tokenizer_for(tokenizer, args, formatting_func)
        train_dataset = _prepare(train_dataset, tokenize, args, args.packing, "train")
        eval_packing = args.packing if args.eval_packing is None else args.eval_packing
        eval_dataset = _prepare(eval_dataset, tokenize, args, eval_packing, "eval")
        if data_collator is None:
            data_collator = _default_collator(model, tokenizer, args)
        # Keywords: the Trainer's positional order follows Hugging Face's, which grows new arguments mid-list.
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=tokenizer, compute_loss_func=compute_loss_func,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics, strategy=strategy,
                         precision=precision)

    @override
    def get_train_dataloader(self) -> DataLoader:
        """A stream is read in order (the Runner deals it to ranks and resumes it); other data as the Trainer's."""
        if isinstance(self.train_dataset, ChunkedStream):
            return DataLoader(self.train_dataset, batch_size=self.args.per_device_train_batch_size,
                              collate_fn=self.data_collator, drop_last=self.args.dataloader_drop_last,
                              num_workers=self.args.dataloader_num_workers)  # the Runner says workers are not used
        return super().get_train_dataloader()


def _sft_config(args: TrainingArguments | None, sft_kwargs: dict[str, Any]) -> SFTConfig:
    if args is None:
        return SFTConfig(**sft_kwargs)
    if isinstance(args, SFTConfig) and not sft_kwargs:
        return args
    return SFTConfig.from_training_arguments(args, **sft_kwargs)


def _load_model(model: Any, args: SFTConfig) -> nn.Module:
    if isinstance(model, str):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"SFTTrainer needs a model (a torch module or a model path), got {type(model).__name__}")
    return model


def _token_id(tokenizer: Any, token: str, field: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == getattr(tokenizer, "unk_token_id", object()) or token not in \
            tokenizer.get_vocab():
        raise ValueError(f"SFTConfig.{field}={token!r} is not a token of the tokenizer's vocabulary; add it "
                         "(tokenizer.add_special_tokens) or pick an existing one")
    return token_id


def _prepare_tokenizer(tokenizer: Any, model: nn.Module, args: SFTConfig) -> Any:
    if tokenizer is None:
        path = getattr(getattr(model, "config", None), "_name_or_path", None)
        if not path:
            raise ValueError("SFTTrainer needs a tokenizer: pass processing_class=tokenizer (nothing is downloaded)")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    if args.chat_template_path is not None:
        from shardkit.sft.chat import set_chat_template

        set_chat_template(tokenizer, args.chat_template_path)
    if args.eos_token is not None:
        _token_id(tokenizer, args.eos_token, "eos_token")
        tokenizer.eos_token = args.eos_token
    if args.pad_token is not None:
        _token_id(tokenizer, args.pad_token, "pad_token")
        tokenizer.pad_token = args.pad_token
    elif tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # as TRL: padding is never trained on (labels -100)
    _check_vocabulary(model, tokenizer)
    return tokenizer


def _check_vocabulary(model: nn.Module, tokenizer: Any) -> None:
    """The model embeds every token id the tokenizer can give (else an index error deep in a forward)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else \
        getattr(model, "embed_tokens", None)
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is not None and len(tokenizer) > rows:
        fix = "model.resize_token_embeddings(len(tokenizer))" if hasattr(model, "resize_token_embeddings") else \
            f"a model with vocab_size >= {len(tokenizer)}"
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model embeds {rows}: use {fix}")


def _is_quantized(model: nn.Module) -> bool:
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def _apply_peft(model: nn.Module, peft_config: Any, args: SFTConfig) -> nn.Module:
    if hasattr(getattr(model, "config", None), "use_cache"):
        model.config.use_cache = False  # training: and HF's sdpa treats packed rows as one sequence with a cache
    if peft_config is None:
        return model
    if is_peft_model(model):
        raise ValueError("SFTTrainer got peft_config for a model that is already a PeftModel: pass the base model, or "
                         "no peft_config")
    import peft

    reentrant = (args.gradient_checkpointing_kwargs or {}).get("use_reentrant", True)
    if _is_quantized(model) and not _sharded_quantization(model):
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.gradient_checkpointing,
                                                     gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    elif args.gradient_checkpointing and reentrant and hasattr(model, "enable_input_require_grads"):
        # Reentrant checkpointing passes gradients only through inputs that need them: the frozen embeddings'
        # output must, or the adapters in the checkpointed blocks get none.
        model.enable_input_require_grads()
    return peft.get_peft_model(model, peft_config)


def _sharded_quantization(model: nn.Module) -> bool:
    """4-bit weights stored in a float dtype are meant to be sharded (FSDP QLoRA): peft's k-bit preparation would
    upcast the rest of the model to float32, which the sharded precision does not expect (TRL skips it too)."""
    from shardkit.trainer.qlora import quantized_parameters

    return any(p.dtype.is_floating_point for _, p in quantized_parameters(model))


def _forward_takes(model: nn.Module, name: str) -> bool:
    params = inspect.signature(type(base_model_of(model)).forward).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _packed_attention(model: nn.Module, args: SFTConfig) -> str | None:
    """How a packed batch's attention stays inside its sequences: None when batches are not packed."""
    packed = args.padding_free or (args.packing and args.packing_strategy == "bfd")
    if not packed:
        return None
    base = base_model_of(model)
    if not _forward_takes(base, "position_ids"):
        raise ValueError(f"packing/padding_free batches carry position_ids, which {type(base).__name__}.forward does "
                         "not take: use a model that does (shardkit's Llama, Hugging Face models), or padding_free="
                         "False and packing=False")
    from shardkit.sft.hf_attention import use_varlen_attention

    if use_varlen_attention(base):
        logger.info("%s: attention switched to shardkit_varlen for packed batches", type(base).__name__)
        return "shardkit_varlen"
    return getattr(getattr(base, "config", None), "_attn_implementation", None) or "model"


def _check_lengths(model: nn.Module, args: SFTConfig) -> None:
    """Rows of ``max_length`` tokens fit the model's positions (shardkit's Llama: ``max_position``)."""
    config = getattr(base_model_of(model), "config", None)
    limit = getattr(config, "max_position", None)
    if limit is not None and args.max_length is not None and args.max_length > limit:
        raise ValueError(f"SFTConfig.max_length={args.max_length} exceeds the model's max_position={limit}: set "
                         f"max_length <= {limit}")


def _tokenizer_for(tokenizer: Any, args: SFTConfig, formatting_func: Any) -> SFTTokenizer:
    truncate = args.max_length if not (args.packing and args.packing_strategy == "wrapped") else None
    return SFTTokenizer(tokenizer, args.dataset_text_field, truncate, args.add_special_tokens,
                        args.append_concat_token, tokenizer.eos_token_id, args.completion_only_loss,
                        args.assistant_only_loss, formatting_func)


def _prepare(dataset: Any, tokenize: SFTTokenizer, args: SFTConfig, packing: bool, name: str) -> Any:
    if dataset is None:
        return None
    if isinstance(dataset, Mapping) and name == "eval":
        return {k: _prepare(v, tokenize, args, packing, name) for k, v in dataset.items()}
    if args.dataset_kwargs.get("skip_prepare_dataset"):
        return dataset
    prepared = prepare_dataset(dataset, tokenize, packing, args.max_length, args.packing_strategy,
                               args.dataset_num_proc, args.packing_buffer_size, name)
    if name == "eval" and isinstance(prepared, ChunkedStream):
        raise ValueError("the eval dataset is streamed: evaluation reads a sized dataset. Take a part of the stream, "
                         "e.g. datasets.Dataset.from_list(list(eval_stream.take(1000)))")
    return prepared


def _default_collator(model: nn.Module, tokenizer: Any, args: SFTConfig) -> DataCollatorForLanguageModeling:
    base = base_model_of(model)
    flash = str(getattr(getattr(base, "config", None), "_attn_implementation", "")).startswith("flash_attention")
    return DataCollatorForLanguageModeling(tokenizer.pad_token_id, padding_free=bool(args.padding_free),
                                           pad_to_multiple_of=args.pad_to_multiple_of,
                                           attention_mask=_forward_takes(base, "attention_mask"),
                                           flash_attn_kwargs=flash and bool(args.padding_free))
