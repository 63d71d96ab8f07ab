"""ZeRO stage 3 and ZeRO-Infinity: every parameter partitioned across ranks, gathered as it is used.

    from shardkit.strategies.zero import ZeRO3, ZeROInfinity
    runner = Runner(strategy=ZeRO3(offload="cpu"), precision=BF16())

What partitioned parameters change is written here, as overrides of :class:`ZeROStrategy`: modules are
built already partitioned (``module_init_context``), ``gathered_parameters`` gathers, a model set up
without an optimizer stays partitioned, and checkpoints and memory counts follow the
:class:`~shardkit.strategies.zero.layout.ParameterPartitionLayout`. ``ZERO3_PARAMETERS`` lets code that
reads a weight outside its module's forward (the fused loss) gather it without naming DeepSpeed
(:mod:`shardkit.utils.partitioned`). Importing this module does not import DeepSpeed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from typing_extensions import override

from shardkit.strategies.base import param_list
from shardkit.strategies.zero.config import ZeROSettings
from shardkit.strategies.zero.init import ZeroInitInterceptor
from shardkit.strategies.zero.layout import ParameterPartitionLayout, ZeROLayout, param_shape
from shardkit.strategies.zero.leaf import mark_leaf_modules
from shardkit.strategies.zero.strategy import ZeROStrategy, prepare_deepspeed
from shardkit.strategies.zero.transformers_link import TransformersLink

__all__ = ["ZeRO3", "ZeROInfinity", "ZERO3_PARAMETERS", "is_zero3_partitioned"]


class ZeRO3(ZeROStrategy):
    """ZeRO stage 3: parameters, gradients and optimizer state all partitioned; parameters are
    gathered layer by layer for forward and backward.

    Args:
        offload: shorthand for both ``offload_optimizer`` and ``offload_params``: None, "cpu" or "nvme".
        offload_optimizer: None, "cpu" or "nvme" for the fp32 master weights and optimizer state
            (overrides ``offload``).
        offload_params: None, "cpu" or "nvme" for the partitioned parameters (overrides ``offload``).
        nvme_path: directory for NVMe offload (must be writable; needs libaio). None: $SHARDKIT_NVME_PATH,
            else a new per-job directory under the system temp dir, removed at teardown (logged once).
        prefetch_bucket_size: elements prefetched ahead of use; "auto" = 0.9·hidden².
        param_persistence_threshold: parameters with fewer elements stay whole on every rank;
            "auto" = 10·hidden.
        max_live_parameters: most elements gathered at once (1e9).
        max_reuse_distance: keep a gathered parameter if it is used again within this many elements (1e9).
        gather_16bit_weights_on_model_save: DeepSpeed's consolidated 16-bit save flag (kept for
            configs; shardkit's checkpoints never need it).
        leaf_modules: module classes (or class names, plain or qualified; a comma-separated string from the
            command line) that ZeRO-3 gathers whole, as DeepSpeed leaf modules, besides the mixture-of-experts
            blocks it finds by itself (:mod:`shardkit.strategies.zero.leaf`). A name matching no module fails.
        pin_memory, reduce_bucket_size, allgather_bucket_size, overlap_comm, contiguous_gradients,
        timeout, extra: see ZeRO1/ZeRO2.
    """

    @property
    @override
    def partitions_parameters(self) -> bool:
        return True

    def __init__(self, offload: str | None = None, offload_optimizer: str | None = None,
                 offload_params: str | None = None, nvme_path: str | None = None,
                 prefetch_bucket_size: int | str = "auto", param_persistence_threshold: int | str = "auto",
                 max_live_parameters: int = 1_000_000_000, max_reuse_distance: int = 1_000_000_000,
                 gather_16bit_weights_on_model_save: bool = False, reduce_bucket_size: int | str = "auto",
                 allgather_bucket_size: int = 500_000_000, overlap_comm: bool | None = None,
                 contiguous_gradients: bool = True, pin_memory: bool | None = None, timeout: float | None = None,
                 extra: dict[str, Any] | None = None, leaf_modules: Sequence[type | str] | str = (),
                 **infinity: Any):
        super().__init__(ZeROSettings(
            3, reduce_bucket_size, allgather_bucket_size, overlap_comm, contiguous_gradients,
            offload_optimizer=offload_optimizer if offload_optimizer is not None else offload,
            offload_params=offload_params if offload_params is not None else offload, nvme_path=nvme_path,
            pin_memory=pin_memory, prefetch_bucket_size=prefetch_bucket_size,
            param_persistence_threshold=param_persistence_threshold, max_live_parameters=max_live_parameters,
            max_reuse_distance=max_reuse_distance,
            gather_16bit_weights_on_model_save=gather_16bit_weights_on_model_save, timeout=timeout,
            extra=dict(extra or {}), **infinity,
        ))
        self._transformers = TransformersLink()
        if isinstance(leaf_modules, str):
            leaf_modules = [n.strip() for n in leaf_modules.split(",") if n.strip()]
        self.leaf_modules: list[type | str] = list(leaf_modules)

    @override
    def setup_environment(self) -> None:
        """Bring up the process group and tell transformers that ZeRO-3 runs (as Accelerate does).

        From here on Hugging Face's ``generate`` syncs the ranks by itself and ``from_pretrained`` builds and
        loads the model partitioned (see :mod:`shardkit.strategies.zero.transformers_link`).
        """
        super().setup_environment()
        self._connect_deepspeed_comm()
        self._transformers.register(self.deepspeed_config())

    @override
    def setup(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any | None):
        # Before the engine: its hooks read the leaf flag when they are registered. An MoE block's experts run only
        # where tokens were routed, which differs by rank; gathered per submodule, that desynchronises the gathers.
        prepare_deepspeed(self.settings)
        mark_leaf_modules(module, self.leaf_modules, announce=self.is_global_zero)
        result = super().setup(module, optimizer, scheduler)
        self._transformers.register(self.deepspeed_config(module))  # the config the engine runs, buckets sized
        return result

    @override
    def teardown(self) -> None:
        self._transformers.release()
        super().teardown()

    def _connect_deepspeed_comm(self) -> None:
        prepare_deepspeed(self.settings)
        import deepspeed

        # NOTE: zero.Init (ours, or transformers' inside from_pretrained) sizes its partitions from DeepSpeed's own
        # comm layer, which wraps our process group only once told to; without it every rank would see world_size 1.
        deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False,
                                        dist_init_required=False, verbose=False)
        # NOTE: torch._dynamo imported for the first time inside zero.Init fails (DeepSpeed patches the tensor
        # constructors dynamo's polyfills check), and building a Hugging Face model imports it: import it first.
        import torch._dynamo  # noqa: F401

    @override
    def _make_layout(self, stage: int) -> ZeROLayout:
        return ParameterPartitionLayout(stage)

    @override
    def parameter_numel(self, param: torch.Tensor) -> int:
        """A partitioned parameter is an empty placeholder (``numel() == 0``); DeepSpeed records its full size."""
        return int(getattr(param, "ds_numel", param.numel()))

    @override
    def parameter_shape(self, param: torch.Tensor) -> tuple[int, ...]:
        return param_shape(param)

    @override
    def module_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """Build modules inside ``deepspeed.zero.Init``: each parameter is partitioned as soon as it exists.

        The model's own init that runs after its submodules are built is run on the whole parameter, so
        the weights equal an unsharded build's from the same seed.
        """
        self._connect_deepspeed_comm()
        import deepspeed

        stack = contextlib.ExitStack()
        stack.enter_context(self.precision.module_init_context())
        stack.enter_context(deepspeed.zero.Init(config_dict_or_path=self.deepspeed_config(), mpu=None))
        # zero.Init partitions each submodule as soon as it is built; the model's own init that runs later
        # (Llama.reset_parameters, Hugging Face's post_init) is run on the gathered parameter instead of
        # the empty partition, so the weights equal an unsharded build's from the same seed.
        stack.enter_context(ZeroInitInterceptor())
        return stack

    @override
    def _inference_config(self, config: dict[str, Any]) -> dict[str, Any]:
        # Stage 3 runs DeepSpeed's parameter offload/partitioning alone (DeepSpeedZeRoOffload, reached as
        # engine.optimizer): the parameters stay partitioned, with no gradients or optimizer state.
        return config

    @override
    def generation_context(self, module: nn.Module,
                           keep_unsharded: bool | None = None) -> contextlib.AbstractContextManager[str | None]:
        """Every partitioned parameter gathered once for the call and held across its decoding steps when the extra
        bytes fit in half the free memory on every rank, or as ``keep_unsharded`` says, with the engine's module hooks
        detached meanwhile and put back as they were; otherwise the engine's hooks gather each layer's in every
        forward. Per layer always under NVMe parameter offload (ZeROInfinity's
        default), where partitions are swapped in a few buffers at a time; CPU parameter offload is held whole
        when it fits. See :mod:`shardkit.strategies.zero.generation`."""
        from shardkit.strategies.zero.generation import per_layer, per_layer_reason, zero3_gathered

        zero = self.deepspeed_config().get("zero_optimization", {})
        reason = per_layer_reason(self.settings.offload_params,
                                  int(zero.get("stage3_module_granularity_threshold", 0) or 0))
        if reason is not None:
            return per_layer(reason, keep_unsharded)
        return zero3_gathered(module, self.root_device, keep_unsharded, self._any_rank, hooks=self._module_hooks())

    def _module_hooks(self) -> list:
        """The handles of the engine's per-module hooks (DeepSpeed's parameter offload object keeps them: the ZeRO-3
        optimizer's ``parameter_offload``, or the offload object itself as the optimizer of an engine without one)."""
        optimizer = getattr(self._engine, "optimizer", None)
        offload = getattr(optimizer, "parameter_offload", optimizer)
        if offload is None or not hasattr(offload, "forward_hooks"):
            return []
        root = getattr(offload, "fwd_pre_hook", None)
        return [*offload.forward_hooks, *getattr(offload, "backward_hooks", []), *([root] if root is not None else [])]

    def _any_rank(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], device=self.root_device)
        return bool(self.all_reduce(t, "max").item())

    @override
    def gathered_parameters(self, params: Any, modifier_rank: int | None = None,
                            module: nn.Module | None = None) -> contextlib.AbstractContextManager:
        """Context that yields ``params`` whole on every rank (a list; the partitions are gathered in place).

        With ``modifier_rank=r``, changes rank r makes inside the block are kept (broadcast and
        re-partitioned on exit). NOTE: once the optimizer is set up, DeepSpeed's fp32 master weights
        overwrite such changes at the next step; change weights before ``setup`` or load a checkpoint.
        """
        return _gathered(param_list(params), modifier_rank)


