"""Modules over the fused ops (shardkit.ops): drop-in replacements for Hugging Face Llama-family layers."""

from shardkit.strategies.activation_checkpointing import ActivationCheckpointing

from .log_probs import causal_lm_log_probs, head_log_probs
from .loss import FusedLinearCrossEntropyLoss
from .patching import apply_fused_kernels
from .rms_norm import RMSNorm
from .rotary import RotaryEmbedding
from .swiglu import GeGLUMLP, SwiGLUMLP

# One line per module: a new module appends its import above and its name here.
__all__ = [
    "ActivationCheckpointing",
    "FusedLinearCrossEntropyLoss",
    "GeGLUMLP",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLUMLP",
    "apply_fused_kernels",
    "causal_lm_log_probs",
    "head_log_probs",
]
