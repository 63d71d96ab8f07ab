"""shardkit: train and run PyTorch models on one device or many.

    from shardkit import Runner, DDP, BF16
    runner = Runner(strategy=DDP(), precision=BF16())
"""

from shardkit.distributed import launch
from shardkit.precision import BF16, FP16, FP32, Precision
from shardkit.runner import Runner
from shardkit.seeding import seed_everything
from shardkit.strategies import DDP, SingleDevice, Strategy
from shardkit.strategies.fsdp import FSDP
from shardkit.strategies.tensor_parallel import TensorParallel

__version__ = "0.1.0"

__all__ = ["Runner", "Strategy", "SingleDevice", "DDP", "FSDP", "TensorParallel", "Precision", "FP32", "FP16", "BF16",
           "launch", "seed_everything", "Accelerator", "notebook_launcher", "__version__"]


def __getattr__(name: str):
    # Registered strategies not imported above (the ZeRO family) load on first use, so that `import shardkit`
    # does not import DeepSpeed; the registry is the one list of them.
    from shardkit.strategies.registry import STRATEGIES

    if name in STRATEGIES.class_names():
        return STRATEGIES.get_class(name)
    if name in ("Accelerator", "notebook_launcher"):  # Accelerate's API, a front on the Runner
        from shardkit import accelerate_compat

        return getattr(accelerate_compat, name)
    if name in ("Trainer", "TrainingArguments"):  # lazily too: the Trainer pulls in more than a Runner needs
        from shardkit import trainer

        return getattr(trainer, name)
    if name in ("SFTTrainer", "SFTConfig"):
        from shardkit import sft

        return getattr(sft, name)
    raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
