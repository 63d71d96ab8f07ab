"""QLoRA: a bitsandbytes 4-bit base model with LoRA adapters (the FSDP seed's workflow).

    bnb = qlora_config(compute_dtype=torch.bfloat16)           # quant storage = compute dtype, as the seed does
    base = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb, dtype=torch.bfloat16)
    model = get_peft_model(prepare_model_for_kbit_training(base, use_gradient_checkpointing=False),
                           LoraConfig(r=8, target_modules="all-linear"))
    Trainer(model, TrainingArguments(..., bf16=True), train_dataset=data, strategy=FSDP()).train()

The Trainer's LoRA support (adapter-only checkpoints, ``save_model``) applies as to any PeftModel; a 4-bit base
cannot be merged into an HF export here (its weights are not plain tensors): ``merge_adapters=True`` on it is
refused by name. Before sharding, FSDP checks every 4-bit weight's storage dtype against the dtype it gathers in
(:func:`shardkit.strategies.quant_storage.check_quant_storage`): a mismatch would scramble the packed data.

bitsandbytes 0.50.2 quantizes and runs 4-bit layers on the CPU too, so the whole path runs in CI; on a GPU the
same calls use its CUDA kernels.
"""

from __future__ import annotations

from typing import Any

import torch

from shardkit.strategies.quant_storage import check_quant_storage, quantized_parameters

__all__ = ["QUANT_STORAGE_DTYPES", "check_quant_storage", "qlora_config", "quantized_parameters"]

QUANT_STORAGE_DTYPES = (torch.uint8, torch.float16, torch.bfloat16, torch.float32)
QUANT_TYPES = ("nf4", "fp4")


def _require_bitsandbytes() -> None:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ImportError("QLoRA needs the bitsandbytes package: pip install shardkit[qlora]") from err


def qlora_config(compute_dtype: torch.dtype = torch.bfloat16, quant_storage: torch.dtype | None = None,
                 quant_type: str = "nf4", double_quant: bool = True, **kwargs: Any):
    """A ``transformers.BitsAndBytesConfig`` for 4-bit QLoRA, ready for sharding.

    Args:
        compute_dtype: dtype the 4-bit matmuls compute in (``bnb_4bit_compute_dtype``); use the precision's
            compute dtype (bfloat16 under ``BF16()``, float32 under ``FP32()``).
        quant_storage: dtype the packed weights are held in (``bnb_4bit_quant_storage``); default
            ``compute_dtype``, which FSDP gathers without a cast (see the module docstring).
        quant_type: "nf4" (QLoRA's NormalFloat) or "fp4".
        double_quant: quantize the quantization constants too (``bnb_4bit_use_double_quant``).
        **kwargs: other BitsAndBytesConfig fields (e.g. ``llm_int8_skip_modules``).

    Raises:
        ValueError: naming the argument, its value and the accepted ones.
        ImportError: naming the extra to install when bitsandbytes or transformers is missing.
    """
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"qlora_config: quant_type={quant_type!r} is not one of {QUANT_TYPES}")
    if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
        raise ValueError(f"qlora_config: compute_dtype={compute_dtype!r} must be a floating torch dtype, e.g. "
                         "torch.bfloat16")
    storage = compute_dtype if quant_storage is None else quant_storage
    if storage not in QUANT_STORAGE_DTYPES:
        raise ValueError(f"qlora_config: quant_storage={storage!r} is not one of {QUANT_STORAGE_DTYPES}")
    _require_bitsandbytes()
    try:
        from transformers import BitsAndBytesConfig
    except ImportError as err:
        raise ImportError("QLoRA loads models through transformers: pip install shardkit[qlora]") from err
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_type=quant_type,
                              bnb_4bit_use_double_quant=double_quant, bnb_4bit_quant_storage=storage, **kwargs)
