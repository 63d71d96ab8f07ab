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

__all__ = ["check_quant_storage", "keep_4bit_layers_trainable", "quantized_parameters"]


def quantized_parameters(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of every bitsandbytes 4-bit weight in ``module`` (none when bitsandbytes is not loaded)."""
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return []
    kind = bnb.nn.Params4bit
    return [(n, p) for n, p in module.named_parameters() if isinstance(p, kind)]


def keep_4bit_layers_trainable(module: nn.Module) -> int:
    """Keep every bitsandbytes ``Linear4bit`` in ``module`` in the layout its training path reads.

    On a CPU with AVX512-BF16, bitsandbytes (0.50) repacks a 4-bit weight in place on its first forward in eval mode
    without gradients (``packing_format_for_cpu``), and reverts it only on a save or a move to another device. From
    then on every forward, in training too, goes through ``gemv_4bit``, which has no autograd kernel: no gradient
    flows back through the frozen 4-bit layers to the adapters below them, so after the first evaluation the run
    silently learns less (grad_norm roughly halves). Under FSDP it is worse: the flag lives on the shared quant
    state while the weight is gathered again in the original layout, and is then read as the packed one.

    So a model handed to a strategy never takes that inference-only path (the regular kernels compute the same
    values), and a weight already repacked (an evaluation before setup) is put back. Returns how many layers were
    touched.
    """
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return 0
    count = 0
    for layer in module.modules():
        if not isinstance(layer, bnb.nn.Linear4bit):
            continue
        layer.support_avx512bf16_for_cpu = False
        weight = layer.weight
        state = getattr(weight, "quant_state", None)
        if state is not None and getattr(state, "packing_format_for_cpu", False):
            # the same inverse bitsandbytes itself applies before a save or a move to a GPU
            weight.data, weight.quant_state = bnb.functional._convert_weight_packed_for_cpu_inverse(weight.data, state)
        count += 1
    return count


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