class ZeROInfinity(ZeRO3):
    """ZeRO-3 with parameters and optimizer state on NVMe (DeepSpeed's async_io op; needs libaio).

    Args:
        nvme_path: directory for the swap files (must be writable); None: as in ZeRO3.
        offload_params: "nvme" (default), "cpu" or None.
        offload_optimizer: "nvme" (default), "cpu" or None.
        aio: DeepSpeed's async I/O settings: block_size (1 MiB), queue_depth (8), intra_op_parallelism (1
            I/O thread; the older name thread_count is read as it), single_submit (False), overlap_events (True).
        buffer_count: swap buffers (5; parameter offload uses at least 5).
        buffer_size: elements per parameter swap buffer (1e8); must hold the largest parameter.
        **kwargs: any ZeRO3 argument.
    """

    def __init__(self, nvme_path: str | None = None, offload_params: str | None = "nvme",
                 offload_optimizer: str | None = "nvme", aio: dict[str, Any] | None = None, buffer_count: int = 5,
                 buffer_size: int = 100_000_000,
                 **kwargs: Any):
        super().__init__(offload_optimizer=offload_optimizer, offload_params=offload_params, nvme_path=nvme_path,
                         aio=dict(aio or {}), buffer_count=buffer_count, buffer_size=buffer_size, **kwargs)


