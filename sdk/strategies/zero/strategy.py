"""The ZeRO strategy on the DeepSpeed engine, configured from shardkit objects, and its stages 1 and 2.

    from shardkit.strategies.zero import ZeRO3
    runner = Runner(strategy=ZeRO3(offload="cpu"), precision=BF16(), gradient_accumulation_steps=4)

The Runner stays the source of truth: its accumulation window decides when gradients are reduced
(``engine.set_gradient_accumulation_boundary``), the loss is averaged over the window as under DDP,
its ``clip_gradients(max_norm)`` sets the clip DeepSpeed applies inside that step, and its scheduler
is stepped by the Runner, not by DeepSpeed. Importing this module does not import DeepSpeed.

:class:`ZeROStrategy` is written for stages 1 and 2 (whole parameters on every rank); what stage 3 does
differently is the overrides of :class:`~shardkit.strategies.zero.stage3.ZeRO3`, and where each stage keeps
its share of the state is its :class:`~shardkit.strategies.zero.layout.ZeROLayout`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import types
import warnings
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from shardkit import checkpoint as ckpt
from shardkit.optim.named import is_schedule_free
from shardkit.strategies.base import param_list, replicated_gathered
from shardkit.strategies.facts import MemoryJob, StateBytes, StrategyFamily
from shardkit.strategies.parallel import ProcessGroupStrategy
from shardkit.strategies.zero import checkpoint as zero_checkpoint
from shardkit.strategies.zero.config import (
    NVME_PATH_ENV_VAR,
    ZeROSettings,
    ZeROSettingsError,
    default_nvme_path,
    model_hidden_size,
    precision_section,
    require_deepspeed,
)
from shardkit.strategies.zero.groups import forget_process_groups, forget_stale_process_groups
from shardkit.strategies.zero.layout import FlatPartitionLayout, ZeROLayout

__all__ = ["ZeROStrategy", "ZeRO1", "ZeRO2", "ZeROSettingsError", "build_deepspeed_op", "choose_deepspeed_accelerator",
           "deepspeed_op_builders", "prepare_deepspeed"]

log = logging.getLogger("shardkit.strategies.zero")

# DeepSpeed op builder -> what the user is told while it builds (times measured on 2 CPU cores).
_OP_NOTES = {"ShareMemCommBuilder": "~50 s", "CPUAdamBuilder": "~90 s", "AsyncIOBuilder": "~5 min",
             "PinMemoryBuilder": "~20 s"}
# DeepSpeed ops whose load builds and loads another op first, in that op's own folder: built before them, under that
# folder's lock (else a build killed there leaves torch's baton where no shardkit lock clears it, and every later
# async_io load waits for ever).
_OP_PREREQUISITES = {"AsyncIOBuilder": ("PinMemoryBuilder",)}


class ZeROStrategy(ProcessGroupStrategy):
    """The one implementation behind ZeRO1/2/3 and ZeROInfinity, as stages 1 and 2 run it.

    ZeRO1 and ZeRO2 only build settings; ZeRO3 overrides what partitioned parameters change (module
    init, gathering, inference without an optimizer) and brings its own :class:`ZeROLayout`.

    Args:
        settings: the validated settings (the stage among them).
    """

    family = StrategyFamily.DEEPSPEED
    keeps_master_copy = True  # 16-bit (or fp32) parameters and gradients beside DeepSpeed's fp32 master

    @override
    def model_state_memory(self, job: MemoryJob) -> StateBytes:
        """DeepSpeed's placement by stage and offload (see :func:`zero_state_memory`)."""
        s = self.settings
        return zero_state_memory(job, s.stage, s.offload_optimizer, s.offload_params)

    @property
    @override
    def optimizer_parameters(self) -> str:
        return "flat"

    def __init__(self, settings: ZeROSettings):
        super().__init__(settings.timeout)
        self.settings = settings
        self.layout: ZeROLayout = self._make_layout(settings.stage)
        self._engine: Any | None = None
        self._engine_stepping = False  # True only inside the engine's step: see _refuse_steps_outside_the_engine
        self._runner_values: dict[str, int] = {}
        self._sync_next = True
        self._pending_norm: torch.Tensor | None = None
        self._created_nvme_path: str | None = None

    # ---- environment ---------------------------------------------------------------------------

    def _make_layout(self, stage: int) -> ZeROLayout:
        """Where this stage keeps each rank's share of the state (checkpoints and memory read it)."""
        return FlatPartitionLayout(stage)

    @override
    def setup_environment(self) -> None:
        require_deepspeed(type(self).__name__)
        _check_fp16_supported(precision_section(self.precision), torch.device(self.device_type))
        super().setup_environment()
        if self.settings.uses_nvme and not self.settings.nvme_path:
            self._choose_nvme_path()

    def _choose_nvme_path(self) -> None:
        path, created = default_nvme_path(self.rank)
        self.settings = dataclasses.replace(self.settings, nvme_path=path)  # validates it (writable)
        self._created_nvme_path = path if created else None
        if self.is_global_zero:
            where = f"${NVME_PATH_ENV_VAR}" if not created else f"a new directory under {tempfile.gettempdir()}"
            log.warning("shardkit: %s swaps offloaded state to %s (%s, one per rank%s); for speed point "
                        "nvme_path= or $%s at a directory on a fast local NVMe disk", type(self).__name__, path,
                        where, ", removed at teardown" if created else "", NVME_PATH_ENV_VAR)

    @override
    def teardown(self) -> None:
        if self._engine is not None and hasattr(self._engine, "destroy"):
            self._engine.destroy()
        super().teardown()
        forget_process_groups()
        if self._created_nvme_path is not None:
            shutil.rmtree(self._created_nvme_path, ignore_errors=True)  # ours alone: made by default_nvme_path
            self._created_nvme_path = None

    def set_runner_values(self, gradient_accumulation_steps: int | None = None,
                          micro_batch_size: int | None = None) -> None:
        """The Runner's accumulation steps and per-rank micro-batch size, for the engine config."""
        if gradient_accumulation_steps is not None:
            self._runner_values["gradient_accumulation_steps"] = int(gradient_accumulation_steps)
        if micro_batch_size is not None:
            self._runner_values["micro_batch_size"] = int(micro_batch_size)

    # ---- config --------------------------------------------------------------------------------

    def deepspeed_config(self, model: nn.Module | None = None, runner_values: dict[str, Any] | None = None) -> dict:
        """The complete DeepSpeed engine config this strategy runs with.

        Args:
            model: sizes the "auto" buckets (see ``model_hidden_size``); None resolves them for hidden 0.
            runner_values: ``gradient_accumulation_steps`` (default 1), ``micro_batch_size`` (default 1)
                and ``gradient_clipping`` (default 0: clipping is set per step by ``clip_gradients``).
        """
        values = {**self._runner_values, **(runner_values or {})}
        on_gpu = torch.cuda.is_available()
        return self.settings.engine_config(
            model_hidden_size(model) if model is not None else 0, precision_section(self.precision),
            micro_batch_size=int(values.get("micro_batch_size", 1)),
            gradient_accumulation_steps=int(values.get("gradient_accumulation_steps", 1)),
            world_size=self.world_size, gradient_clipping=float(values.get("gradient_clipping", 0.0)),
            on_gpu=on_gpu,
        )

    # ---- modules and optimizers ----------------------------------------------------------------

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        return self.setup(module, None, None)[0]

    @override
    def setup(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any | None):
        prepare_deepspeed(self.settings)
        import deepspeed

        if optimizer is not None and self.settings.offload_optimizer:
            optimizer = _host_optimizer(optimizer, scheduler)
        config = self.deepspeed_config(module)
        if optimizer is None:
            config = self._inference_config(config)
        if self.settings.offload_optimizer and _is_fused_adamw(optimizer):
            config["zero_force_ds_cpu_optimizer"] = False  # DeepSpeed accepts only its CPU Adam unless told
        if self.is_global_zero:  # the config the engine ran with, once, every "auto" settled: the log says what ran
            log.info("shardkit: DeepSpeed engine config: %s", config)
        engine, ds_optimizer, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config,
                                                          dist_init_required=False)
        self._engine = engine
        # NOTE: the user gets the torch optimizer inside DeepSpeed's ZeRO wrapper: it is a real
        # torch.optim.Optimizer (the Runner checkpoints it through this strategy's hooks, its
        # param_groups are the ones DeepSpeed steps), while the wrapper is reached as engine.optimizer.
        if optimizer is None:  # inference: no gradients, no fp32 master copy, no optimizer state
            return engine, None, scheduler
        inner = getattr(ds_optimizer, "optimizer", ds_optimizer)
        if is_schedule_free(inner):
            self._follow_mode_switches(ds_optimizer, inner)
        returned = inner if isinstance(inner, torch.optim.Optimizer) else ds_optimizer
        self._refuse_steps_outside_the_engine(returned)
        return engine, returned, scheduler

    def _refuse_steps_outside_the_engine(self, optimizer: Any) -> None:
        """Make ``optimizer.step()`` called by hand fail loudly instead of doing nothing.

        The optimizer holds DeepSpeed's fp32 partitions (under ZeRO-3 its groups are even empty between steps), so a
        step of its own would leave the model's weights as they were while the loop ran on without a word. Only the
        engine's step (``runner.step()``, the Accelerator's prepared optimizer, the Trainer) may call it.
        """
        original = optimizer.step
        strategy = self

        def step(_optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if not strategy._engine_stepping:
                raise RuntimeError(
                    f"{type(strategy).__name__}: optimizer.step() was called directly, which under DeepSpeed "
                    "would leave the model's weights unchanged; call runner.step() after runner.backward(loss) "
                    "(it steps DeepSpeed's engine, and the optimizer through it)")
            return original(*args, **kwargs)

        # A scheduler made before setup wrapped the step to count its calls: this guard calls that wrapper, so it
        # says so too, or the scheduler warns that optimizer.step was overridden after it was made.
        if getattr(original, "_wrapped_by_lr_sched", False):
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        # NOTE: an instance attribute shadows the class's method, for this object only. A bound method, as torch's
        # LR schedulers expect when they wrap optimizer.step to count its calls (a scheduler made after setup).
        optimizer.step = types.MethodType(step, optimizer)

    def _follow_mode_switches(self, ds_optimizer: Any, optimizer: torch.optim.Optimizer) -> None:
        """Make a schedule-free optimizer's ``train()``/``eval()`` reach the model, as they do without DeepSpeed.

        They swap y (where gradients are taken) and the average x in the weights the optimizer holds, which
        here are DeepSpeed's fp32 masters: the model keeps its own 16-bit copies (ZeRO-3: its partitions) until
        the next step copies the masters over, and under ZeRO-3 the groups are even empty between steps. So
        each switch runs with the masters in the groups and is followed by the copy DeepSpeed's step makes;
        a user's loop (``optimizer.eval()`` before evaluating or saving) and the Trainer then see x.
        """
        layout = self.layout

        def follow(switch: Any, train: bool) -> Any:
            def switched() -> None:
                if all(bool(group.get("train_mode")) == train for group in optimizer.param_groups):
                    return  # already there: nothing to swap or copy (a ZeRO-3 copy would cost a gather)
                with layout.masters_in_groups(ds_optimizer):
                    switch()
                with torch.no_grad():
                    layout.masters_to_model(ds_optimizer)

            return switched

        # NOTE: instance attributes shadow the class's methods, for this optimizer object only.
        optimizer.train = follow(optimizer.train, True)
        optimizer.eval = follow(optimizer.eval, False)

    def _inference_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The engine config for a model set up without an optimizer.

        DeepSpeed refuses stage 1/2 without an optimizer; what they partition (optimizer state,
        gradients) does not exist in inference, so the engine runs the model replicated (stage 0).
        """
        return {**config, "zero_optimization": {"stage": 0}}

    @override
    def unwrap(self, module: nn.Module) -> nn.Module:
        return getattr(module, "module", module)

    @override
    def gathered_parameters(self, params: Any, modifier_rank: int | None = None,
                            module: nn.Module | None = None) -> contextlib.AbstractContextManager:
        """Context that yields ``params`` whole on every rank (a list).

        Stages 1 and 2 keep whole parameters on every rank: the list is yielded as is, and with
        ``modifier_rank=r`` rank r's values are broadcast on exit. NOTE: once the optimizer is set up,
        DeepSpeed's fp32 master weights overwrite such changes at the next step; change weights before
        ``setup`` or load a checkpoint.
        """
        return replicated_gathered(param_list(params), modifier_rank)

    # ---- the step ------------------------------------------------------------------------------

    @override
    def set_gradient_sync(self, module: nn.Module, enabled: bool) -> None:
        # The Runner says, before each forward, whether the coming backward closes its window.
        self._sync_next = enabled
        if hasattr(module, "set_gradient_accumulation_boundary"):
            module.set_gradient_accumulation_boundary(enabled)

    @override
    def backward(self, loss: torch.Tensor, module: nn.Module, accumulation_steps: int) -> None:
        if module.gradient_accumulation_steps() != accumulation_steps:
            # Keep DeepSpeed's bookkeeping (train_batch_size, sample counts) in step with the Runner.
            module.set_train_batch_size(module.train_micro_batch_size_per_gpu() * accumulation_steps
                                        * module.dp_world_size)
        # NOTE: averaged over the window here (not by DeepSpeed) so the loss means the same as under DDP.
        module.backward(loss / accumulation_steps, scale_wrt_gas=False)

    @override
    def clip_gradients(self, module: nn.Module, optimizer: Any, max_norm: float, norm_type: float = 2.0):
        """Clip inside the coming step; the returned 0-d tensor holds the total norm once the step ran.

        DeepSpeed computes the global norm of the partitioned gradients inside its step, so the value
        is filled in by ``optimizer_step`` (read it after ``runner.step()``).
        """
        if norm_type != 2.0:
            raise ValueError(f"{type(self).__name__} clips by the 2-norm only (DeepSpeed); got norm_type={norm_type}")
        if not max_norm > 0:
            raise ValueError(f"clip_gradients max_norm={max_norm} must be > 0")
        _set_clip(module, float(max_norm))
        self._pending_norm = torch.full((), float("nan"))
        return self._pending_norm

    @override
    def optimizer_step(self, optimizer: Any, module: nn.Module) -> bool:
        skipped_before = module.skipped_steps
        base_clip = float(module.config.get("gradient_clipping", 0.0) or 0.0) if hasattr(module, "config") else 0.0
        module.set_gradient_accumulation_boundary(True)
        self._engine_stepping = True
        try:
            module.step()
        finally:
            self._engine_stepping = False
        if self._pending_norm is not None:
            norm = module.get_global_grad_norm()
            self._pending_norm.fill_(float("nan") if norm is None else float(norm))
            self._pending_norm = None
            _set_clip(module, base_clip)
        module.set_gradient_accumulation_boundary(self._sync_next)
        skipped = module.skipped_steps != skipped_before
        # DeepSpeed keeps its own loss scaler under fp16: the precision mirrors it, or the scale the Runner logs
        # (and saves) would stay at its initial value while the engine halves and doubles its own.
        scaler = getattr(getattr(module, "optimizer", None), "loss_scaler", None)
        self.precision.follow_engine_step(getattr(scaler, "cur_scale", None), skipped)
        return not skipped

    @override
    def zero_grad(self, optimizer: Any, module: nn.Module) -> None:
        """No-op: DeepSpeed's step already zeroed the (partitioned) gradients, skipped steps included."""

    # ---- checkpoints ---------------------------------------------------------------------------

    @override
    def save_module(self, writer: ckpt.CheckpointWriter, name: str, module: nn.Module) -> None:
        zero_checkpoint.save_module(writer, name, self.unwrap(module), self.layout, self.rank)

    @override
    def load_module(self, reader: ckpt.CheckpointReader, name: str, module: nn.Module) -> None:
        optimizer = getattr(module, "optimizer", None)
        zero_checkpoint.load_module(reader, name, self.unwrap(module), self.layout, optimizer)

    @override
    def save_optimizer(self, writer: ckpt.CheckpointWriter, name: str, optimizer: Any, module: nn.Module) -> None:
        zero_checkpoint.save_optimizer(writer, name, module.optimizer, self.unwrap(module), self.layout, self.rank)

    @override
    def load_optimizer(self, reader: ckpt.CheckpointReader, name: str, optimizer: Any, module: nn.Module) -> None:
        zero_checkpoint.load_optimizer(reader, name, module.optimizer, self.unwrap(module), self.layout)

    @override
    def named_param_groups(self, optimizer: Any, module: nn.Module) -> list[dict[str, Any]]:
        return zero_checkpoint.named_groups(module.optimizer, self.unwrap(module), self.layout)

    @override
    def load_optimizer_state(self, optimizer: Any, module: nn.Module, state: dict[str, Any]) -> None:
        zero_checkpoint.load_full_optimizer(state, module.optimizer, self.unwrap(module), self.layout)

    @override
    def checkpoint_info(self) -> dict[str, Any]:
        return {**super().checkpoint_info(), "zero_stage": self.settings.stage,
                "offload_optimizer": self.settings.offload_optimizer, "offload_params": self.settings.offload_params}

    @override
    def checkpoint_scripts(self) -> dict[str, bytes]:
        """``zero_to_fp32.py``, as DeepSpeed puts in each checkpoint: ``python zero_to_fp32.py . OUT`` consolidates."""
        from shardkit.checkpoint.checkpoint_script import SCRIPT_NAME, script_text

        return {SCRIPT_NAME: script_text()}

    # ---- measurement ---------------------------------------------------------------------------

    @override
    def model_state_bytes(self, module: nn.Module, optimizer: Any) -> dict[str, int]:
        """Bytes of model state this rank holds right now, by kind (see ``zero.memory.model_state_bytes``)."""
        from shardkit.strategies.zero.memory import model_state_bytes

        return model_state_bytes(self.unwrap(module), module.optimizer, self.layout)

    def __repr__(self) -> str:
        s = self.settings
        return f"{type(self).__name__}(offload_optimizer={s.offload_optimizer}, offload_params={s.offload_params})"


class ZeRO1(ZeROStrategy):
    """ZeRO stage 1: optimizer state partitioned across ranks; parameters and gradients replicated.

    Args:
        reduce_bucket_size: elements per gradient reduction bucket; "auto" = hidden² (hidden from
            ``model.config.hidden_size``, else the largest dim of the largest 2-D weight).
        allgather_bucket_size: elements per parameter all-gather bucket after the step (5e8).
        overlap_comm: overlap reduction with backward (None: DeepSpeed's default, on for stage 3 only).
        contiguous_gradients: copy gradients into one contiguous buffer as they are produced.
        timeout: seconds a collective may wait (default SHARDKIT_COLLECTIVE_TIMEOUT or 1800).
        extra: raw DeepSpeed config keys merged last (e.g. ``{"zero_optimization": {"round_robin_gradients": True}}``).
    """

    def __init__(self, reduce_bucket_size: int | str = "auto", allgather_bucket_size: int = 500_000_000,
                 overlap_comm: bool | None = None, contiguous_gradients: bool = True, timeout: float | None = None,
                 extra: dict[str, Any] | None = None, offload_optimizer: str | None = None):
        # offload_optimizer is accepted only to say why it cannot be used (configs name it for any stage).
        super().__init__(ZeROSettings(1, reduce_bucket_size, allgather_bucket_size, overlap_comm, contiguous_gradients,
                                      offload_optimizer=offload_optimizer, timeout=timeout, extra=dict(extra or {})))


class ZeRO2(ZeROStrategy):
    """ZeRO stage 2: optimizer state and gradients partitioned; parameters replicated.

    Args:
        offload_optimizer: None or "cpu": keep the fp32 master weights and optimizer state in host
            memory and step them there: shardkit's FusedAdamW steps them as it is; torch's Adam/AdamW
            become DeepSpeedCPUAdam with the same hyperparameters; other optimizers are refused.
        pin_memory: page-locked host buffers for the offload (None: on with a GPU, off without;
            True without a GPU is an error).
        reduce_bucket_size, allgather_bucket_size, overlap_comm, contiguous_gradients, timeout, extra: see ZeRO1.
    """

    def __init__(self, offload_optimizer: str | None = None, reduce_bucket_size: int | str = "auto",
                 allgather_bucket_size: int = 500_000_000, overlap_comm: bool | None = None,
                 contiguous_gradients: bool = True, pin_memory: bool | None = None, timeout: float | None = None,
                 extra: dict[str, Any] | None = None):
        super().__init__(ZeROSettings(2, reduce_bucket_size, allgather_bucket_size, overlap_comm, contiguous_gradients,
                                      offload_optimizer=offload_optimizer, pin_memory=pin_memory, timeout=timeout,
                                      extra=dict(extra or {})))


# ---- helpers ------------------------------------------------------------------------------------


def zero_state_memory(job: MemoryJob, stage: int, offload_optimizer: str | None,
                      offload_params: str | None) -> StateBytes:
    """Bytes one rank holds under DeepSpeed's ZeRO ``stage`` with its offload settings.

    An offloaded optimizer steps on the host from an fp32 copy of the rank's gradient partition (4 bytes a
    parameter), measured with benchmarks/scale.py on 2 ranks in BF16. Under stage 2 the reduced 16-bit gradients
    are not kept: each bucket is copied into that fp32 partition (at 0.4B parameters the gradients counted were
    exactly 4 bytes a parameter over N). With parameters on NVMe (ZeRO-Infinity) the device holds the layers being
    computed; the host holds the 16-bit gradient partition and the first ``params_in_cpu`` parameter elements; the
    other parameters go to NVMe, and so do the master, the optimizer states and the fp32 gradient partition
    (measured: 18 bytes a parameter on NVMe at 0.8B parameters with params_in_cpu=1e8).
    """
    psi, p, g, opt = job.params, job.param_bytes, job.grad_bytes, job.optimizer_bytes
    bucket = min(job.bucket, psi) * g
    layer = job.largest_layer * p
    if stage == 1:
        # DeepSpeed's stage 1 is stage 2's code: once reduced, a rank keeps only its gradient partition (measured
        # equal to stage 2 after a backward); the full gradients live until the reduction.
        grads = job.share(psi * g)
        return StateBytes(psi * p, grads + bucket, job.share(psi * opt), working=psi * g - grads)
    if stage == 2:
        if offload_optimizer:
            return StateBytes(psi * p, bucket, 0, host=job.share(psi * (opt + 4)))
        return StateBytes(psi * p, job.share(psi * g) + bucket, job.share(psi * opt))
    if offload_params:
        local = job.share(psi)
        in_memory = local if offload_params == "cpu" else min(local, job.params_in_cpu)
        on_nvme = (local - in_memory) * p + (local * (opt + 4) if offload_optimizer == "nvme" else 0)
        host = local * g + in_memory * p + (0 if offload_optimizer == "nvme" else local * (opt + 4))
        return StateBytes(0, 0, 0, working=layer, host=host, nvme=on_nvme)
    if offload_optimizer:
        return StateBytes(job.share(psi * p), job.share(psi * g), 0, working=layer, host=job.share(psi * (opt + 4)))
    return StateBytes.sharded(job)


def _check_fp16_supported(precision_section: dict[str, Any], device: torch.device) -> None:
    if not precision_section.get("fp16", {}).get("enabled"):
        return
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():
        raise ZeROSettingsError(f"FP16 under DeepSpeed is not supported on this {device.type} device (DeepSpeed's "
                                f"{get_accelerator()._name} accelerator reports no fp16 support); use BF16() or FP32()")


def _set_clip(engine: Any, max_norm: float) -> None:
    # DeepSpeed reads the clip from the ZeRO optimizer (stage 1-3) and from the engine config (others).
    engine._config.gradient_clipping = max_norm
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = max_norm


def prepare_deepspeed(settings: ZeROSettings) -> None:
    """Quiet DeepSpeed's INFO logs and build the C++ ops this run needs, with one line per build."""
    choose_deepspeed_accelerator()
    from deepspeed.utils import logger as ds_logger

    if ds_logger.level < logging.WARNING:
        ds_logger.setLevel(logging.WARNING)
    # NOTE: DeepSpeed's engine calls torch's deprecated collective names on every step; torch warns from
    # c10d_logger each time: 856 FutureWarning lines in a 10-step ZeRO-3 run. Only those, by module,
    # category and message: the user's own warnings, and torch's others, still show.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning,
                            module=r"torch\.distributed\.c10d_logger")
    for name in deepspeed_op_builders(offload=bool(settings.offload_optimizer), nvme=bool(settings.uses_nvme)):
        build_deepspeed_op(name)
    forget_stale_process_groups()


