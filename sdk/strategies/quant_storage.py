"""Checks on bitsandbytes 4-bit weights (QLoRA) before a strategy shards them.

A 4-bit weight (``Params4bit``) is packed bytes held in its ``bnb_4bit_quant_storage`` dtype (uint8 by default).
FSDP2 casts every floating parameter to its mixed-precision ``param_dtype`` when it gathers it for compute, and
leaves non-floating ones alone. So packed bytes stored as uint8, or in the very dtype FSDP gathers in, pass
through untouched; packed bytes stored in another floating dtype (float32 under BF16 mixed precision) are
converted value by value, which scrambles them (bitsandbytes then fails with a shape error, or worse, computes
with garbage). Measured on 2 CPU ranks under BF16: uint8 and bfloat16 storage train alike (equal losses), float32
storage crashes in ``dequantize_4bit`` (tests/distributed/test_lora_distributed.py trains the bfloat16 case).

NOTE: FSDP1's flat parameters needed one dtype for the whole unit, hence the seed's rule "quant storage =
compute dtype". FSDP2 shards per parameter, so uint8 works too; the seed's choice remains right and is what
:func:`shardkit.trainer.qlora.qlora_config` picks.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

__all__ = ["check_quant_storage", "quantized_parameters"]


def quantized_parameters(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of every bitsandbytes 4-bit weight in ``module`` (none when bitsandbytes is not loaded)."""
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return []
    kind = bnb.nn.Params4bit
    return [(n, p) for n, p in module.named_parameters() if isinstance(p, kind)]


def check_quant_storage(module: nn.Module, gather_dtype: torch.dtype | None, owner: str = "FSDP") -> None:
    """Refuse 4-bit weights whose storage dtype ``owner`` would cast when gathering in ``gather_dtype``.

    Args:
        module: the model about to be sharded.
        gather_dtype: the dtype floating parameters are gathered in (FSDP2's ``param_dtype``); None: no cast.
        owner: the strategy's name, for the message.

    Raises:
        ValueError: naming the weight, its storage dtype, the gather dtype and the fix.
    """
    if gather_dtype is None:
        return
    for name, p in quantized_parameters(module):
        if p.dtype.is_floating_point and p.dtype != gather_dtype:
            raise ValueError(
                f"{owner}: 4-bit weight {name} is stored as {p.dtype} (bnb_4bit_quant_storage), but the precision "
                f"gathers parameters as {gather_dtype} for compute: the cast would scramble the packed 4-bit data. "
                f"Load the model with BitsAndBytesConfig(bnb_4bit_quant_storage={gather_dtype}) (what "
                f"shardkit.trainer.qlora.qlora_config(compute_dtype={gather_dtype}) gives) or torch.uint8")
