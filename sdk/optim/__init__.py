"""Optimizers: FusedAdamW and the by-name registry used by the Trainer."""

from .adamw import FusedAdamW, adamw_step_reference
from .named import GaLoreTargetError, MissingOptimizerPackage, OptimizerUnsupportedError
from .registry import available_optimizers, create_optimizer, register_optimizer

__all__ = ["FusedAdamW", "adamw_step_reference", "available_optimizers", "create_optimizer", "register_optimizer",
           "GaLoreTargetError", "MissingOptimizerPackage", "OptimizerUnsupportedError"]
