"""Accelerate's API on shardkit: ``from shardkit import Accelerator`` in place of ``from accelerate import
Accelerator``, and the pieces of ``accelerate`` and ``accelerate.utils`` a training script imports.

    from shardkit import Accelerator
    from shardkit.accelerate_compat import set_seed, DistributedDataParallelKwargs, notebook_launcher

The Accelerator is a thin front on :class:`shardkit.Runner`: what it prepares runs on the Runner's Strategy and
Precision. Where Accelerate's meaning differs from the Runner's (``sync_gradients``), the front follows
Accelerate. What is not supported is refused with the reason and what to do instead.
"""

from shardkit.accelerate_compat.accelerator import Accelerator, set_seed
from shardkit.accelerate_compat.data_loader import BatchSamplerShard, SeedableRandomSampler, prepare_data_loader
from shardkit.accelerate_compat.dummies import DummyOptim, DummyScheduler
from shardkit.accelerate_compat.launch import notebook_launcher
from shardkit.accelerate_compat.operations import (
    DistributedOperationException,
    broadcast,
    gather,
    gather_object,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
    synchronize_rng_states,
)
from shardkit.accelerate_compat.plugins import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProjectConfiguration,
)
from shardkit.accelerate_compat.state import AcceleratorState, DistributedType, GradientState, PartialState
from shardkit.accelerate_compat.wrappers import AcceleratedOptimizer, AcceleratedScheduler, PreparedDataLoader

__all__ = ["AcceleratedOptimizer", "AcceleratedScheduler", "Accelerator", "AcceleratorState", "AutocastKwargs",
           "BatchSamplerShard", "DataLoaderConfiguration", "DistributedDataParallelKwargs",
           "DistributedOperationException", "DistributedType", "DummyOptim", "DummyScheduler", "GradScalerKwargs",
           "GradientAccumulationPlugin", "GradientState", "InitProcessGroupKwargs", "PartialState",
           "PreparedDataLoader", "ProjectConfiguration", "SeedableRandomSampler", "broadcast", "gather",
           "gather_object", "notebook_launcher", "pad_across_processes", "prepare_data_loader", "recursively_apply",
           "reduce", "send_to_device", "set_seed", "synchronize_rng_states"]
