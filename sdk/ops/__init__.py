"""Fused ops with one reference and several backends (see sdk/ops/README.md for the contract).

Each op picks its backend per call from the tensors' device (``shardkit.ops.select_backend``); set
``SHARDKIT_KERNEL_BACKEND=reference|cpp|triton|cuda`` or use ``force_backend`` to force one. Every op registers
an :class:`OpSpec` (``shardkit.ops.registry``) when its module below is imported.
"""

from ._builder import BUILDER, ExtensionUnavailable
from ._dispatch import BACKENDS, available_backends, force_backend, forced_backend, select_backend
from .adamw import adamw_step, adamw_step_reference
from .cross_entropy import cross_entropy, cross_entropy_reference
from .fused_linear_cross_entropy import fused_linear_cross_entropy, linear_cross_entropy_reference
from .geglu import geglu, geglu_reference
from .layer_norm import layer_norm, layer_norm_reference
from .linear_log_probs import linear_log_probs, linear_log_probs_reference
from .registry import OpSpec, get_op, registered_ops
from .rms_norm import rms_norm, rms_norm_reference
from .rope import rope, rope_reference
from .swiglu import swiglu, swiglu_reference

__all__ = [
    "BACKENDS",
    "BUILDER",
    "ExtensionUnavailable",
    "OpSpec",
    "adamw_step",
    "adamw_step_reference",
    "available_backends",
    "cross_entropy",
    "cross_entropy_reference",
    "force_backend",
    "forced_backend",
    "fused_linear_cross_entropy",
    "geglu",
    "geglu_reference",
    "get_op",
    "layer_norm",
    "layer_norm_reference",
    "linear_cross_entropy_reference",
    "linear_log_probs",
    "linear_log_probs_reference",
    "registered_ops",
    "rms_norm",
    "rms_norm_reference",
    "rope",
    "rope_reference",
    "select_backend",
    "swiglu",
    "swiglu_reference",
]
