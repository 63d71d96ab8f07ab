"""A DeepSpeed config's ``activation_checkpointing`` section handed to ``deepspeed.checkpointing``.

shardkit checkpoints blocks itself (:mod:`shardkit.strategies.activation_checkpointing`), under every
strategy. A model that calls ``deepspeed.checkpointing.checkpoint`` in its own forward reads DeepSpeed's
module-level settings instead; this configures them from the section, once the strategy's process group
exists (``ProcessGroupStrategy.configure_activation_checkpointing``). Importing this module does not
import DeepSpeed, and nothing here imports it for a model that did not.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from shardkit.strategies.activation_checkpointing import ActivationCheckpointing

__all__ = ["configure_deepspeed_checkpointing"]

logger = logging.getLogger("shardkit.strategies.zero")


def configure_deepspeed_checkpointing(settings: ActivationCheckpointing | None) -> bool:
    """Hand a DeepSpeed config's ``activation_checkpointing`` section to ``deepspeed.checkpointing``, for models
    that call ``deepspeed.checkpointing.checkpoint`` themselves; True when it was configured.

    Only where DeepSpeed is already imported (the model or the ZeRO engine imported it: a model that calls
    deepspeed.checkpointing has) and a process group exists (DeepSpeed's comm layer wraps it).
    """
    if settings is None or settings.deepspeed is None or "deepspeed" not in sys.modules:
        return False
    if not dist.is_initialized():
        logger.debug("shardkit: no process group; deepspeed.checkpointing left unconfigured")
        return False
    import deepspeed
    import deepspeed.comm

    if not deepspeed.comm.is_initialized():
        deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False,
                                        dist_init_required=False, verbose=False)
    section = settings.deepspeed
    deepspeed.checkpointing.configure(
        None, partition_activations=bool(section.get("partition_activations", False)),
        contiguous_checkpointing=bool(section.get("contiguous_memory_optimization", False)),
        num_checkpoints=section.get("number_checkpoints"),
        checkpoint_in_cpu=bool(section.get("cpu_checkpointing", False)),
        synchronize=bool(section.get("synchronize_checkpoint_boundary", False)),
        profile=bool(section.get("profile", False)))
    return True
