"""Every precision by name, with the spellings Lightning, Accelerate and Hugging Face users type.

    from shardkit.precision.registry import PRECISIONS
    PRECISIONS.build("bf16-mixed")      # BF16()
    PRECISIONS.build("no")              # FP32() (Accelerate's mixed_precision: no)
    PRECISIONS.build_from_cli("fp16", ["initial_scale_power=12"])

A new precision is one ``PRECISIONS.register(...)`` line here.
"""

from __future__ import annotations

import argparse

from shardkit.utils.registry import Registry

__all__ = ["PRECISIONS", "add_precision_argument"]

PRECISIONS = Registry("precision")

_P = "shardkit.precision"
PRECISIONS.register("fp32", f"{_P}.fp32:FP32", aliases=("32", "32-true", "no", "float32"),
                    description="fp32 parameters and compute (TF32 off)")
PRECISIONS.register("tf32", f"{_P}.fp32:FP32", defaults={"tf32": True},
                    description="fp32 parameters, CUDA matmuls and convolutions in TF32")
PRECISIONS.register("fp16", f"{_P}.fp16:FP16", aliases=("16", "16-mixed", "fp16-mixed", "float16"),
                    description="fp32 master weights, fp16 compute with dynamic loss scaling")
PRECISIONS.register("bf16", f"{_P}.bf16:BF16", aliases=("bf16-mixed", "bfloat16"),
                    description="fp32 master weights, bf16 compute (mixed)")
PRECISIONS.register("fp8", f"{_P}.fp8:FP8", aliases=("fp8-mixed", "float8"),
                    description="bf16 mixed, float8 linear matmuls (torchao, dynamic scaling; sm_89 and newer)")
PRECISIONS.register("bf16-true", f"{_P}.bf16:BF16", defaults={"mode": "true"},
                    description="bf16 parameters and compute (gradients reduced in fp32)")


def add_precision_argument(parser: argparse.ArgumentParser, default: str = "fp32") -> None:
    """Add ``--precision`` (choices: the registry's names; aliases such as "bf16-mixed" or "no" accepted)."""
    parser.add_argument("--precision", default=default, type=PRECISIONS.argparse_type(), choices=PRECISIONS.names(),
                        help=f"default {default}; aliases: {', '.join(PRECISIONS.aliases())}")
