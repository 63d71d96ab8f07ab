"""ZeRO-3's sharded construction that gives, bitwise, the weights an unsharded build gives.

Under ``deepspeed.zero.Init`` each submodule's parameters are partitioned as soon as they exist, so a
model's own init that runs later (``Llama.reset_parameters``, Hugging Face's ``post_init``) would write
into empty partitions and draw no random numbers. :class:`ZeroInitInterceptor` runs each such write on
the whole parameter inside ``GatheredParameters(modifier_rank=0)``, one parameter at a time, on every
rank. The tracking of writes through ``.data`` and views is shared with FSDP's meta-device recorder
(:class:`shardkit.strategies._sharded_init.TrackingMode`). Importing this module does not import DeepSpeed.
"""

from __future__ import annotations

import torch
from typing_extensions import override

from shardkit.strategies._sharded_init import TrackingMode, apply_chain

__all__ = ["ZeroInitInterceptor"]


class ZeroInitInterceptor(TrackingMode):
    """Under ``zero.Init``: writes to partitioned parameters run on the gathered parameter (rank 0's kept)."""

    @override
    def is_tracked(self, t: torch.Tensor) -> bool:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        return hasattr(t, "ds_id") and getattr(t, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE

    @override
    def full_shape(self, param: torch.Tensor) -> torch.Size:
        return getattr(param, "ds_shape", param.shape)

    @override
    def _stand_in_view(self, param, chain, func, args, kwargs) -> torch.Tensor | None:
        whole = torch.empty(self.full_shape(param), dtype=param.dtype, device="meta")
        try:
            return func(apply_chain(whole, chain), *args[1:], **kwargs)
        except (IndexError, RuntimeError):
            return None

    @override
    def _write(self, param, chain, func, rest, kwargs) -> None:
        import deepspeed

        # NOTE: every rank runs the write (so every rank's RNG advances as in an unsharded build);
        # rank 0's result is what is kept, as zero.Init keeps rank 0's constructor init.
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            func(apply_chain(param, chain), *rest, **kwargs)
