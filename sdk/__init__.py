"""shardkit: train and run PyTorch models on one device or many.

    from shardkit import Runner, DDP, BF16
    runner = Runner(strategy=DDP(), precision=BF16())
"""

from shardkit.utils.lazy import install_moved_modules, lazy_exports

__version__ = "0.1.0"

__all__ = ["Runner", "Strategy", "SingleDevice", "DDP", "FSDP", "TensorParallel", "Precision", "FP32", "FP16", "BF16",
           "launch", "seed_everything", "Accelerator", "notebook_launcher", "__version__"]


def _registered_strategy(name: str) -> type:
    """Registered strategies not named below (the ZeRO family), loaded on first use too, so that `import shardkit`
    does not import DeepSpeed; the registry is the one list of them."""
    from shardkit.strategies.registry import exported_strategy_class

    found = exported_strategy_class(name)
    if found is not None:
        return found
    raise AttributeError(f"module 'shardkit' has no attribute {name!r}")


# NOTE: every name loads on first use, so that `import shardkit` (and `shardkit --help`, whose console script
# imports shardkit.cli) does not import torch: 8-12 s on a busy 2-core machine, ~0.05 s without. Any other
# subpackage loads on first use too (`shardkit.checkpoint`), as `import shardkit` gave before.
__getattr__, __dir__ = lazy_exports(__name__, {
    "launch": "distributed", "BF16": "precision", "FP16": "precision", "FP32": "precision", "Precision": "precision",
    "Runner": "runner", "seed_everything": "utils.seeding", "DDP": "strategies", "SingleDevice": "strategies",
    "Strategy": "strategies", "FSDP": "strategies.fsdp", "TensorParallel": "strategies.tensor_parallel",
    "Accelerator": "accelerate_compat", "notebook_launcher": "accelerate_compat", "Trainer": "trainer",
    "TrainingArguments": "trainer", "SFTTrainer": "sft", "SFTConfig": "sft",
    "DPOTrainer": "preference", "DPOConfig": "preference",
    "KTOTrainer": "preference", "KTOConfig": "preference", "ORPOTrainer": "preference", "ORPOConfig": "preference",
    "CPOTrainer": "preference", "CPOConfig": "preference",
    "GRPOTrainer": "rl", "GRPOConfig": "rl", "RLOOTrainer": "rl", "RLOOConfig": "rl",
}, fallback=_registered_strategy)
install_moved_modules()
