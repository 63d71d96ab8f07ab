"""Runner: the one object a training loop talks to. It holds a strategy and a precision and delegates."""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from shardkit.config.common import CONFIG_FILE_ENV, precision_kind
from shardkit.data.loader import RunnerDataLoader
from shardkit.data.streaming import rebuild_loader
from shardkit.distributed.oom import leave_run_facts
from shardkit.precision import FP32, Precision
from shardkit.runner.assembly import (
    activation_checkpointing_of,
    autocast_forward,
    by_name,
    count_parameters,
    default_strategy,
    launched_strategy,
    prebuild_kernels,
)
from shardkit.runner.checkpoints import RunnerCheckpoints
from shardkit.runner.gathering import MetricsGather
from shardkit.runner.observe import RunnerObservability
from shardkit.strategies.base import Strategy
from shardkit.strategies.quant_storage import keep_4bit_layers_trainable
from shardkit.utils.seeding import enable_determinism, rank_logger, seed_everything

if TYPE_CHECKING:
    from shardkit.observability import RunLog, StepProfiler, Throughput
    from shardkit.observability.oom_report import StepRecorder

__all__ = ["Runner"]


class Runner:
    """Trains a model with a pluggable :class:`Strategy` and :class:`Precision`.

    Example:
        runner = Runner(strategy=DDP(), precision=BF16(), gradient_accumulation_steps=4, seed=0)
        model, optimizer = runner.setup(model, optimizer)
        loader = runner.setup_dataloader(loader)
        for batch in loader:
            runner.backward(model(**batch))
            runner.step()          # steps only at the end of each accumulation window

    Args:
        strategy: where state lives and how ranks talk: a Strategy or a registered name ("fsdp", "zero3",
            ...); default DDP under a launcher, else SingleDevice.
        precision: dtypes for parameters, compute and communication: a Precision or a name ("bf16", "fp16",
            ...); default FP32().
        mixed_precision: Accelerate's name for ``precision`` ("no", "fp16", "bf16"); give one of the two.
        gradient_accumulation_steps: micro-batches per optimizer step. The loss is averaged over
            them and gradients are synchronised only on the last one.
        seed: seeds every RNG on every rank and the data loaders' shuffling; None leaves RNGs alone.
        checkpoint_keep_last: keep at most this many checkpoints next to each new one.
        config: a DeepSpeed JSON or Accelerate YAML file (or a DeepSpeed dict) that sets the strategy,
            precision, accumulation and clipping; explicit arguments must agree with it. Defaults to
            the file named by SHARDKIT_CONFIG_FILE, which `shardkit launch --config_file` sets.
        activation_checkpointing: recompute blocks' forward in backward, under every strategy: True (the
            repeated blocks), a block class or class name (or a tuple), or
            :class:`shardkit.strategies.ActivationCheckpointing` (``use_reentrant``, CPU offload, ...).
            None takes a DeepSpeed config's ``activation_checkpointing`` section; False turns block checkpointing
            off (the section still configures ``deepspeed.checkpointing`` for a model that calls it).
        log_with: experiment trackers for :meth:`log` and :meth:`log_hyperparams` (main process only): names of
            :data:`shardkit.observability.trackers.TRACKERS` (``"tensorboard"``, ``"wandb"``, ``"mlflow"``, ``"csv"``,
            ``"jsonl"``, ``"all"``) or tracker objects. A DeepSpeed config's ``tensorboard`` / ``wandb`` /
            ``csv_monitor`` sections add theirs, which also record the loss, learning rate and loss scale per step.
        logging_dir: where the trackers named in ``log_with`` write (and the profiler, under ``profile``).
        deterministic: torch's deterministic algorithms, cuBLAS's fixed workspace and seeded everything, so that two
            runs are bitwise equal (``seed`` defaults to 0 then).
        profile_steps: record these optimizer steps with torch.profiler (``(2, 4)``, ``"2-3"`` or ``2``): a Chrome
            trace and a memory timeline per rank under ``<logging_dir>/profile``, and the top ops logged.
        memory_snapshot: on CUDA, record the allocator's history and write ``<logging_dir>/profile/
            oom_snapshot.rank<N>.pickle`` when an allocation fails (``profile_steps`` turns it on too). On every
            device an out-of-memory error writes ``<logging_dir>/oom_report.rank<N>.json`` (:meth:`report_oom`).
        peak_tflops: dense TFLOP/s per device that :attr:`throughput`'s ``mfu`` divides by (default
            ``$SHARDKIT_PEAK_TFLOPS``, else the data sheet's figure for the GPU, else one measured at start-up).

    Attributes:
        checkpoints: the :class:`~shardkit.runner.checkpoints.RunnerCheckpoints` that :meth:`save`, :meth:`load` and
            :meth:`wait_for_save` go through (it owns the background saver).
        observability: the :class:`~shardkit.runner.observe.RunnerObservability` behind :meth:`log`,
            :attr:`throughput`, :meth:`report_oom`, :attr:`run_log` and :attr:`profiler`.
        gathering: the :class:`~shardkit.runner.gathering.MetricsGather` behind :meth:`gather_for_metrics`.
    """

    def __init__(
        self, strategy: Strategy | str | None = None, precision: Precision | str | None = None, *,
        config: str | Path | dict | None = None, gradient_accumulation_steps: int | None = None,
        seed: int | None = None, checkpoint_keep_last: int | None = None, activation_checkpointing: Any = None,
        mixed_precision: str | None = None, log_with: Any = None, logging_dir: str | Path = "runs",
        deterministic: bool = False, profile_steps: Any = None, memory_snapshot: bool = False,
        peak_tflops: float | None = None,
    ):
        strategy, precision = by_name(strategy, precision, mixed_precision)
        self.config = None
        self.max_grad_norm: float | None = None
        from_launcher = config is None and os.environ.get(CONFIG_FILE_ENV) is not None
        config = config if config is not None else os.environ.get(CONFIG_FILE_ENV)
        source = None
        if config is None:
            strategy, config, source = launched_strategy(strategy, precision)
        if config is not None:
            from shardkit.config import resolve_runner_config

            self.config = resolve_runner_config(
                config, strategy=strategy, precision=precision, gradient_accumulation_steps=gradient_accumulation_steps,
                explicit_precision_wins=from_launcher, source=source,
            )
            strategy, precision = self.config.strategy, self.config.precision
            gradient_accumulation_steps = self.config.gradient_accumulation_steps
            self.max_grad_norm = self.config.max_grad_norm
        gradient_accumulation_steps = 1 if gradient_accumulation_steps is None else gradient_accumulation_steps
        if gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps} must be >= 1")
        self.strategy = strategy if strategy is not None else default_strategy()
        self.precision = precision if precision is not None else FP32()
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.seed = seed
        self.activation_checkpointing = activation_checkpointing_of(activation_checkpointing, self.config)
        self.strategy.connect(self.precision)
        if self.config is not None and self.config.micro_batch_size is not None:
            self.strategy.set_runner_values(micro_batch_size=self.config.micro_batch_size)
        self.strategy.setup_environment()
        self.logger = rank_logger("shardkit", self.rank)
        self.deterministic = deterministic
        if deterministic:
            self.seed = seed = enable_determinism(0 if seed is None else seed)
        elif seed is not None:
            seed_everything(seed)
        self.observability = RunnerObservability(
            self.strategy, self.precision, self.config, log_with=log_with, logging_dir=logging_dir,
            profile_steps=profile_steps, memory_snapshot=memory_snapshot, peak_tflops=peak_tflops,
            model=lambda: self._module)
        self._owners: dict[torch.optim.Optimizer, nn.Module] = {}  # every optimizer set up -> its model
        self.checkpoints = RunnerCheckpoints(
            self.strategy, self.precision, keep_last=checkpoint_keep_last, owners=self._owners,
            step_state=self._step_state, restore_step_state=self._restore_step_state, logger=self.logger,
            recovery=self.observability.recovery)
        self._module: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: Any | None = None
        self._micro_step = 0  # position inside the accumulation window
        self._window = self.gradient_accumulation_steps  # micro-batches in the current window (begin_window)
        self._boundary = False  # the last backward closed a window: step() will step
        self._clipped = False  # clip_gradients ran in this window
        self.optimizer_steps = 0
        self._stepped = False  # the last step() applied an optimizer step, and no backward came since
        self._loader: RunnerDataLoader | None = None
        self.gathering = MetricsGather(self.strategy)

    # ---- rank facts ---------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.strategy.root_device

    @property
    def rank(self) -> int:
        return self.strategy.rank

    @property
    def local_rank(self) -> int:
        return self.strategy.local_rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def is_main_process(self) -> bool:
        return self.strategy.is_global_zero

    @property
    def sync_gradients(self) -> bool:
        """True when the last backward closed an accumulation window (the next step() will step).

        NOTE: the Runner's meaning, not Accelerate's: it turns False again once ``step()`` has run, so test it
        before ``step()``. After the step, use ``step()``'s result or :meth:`should` (``shardkit.Accelerator``
        keeps Accelerate's meaning: still True after ``optimizer.step()``).
        """
        return self._boundary

    def should(self, every: int) -> bool:
        """True right after the ``step()`` that made ``optimizer_steps`` a multiple of ``every``, else False.

        The periodic-work test that stays right under gradient accumulation: False on every micro-batch
        inside a window, False before the first step, False when an FP16 overflow skipped the step::

            runner.step()
            if runner.should(every=500):
                runner.save(f"ckpt/step-{runner.optimizer_steps}", state)
        """
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Runner.should(every={every!r}): every must be a whole number of optimizer steps "
                             f">= 1, e.g. every=500")
        return self._stepped and self.optimizer_steps % every == 0

    def print(self, *args: Any, all_ranks: bool = False, **kwargs: Any) -> None:
        """``print`` on the main process only (or on every rank, prefixed, with ``all_ranks=True``)."""
        if all_ranks:
            builtins.print(f"[rank {self.rank}]", *args, **kwargs)
        elif self.is_main_process:
            builtins.print(*args, **kwargs)

    # ---- setup --------------------------------------------------------------------------------

    def init_module(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """Context to build a model in: on the device, in the parameter dtype, sharded or on the meta
        device where the strategy supports it."""
        return self.strategy.module_init_context(empty_init)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, scheduler: Any | None = None):
        """Wrap a model (and its optimizer and scheduler) for the strategy and precision.

        Returns the model alone when only a model is given, else a tuple of what was given.
        """
        self.strategy.set_runner_values(gradient_accumulation_steps=self.gradient_accumulation_steps)
        prebuild_kernels(model)
        keep_4bit_layers_trainable(model)  # QLoRA: an evaluation must not switch 4-bit layers to a no-grad kernel
        if self.activation_checkpointing is not None:  # before the strategy wraps it: one mechanism for all
            from shardkit.strategies.activation_checkpointing import apply_activation_checkpointing

            apply_activation_checkpointing(model, self.activation_checkpointing, strategy=self.strategy)
        model, optimizer, scheduler = self.strategy.setup(model, optimizer, scheduler)
        if self.activation_checkpointing is not None:
            self.strategy.configure_activation_checkpointing(self.activation_checkpointing)
        if self.precision.uses_autocast:
            autocast_forward(model, functools.partial(self.precision.autocast, self.device))
        self._module, self._optimizer, self._scheduler = model, optimizer, scheduler
        if optimizer is not None:
            self._owners[optimizer] = model
        self._micro_step, self._boundary = 0, False
        self._set_window(self.gradient_accumulation_steps)
        self.observability.restart_throughput()  # timed from here, for this model
        if self.rank == 0:  # the run's size, for `shardkit launch`'s out-of-memory diagnosis
            leave_run_facts(self.unwrap_model(model), precision_kind(self.precision))
        self.strategy.set_gradient_sync(model, self.gradient_accumulation_steps == 1)
        if optimizer is None:
            return model
        return (model, optimizer) if scheduler is None else (model, optimizer, scheduler)

    def setup_dataloader(self, loader: DataLoader, seed: int | None = None) -> RunnerDataLoader:
        """Shard ``loader``'s dataset across ranks, move batches to the device, and make it resumable.

        Shuffling (kept from the loader: ``shuffle=True`` stays shuffled) depends only on the seed and
        the epoch, so every rank and every resumed run sees the same order. ``seed`` is this loader's
        shuffling seed (default: the Runner's seed, else 0). A streamed (iterable) dataset is read in order
        and dealt to the ranks item by item (:mod:`shardkit.data.streaming`).
        """
        strategy = self.strategy
        strategy.set_runner_values(micro_batch_size=loader.batch_size)
        seed = seed if seed is not None else self.seed or 0
        self._loader = rebuild_loader(loader, strategy.data_parallel_rank, strategy.data_parallel_size, seed,
                                      self.device, self.all_gather)
        return self._loader

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        """The user's module inside the strategy's wrapper."""
        return self.strategy.unwrap(model)

    def num_parameters(self, model: nn.Module) -> int:
        """The model's whole parameter count under every strategy (ZeRO-3's partitioned ones and FSDP's shards
        counted whole; ``sum(p.numel() ...)`` gives 0 under ZeRO-3), tied parameters once."""
        return count_parameters(self.strategy, model)

    def gathered_parameters(self, params: Any, modifier_rank: int | None = None) -> contextlib.AbstractContextManager:
        """Context that yields ``params`` (a tensor, an iterable of them, or a module) as a list of plain,
        whole tensors under every strategy: ZeRO-3 partitions and FSDP/TP DTensors are gathered, one full
        copy each. Every rank must enter it. Inside the block the set-up model's own attributes read whole
        too (``model.parameters()``). With ``modifier_rank=r``, in-place changes rank r makes are kept on
        every rank on exit; without it they are dropped. Don't run forward inside the block.

        Example:
            with runner.gathered_parameters(model.parameters()) as params:
                flat = torch.cat([p.reshape(-1) for p in params])
        """
        module = self.strategy.unwrap(self._module) if self._module is not None else None
        return self.strategy.gathered_parameters(params, modifier_rank, module=module)

    def iter_full_state_dict(self, model: nn.Module | None = None):
        """Stream the full state dict to the main process one module at a time: ``(name, tensor)`` pairs.

        Same keys and order as ``state_dict()``; whole tensors (gathered one module at a time, so no rank
        holds the whole model), detached CPU copies in the dtype the model holds. Every rank must run the
        loop to its end (the gathers are collectives); ranks other than the main process yield nothing.
        ``model`` defaults to the model given to :meth:`setup`.

        Example:
            state = dict(runner.iter_full_state_dict(model))   # whole on rank 0, {} elsewhere
        """
        module = model if model is not None else self._require("_module", "iter_full_state_dict")
        return self.strategy.iter_full_state_dict(module)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Run a block in the precision's compute dtype (setup() already does this for forward)."""
        return self.precision.autocast(self.device)

    # ---- the step -----------------------------------------------------------------------------

    def begin_window(self, size: int) -> None:
        """Make the accumulation window that starts now ``size`` micro-batches long (1 to
        ``gradient_accumulation_steps``): its last backward closes it and ``step()`` steps. For the short last
        window of an epoch; the windows after it are full again. Call it before the window's first forward."""
        ga = self.gradient_accumulation_steps
        if self._micro_step != 0:
            raise RuntimeError(f"begin_window() in the middle of a window ({self._micro_step} of {self._window} "
                               "micro-batches done): call it before a window's first forward")
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= ga:
            raise ValueError(f"begin_window(size={size!r}): a window holds 1 to gradient_accumulation_steps={ga} "
                             "micro-batches")
        module = self._require("_module", "begin_window")
        self._set_window(size)
        self.strategy.set_gradient_sync(module, size == 1)

    def _set_window(self, size: int) -> None:
        # Pipeline runs backward inside forward, so it must know the window's size before the window's forwards.
        self._window = size
        self.strategy.set_window(size)

    def abandon_window(self) -> None:
        """Drop the gradients of an unfinished accumulation window and start the next window afresh (after
        an out-of-memory error in the middle of one, before retrying with a smaller batch)."""
        module, optimizer = self._require("_module", "abandon_window"), self._optimizer
        if optimizer is not None:
            self.strategy.zero_grad(optimizer, module)
        self._micro_step, self._boundary, self._clipped = 0, False, False
        self._set_window(self.gradient_accumulation_steps)
        self.strategy.set_gradient_sync(module, self.gradient_accumulation_steps == 1)

    def backward(self, loss: torch.Tensor, model: nn.Module | None = None) -> None:
        """Backward of one micro-batch's loss, averaged over the accumulation window."""
        module = model if model is not None else self._require("_module", "backward")
        self.observability.before_backward(loss, self._micro_step, self.optimizer_steps)
        with self.observability.reporting_oom():
            self.strategy.backward(loss, module, self._window)
        self._stepped = False
        self._micro_step = (self._micro_step + 1) % self._window
        self._boundary = self._micro_step == 0
        if self._boundary:
            self._set_window(self.gradient_accumulation_steps)
        # The next forward must know whether its backward syncs (DDP reads the flag in forward).
        self.strategy.set_gradient_sync(module, self._micro_step == self._window - 1)

    def clip_gradients(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip the gradients' total norm to ``max_norm`` and return the norm before clipping.

        Only meaningful at the end of an accumulation window; returns None in the middle of one.
        NOTE: under the ZeRO strategies the engine clips inside its step, so the returned tensor
        holds the norm only once ``step()`` has run.
        """
        if not self._boundary:
            return None
        module, optimizer = self._require("_module", "clip"), self._require("_optimizer", "clip")
        self._clipped = True
        return self.strategy.clip_gradients(module, optimizer, max_norm, norm_type)

    def step(self) -> bool:
        """At the end of an accumulation window: unscale, check for inf/NaN, step the optimizer and
        scheduler, zero the gradients. Returns True when an optimizer step was applied."""
        self._stepped = False
        if not self._boundary:
            return False
        module, optimizer = self._require("_module", "step"), self._require("_optimizer", "step")
        if self.max_grad_norm and not self._clipped:  # a config's gradient_clipping applies by itself
            self.strategy.clip_gradients(module, optimizer, self.max_grad_norm)
        self._clipped = False
        with self.observability.reporting_oom():
            stepped = self.strategy.optimizer_step(optimizer, module)
        if stepped:
            self.optimizer_steps += 1
            if self._scheduler is not None:
                self._scheduler.step()
        self.strategy.zero_grad(optimizer, module)
        self._boundary = False
        self._stepped = stepped
        self.observability.after_step(optimizer, self.optimizer_steps, self.gradient_accumulation_steps)
        return stepped

    def record_step(self, scheduler: Any | None = None) -> None:
        """Count an optimizer step the optimizer took by itself inside backward (LOMO, AdaLomo: their
        ``fused_backward`` updates the weights from gradient hooks) and step ``scheduler`` after it."""
        self.optimizer_steps += 1
        if scheduler is not None:
            scheduler.step()

    # ---- checkpoints (RunnerCheckpoints) ------------------------------------------------------

    @property
    def checkpoint_keep_last(self) -> int | None:
        """Keep at most this many checkpoints next to each new one (None: all)."""
        return self.checkpoints.keep_last

    @checkpoint_keep_last.setter
    def checkpoint_keep_last(self, value: int | None) -> None:
        self.checkpoints.keep_last = value

    def save(self, path: str | Path, state: dict[str, Any], *, blocking: bool = True, update_latest: bool = True,
             on_saved: Callable[[Path], None] | None = None) -> Path:
        """Save a checkpoint directory atomically.

        ``state`` maps names to models, optimizers, schedulers, data loaders and plain values; the
        precision's state, the accumulation position and every rank's RNG state are added. An object with
        ``state_dict``/``load_state_dict`` and ``checkpoint_per_rank = True`` is saved by every rank, each its own
        state, in the same atomic save (an RL trainer's buffered round). The
        parent directory's ``latest`` pointer moves to the new save once it is complete (unless
        ``update_latest=False``: the Trainer finds its ``checkpoint-N`` folders by name).

        With ``blocking=False`` the state is copied to host memory (pinned, from GPUs) and the call returns while
        a background thread writes the same atomic, verified checkpoint; the strategy's gathers still run here.
        At most one save is in flight: the next ``save``, ``load``, :meth:`wait_for_save` and :meth:`teardown`
        wait for it, and raise a ``CheckpointError`` naming it if it failed. The host copy (the state's size) is
        kept for the next save. ``on_saved(path)`` runs once the checkpoint is published (on this rank; on the
        background thread for ``blocking=False``: file work only, no collectives).
        """
        return self.checkpoints.save(path, state, blocking=blocking, update_latest=update_latest, on_saved=on_saved)

    def wait_for_save(self) -> Path | None:
        """Wait for the background save in flight (``save(..., blocking=False)``); return its path, or None.

        Raises:
            CheckpointError: that save failed; the message names the checkpoint (the previous one is untouched).
        """
        return self.checkpoints.wait_for_save()

    def load(self, path: str | Path, state: dict[str, Any], *, verify: bool = True,
             runner_state: bool = True) -> dict[str, Any]:
        """Restore the objects in ``state`` in place from a checkpoint; return its plain values.

        ``path`` may be a checkpoint directory or its parent (the ``latest`` pointer is followed).
        Every file read is checked against the manifest's sha256 in the same pass that reads it;
        ``verify=False`` skips the hashes (sizes, schema and paths are still checked).
        ``runner_state=False`` restores only ``state``: the precision's loss scale, the step count,
        the accumulation position and the RNG streams stay as they are (loading the best weights).
        """
        return self.checkpoints.load(path, state, verify=verify, runner_state=runner_state)

    def resume(self, directory: str | Path, state: dict[str, Any], *, mode: bool | str = "auto",
               verify: bool = True) -> dict[str, Any] | None:
        """Load ``state`` from the newest complete checkpoint in ``directory`` (the folder ``save`` fills); return its
        plain values, or None when nothing was loaded. Incomplete checkpoints (a killed save, missing or cut files)
        are skipped. ``mode="auto"``: only when ``shardkit launch --max-restarts`` restarted the job (a first start
        trains from the start; so does a restart that finds no checkpoint yet); ``True``: always, and one must exist.
        A collective: every rank calls it, and rank 0 chooses the checkpoint for all.
        """
        return self.checkpoints.resume(directory, state, mode=mode, verify=verify)

    def _step_state(self) -> dict[str, Any]:
        return {"micro_step": self._micro_step, "boundary": self._boundary, "optimizer_steps": self.optimizer_steps,
                "gradient_accumulation_steps": self.gradient_accumulation_steps}

    def _restore_step_state(self, state: dict[str, Any]) -> None:
        self._micro_step, self._boundary = state["micro_step"], state["boundary"]
        self._set_window(self.gradient_accumulation_steps)
        self.optimizer_steps = state["optimizer_steps"]
        if self._module is not None:
            last = self.gradient_accumulation_steps - 1
            self.strategy.set_gradient_sync(self._module, self._micro_step == last)

    # ---- what the run is doing (RunnerObservability) ------------------------------------------

    @property
    def logging_dir(self) -> Path:
        return self.observability.logging_dir

    @property
    def run_log(self) -> RunLog:
        """The ``log_with`` trackers (and a DeepSpeed config's monitor sections)."""
        return self.observability.run_log

    @property
    def profiler(self) -> StepProfiler | None:
        """The ``profile_steps`` profiler; None without ``profile_steps``."""
        return self.observability.profiler

    @property
    def flight_recorder(self) -> StepRecorder:
        """The last steps' times, losses and memory, for out-of-memory reports."""
        return self.observability.flight_recorder

    @property
    def throughput(self) -> Throughput:
        """Tokens/s, samples/s, TFLOP/s and MFU of the model set up: ``runner.throughput.update(tokens, samples)``
        after each step returns them (see :class:`shardkit.observability.Throughput`); timing starts at setup()."""
        return self.observability.throughput(
            lambda: self.unwrap_model(self._require("_module", "throughput")), bool(self.activation_checkpointing))

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        """Record metrics with the ``log_with`` trackers on the main process (``step``: the optimizer step)."""
        self.observability.log(values, self.optimizer_steps if step is None else step)

    def log_hyperparams(self, values: dict[str, Any]) -> None:
        """Record the run's configuration once with the ``log_with`` trackers on the main process."""
        self.observability.log_hyperparams(values)

    def report_oom(self, exc: BaseException) -> Path | None:
        """Write ``<logging_dir>/oom_report.rank<N>.json`` for an out-of-memory error (once per error): the failing
        allocation, the memory summary, the last steps and the ``shardkit estimate-memory`` command for this run.
        Runs by itself for an error raised inside ``backward``/``step`` or one that ends the script; call it from
        a loop that catches the error to retry smaller. Returns the report's path (None for another error)."""
        return self.observability.report_oom(exc)

    def retrying_oom(self) -> contextlib.AbstractContextManager:
        """Out-of-memory errors inside are the caller's to retry smaller (the Trainer's ``auto_find_batch_size``):
        ``backward``/``step`` write no report for them. One that escapes and ends the script is still reported."""
        return self.observability.retrying_oom()

    # ---- collectives --------------------------------------------------------------------------

    def barrier(self, name: str | None = None) -> None:
        self.strategy.barrier(name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.strategy.broadcast(obj, src)

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return self.strategy.all_reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.strategy.all_gather(tensor)

    def gather_for_metrics(self, tensor: torch.Tensor, loader: RunnerDataLoader | None = None) -> torch.Tensor:
        """Concatenate a per-sample tensor from every data-parallel rank, dropping the padding duplicates that the
        last batch of an uneven split carries (so metrics count each sample once); tensor-parallel peers, which
        hold the same batch, count once. ``loader`` is the loader whose latest batch ``tensor`` belongs to
        (default: the last one set up)."""
        return self.gathering.gather(tensor, loader if loader is not None else self._loader)

    # ---- inference ----------------------------------------------------------------------------

    def generate(self, model: nn.Module, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        """Generate with a model set up by this Runner (shardkit's Llama or a Hugging Face model), under any
        strategy. Call it on EVERY rank, each with its own prompts: under ZeRO-3, FSDP and TP the ranks decode
        in lock step until all are done. ``kwargs`` go to the model's ``generate`` (``max_new_tokens``,
        ``eos_token_id``, ...; ``keep_unsharded`` for FSDP and ZeRO-3). See :func:`shardkit.inference.generate`."""
        from shardkit.inference import generate

        s = self.strategy
        with self.autocast():
            return generate(self.unwrap_model(model), input_ids, data_parallel_rank=s.data_parallel_rank,
                            data_parallel_size=s.data_parallel_size, strategy=s, **kwargs)

    def split_between_processes(self, items: Any, apply_padding: bool = False) -> contextlib.AbstractContextManager:
        """Context yielding this data-parallel rank's contiguous share of ``items`` (list, tuple, tensor or
        dict of them); with ``apply_padding`` every rank gets as many (short ranks repeat their last item)."""
        from shardkit.inference import split_between_processes

        s = self.strategy
        return split_between_processes(items, apply_padding, dp_rank=s.data_parallel_rank, dp_size=s.data_parallel_size)

    def gather_object(self, obj: Any) -> list[Any]:
        """Every data-parallel rank's ``obj`` in rank order (lists concatenated); inside
        :meth:`split_between_processes` the padding repeats are dropped, so outputs line up with the items."""
        from shardkit.inference import gather_object

        s = self.strategy
        return gather_object(obj, dp_rank=s.data_parallel_rank, dp_size=s.data_parallel_size)

    def _require(self, attr: str, action: str) -> Any:
        value = getattr(self, attr)
        if value is None:
            what = attr.strip("_")
            raise RuntimeError(f"runner.{action}() needs a {what}: pass it to runner.setup() first")
        return value

    def release(self) -> None:
        """Drop the references to what setup() and setup_dataloader() were given, so that a second training in the
        same process does not keep the first one's model and optimizer alive; the strategy and precision stay."""
        self._module = self._optimizer = self._scheduler = self._loader = None
        self._owners.clear()
        self._micro_step, self._boundary, self._clipped = 0, False, False
        self._window = self.gradient_accumulation_steps

    def teardown(self) -> None:
        """Finish a background save, then release the process group and anything else the strategy holds.

        Raises:
            CheckpointError: the background save failed (the process group is released all the same).
        """
        try:
            self.observability.finish()
            self.checkpoints.close()
        finally:
            self.strategy.teardown()

    def __repr__(self) -> str:
        return f"Runner(strategy={self.strategy!r}, precision={self.precision!r}, world_size={self.world_size})"

