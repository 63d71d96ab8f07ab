"""shardkit: train and run PyTorch models on one device or many.

    from shardkit import Runner, DDP, BF16
    runner = Runner(strategy=DDP(), precision=BF16())
"""

import importlib
import importlib.util

__version__ = "0.1.0"

__all__ = ["Runner", "Strategy", "SingleDevice", "DDP", "FSDP", "TensorParallel", "Precision", "FP32", "FP16", "BF16",
           "launch", "seed_everything", "Accelerator", "notebook_launcher", "__version__"]

# NOTE: every name loads on first use, so that `import shardkit` (and `shardkit --help`, whose console script
# imports shardkit.cli) does not import torch: 8-12 s on a busy 2-core machine, ~0.05 s without (issue 30).
_LAZY = {
    "launch": "shardkit.distributed", "BF16": "shardkit.precision", "FP16": "shardkit.precision",
    "FP32": "shardkit.precision", "Precision": "shardkit.precision", "Runner": "shardkit.runner",
    "seed_everything": "shardkit.seeding", "DDP": "shardkit.strategies", "SingleDevice": "shardkit.strategies",
    "Strategy": "shardkit.strategies", "FSDP": "shardkit.strategies.fsdp",
    "TensorParallel": "shardkit.strategies.tensor_parallel",
    "Accelerator": "shardkit.accelerate_compat", "notebook_launcher": "shardkit.accelerate_compat",
    "Trainer": "shardkit.trainer", "TrainingArguments": "shardkit.trainer",
    "SFTTrainer": "shardkit.sft", "SFTConfig": "shardkit.sft",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"shardkit.{name}") is not None:
        return importlib.import_module(f"shardkit.{name}")  # a subpackage, as `import shardkit` gave before
    # Registered strategies not named above (the ZeRO family) load on first use too, so that `import shardkit`
    # does not import DeepSpeed; the registry is the one list of them.
    from shardkit.strategies.registry import STRATEGIES

    if name in STRATEGIES.class_names():
        return STRATEGIES.get_class(name)
    raise AttributeError(f"module 'shardkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
