"""Optimizers: FusedAdamW and the by-name registry used by the Trainer."""

from .adalomo import AdaLomo
from .adamw import FusedAdamW, adamw_step_reference
from .layerwise import LayerwiseOptimizer  # registers galore_*_layerwise
from .lomo import is_fused_backward  # registers lomo, adalomo
from .named import GaLoreTargetError, MissingOptimizerPackage, OptimizerUnsupportedError
from .registry import available_optimizers, create_optimizer, register_optimizer

__all__ = ["FusedAdamW", "adamw_step_reference", "available_optimizers", "create_optimizer", "register_optimizer",
           "GaLoreTargetError", "MissingOptimizerPackage", "OptimizerUnsupportedError", "AdaLomo", "LayerwiseOptimizer",
           "is_fused_backward"]