# ---- helpers ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _gathered(params: list[torch.Tensor], modifier_rank: int | None) -> Iterator[list[torch.Tensor]]:
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank):
        yield params


def is_zero3_partitioned(param: Tensor | None) -> bool:
    """Whether ``param`` is a DeepSpeed ZeRO-3 parameter that is partitioned right now (not gathered).

    ZeRO-3 tags its parameters with ``ds_id`` and ``ds_status`` (``AVAILABLE`` while gathered).
    """
    if param is None or not (hasattr(param, "ds_id") or hasattr(param, "ds_status")):
        return False
    return getattr(getattr(param, "ds_status", None), "name", "NOT_AVAILABLE") != "AVAILABLE"


class _ZeRO3Parameters:
    """ZeRO-3 parameters for :mod:`shardkit.utils.partitioned` (the fused loss's reads, loads into a partitioned model).

    Only parameters still partitioned when read are gathered. NOTE: inside a DeepSpeed engine's forward,
    reading a partitioned parameter from another module already gathers it and registers it as an
    "external parameter" of the module in forward (DeepSpeed's ZeROOrderedDict), which the engine then
    fetches and releases itself from the next step on; gathering it again would make GatheredParameters'
    exit free a parameter that module still holds ("Cannot free a ZeRO-3 parameter while it is still
    active"). So parameters already AVAILABLE are left to the engine.
    """

    def owns(self, param: Tensor) -> bool:
        return hasattr(param, "ds_tensor")

    def is_partitioned(self, param: Tensor) -> bool:
        return is_zero3_partitioned(param)

    def gathered_for_read(self, params: list[Tensor]) -> contextlib.AbstractContextManager:
        import deepspeed  # only reached for ZeRO-3 parameters, where deepspeed is necessarily installed

        # modifier_rank=None: nobody modifies the weight, so nothing is broadcast back on exit.
        return deepspeed.zero.GatheredParameters(params[0] if len(params) == 1 else params, modifier_rank=None)

    def gathered_for_write(self, params: list[Tensor]) -> contextlib.AbstractContextManager:
        import deepspeed

        # modifier_rank=0: rank 0's values are broadcast and partitioned again on exit.
        return deepspeed.zero.GatheredParameters(params, modifier_rank=0)

    def full_shape(self, param: Tensor) -> tuple[int, ...]:
        return tuple(getattr(param, "ds_shape", param.shape))

    def own_slice(self, param: Tensor) -> tuple[int, Tensor] | None:
        # DeepSpeed's layout: the flattened parameter, padded to a multiple of the partition group's size, is cut
        # into equal runs in rank order, and ds_tensor holds this rank's run. A parameter kept whole (ds_persist),
        # gathered now (its data is not the empty placeholder) or swapped out (an empty ds_tensor) has none here.
        local = getattr(param, "ds_tensor", None)
        if local is None or getattr(param, "ds_persist", False) or param.data.numel() != 0 or local.numel() == 0:
            return None
        start = dist.get_rank(group=param.ds_process_group) * local.numel()
        return start, local.view(-1)[: max(0, min(param.ds_numel, start + local.numel()) - start)]


ZERO3_PARAMETERS = _ZeRO3Parameters()