def choose_deepspeed_accelerator() -> None:
    """DeepSpeed's accelerator as a run picks it (CPU where torch sees no GPU), and its ops' build folder: exported
    as TORCH_EXTENSIONS_DIR so that every op DeepSpeed loads by itself lands where shardkit locks and builds."""
    from shardkit.ops.build_lock import extensions_root

    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    extensions_root()


def deepspeed_op_builders(offload: bool, nvme: bool) -> list[str]:
    """The DeepSpeed op builders a ZeRO run on this machine loads: shm_comm (the CPU accelerator's collectives),
    cpu_adam (optimizer offload: shardkit converts Adam/AdamW to DeepSpeedCPUAdam, and refuses other optimizers) and
    async_io (NVMe offload)."""
    from deepspeed.accelerator import get_accelerator

    needed = ["ShareMemCommBuilder"] if get_accelerator().device_name() == "cpu" else []
    if offload:
        needed.append("CPUAdamBuilder")
    if nvme:
        needed.append("AsyncIOBuilder")
    return needed


def build_deepspeed_op(builder_name: str) -> bool:
    """Build (first use only) and load DeepSpeed's op ``builder_name`` (e.g. "CPUAdamBuilder") under shardkit's
    build lock: one build however many ranks or processes ask, a baton left by a killed build cleared, and the
    compile under its time limit (``SHARDKIT_BUILD_TIMEOUT_S``) and ending with this process. ``shardkit build-ops
    --deepspeed`` (and ``make test``'s scripts/build_ops.py) uses it.
    Returns False, building nothing, for an op DeepSpeed marks incompatible with this machine."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    from shardkit.ops.build_lock import (
        build_lock,
        environment_ninja,
        extensions_root,
        ninja_has_work,
        run_build_subprocess,
    )

    builder = get_accelerator().create_op_builder(builder_name)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, True):
        return False
    for prerequisite in _OP_PREREQUISITES.get(builder_name, ()):
        build_deepspeed_op(prerequisite)
    build_dir = extensions_root() / builder.NAME
    label = f"DeepSpeed op {builder.NAME}"
    # NOTE: every rank comes here; the shared build lock makes the others wait for the one build (no
    # collective, which would time out during a 5-minute build) and clears a baton a killed build left.
    # NOTE: the marker, written after the supervised build passed, not the .so (a link killed half-way leaves one):
    # without it the build runs in the child, which has a time limit and ends with this process.
    marker = build_dir / f".shardkit-built-{deepspeed.__version__}-{torch.__version__}"
    with build_lock(build_dir, label):
        built = marker.exists() and (build_dir / f"{builder.NAME}.so").exists()
        if not built or ninja_has_work(build_dir):  # out of date to ninja: the load below would compile in-process
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                log.warning("shardkit: building DeepSpeed op %s (first use only, %s on 2 cores) into %s",
                            builder.NAME, _OP_NOTES.get(builder_name, "a few minutes"), build_dir.parent)
            run_build_subprocess("from deepspeed.accelerator import get_accelerator; get_accelerator()"
                                 f".create_op_builder({builder_name!r}).load(verbose=False)", label, build_dir)
            marker.touch()
        # NOTE: this load runs ninja too (torch's JIT load checks the folder): with another ninja than the build's
        # it would compile everything again, here, outside the supervisor (see environment_ninja).
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), environment_ninja():
            builder.load(verbose=False)
    return True


def _is_fused_adamw(optimizer: Any) -> bool:
    from shardkit.optim import FusedAdamW

    return isinstance(optimizer, FusedAdamW)


def _host_optimizer(optimizer: torch.optim.Optimizer, scheduler: Any | None) -> torch.optim.Optimizer:
    """The optimizer that steps the offloaded fp32 partitions on the host.

    shardkit's FusedAdamW is kept as it is (its C++ step streams at memory bandwidth, as fast as
    DeepSpeedCPUAdam or faster: benchmarks/RESULTS.md); torch's Adam/AdamW become DeepSpeedCPUAdam with the
    same groups, since their foreach step is several times slower on the host.
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if isinstance(optimizer, DeepSpeedCPUAdam) or _is_fused_adamw(optimizer):
        return optimizer
    kinds = {torch.optim.AdamW: True, torch.optim.Adam: False}
    adamw_mode = kinds.get(type(optimizer))
    if adamw_mode is None:
        raise ZeROSettingsError(f"optimizer offload steps the optimizer on the host with DeepSpeedCPUAdam or "
                                f"shardkit's FusedAdamW; {type(optimizer).__name__} cannot be converted: use "
                                f"shardkit.optim.FusedAdamW, torch.optim.AdamW or Adam")
    if any(group.get("amsgrad") for group in optimizer.param_groups):
        raise ZeROSettingsError("optimizer offload does not support amsgrad=True (DeepSpeedCPUAdam)")
    groups = [{k: v for k, v in g.items() if k not in ("foreach", "fused", "capturable", "differentiable",
                                                         "maximize", "decoupled_weight_decay")}
              for g in optimizer.param_groups]
    converted = DeepSpeedCPUAdam(groups, adamw_mode=adamw_mode)
    if scheduler is not None and getattr(scheduler, "optimizer", None) is optimizer:
        scheduler.optimizer = converted  # its lr changes must reach the optimizer that steps
    return converted
