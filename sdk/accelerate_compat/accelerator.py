"""``shardkit.Accelerator``: Accelerate's ``Accelerator`` as a thin front on a :class:`shardkit.Runner`.

    from shardkit import Accelerator          # in place of: from accelerate import Accelerator
    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=4)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

Every method translates to the Runner, its Strategy and its Precision: ``prepare`` is ``runner.setup`` and
``runner.setup_dataloader``, ``backward`` the strategy's backward, the prepared optimizer's ``step()`` the
strategy's step through the precision. Accelerate's meanings are kept where they differ from the Runner's:
``sync_gradients`` is True on the micro-batch that ends a window and stays True after ``optimizer.step()``
until the next ``accumulate()``; the prepared optimizer and scheduler do nothing mid-window.
"""

from __future__ import annotations

import functools
import gc
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from typing_extensions import override

from shardkit.accelerate_compat.checkpointing import AcceleratorCheckpoints
from shardkit.accelerate_compat.data_loader import (
    default_data_seed,
    makes_own_batches,
    remember_data_seed,
    shard_batches,
)
from shardkit.accelerate_compat.dummies import (
    DeepSpeedConfigView,
    is_dummy_optimizer,
    is_dummy_scheduler,
    raw_deepspeed_config,
    real_optimizer,
    real_scheduler,
)
from shardkit.accelerate_compat.parts import Prepared, forward_to, part_attribute
from shardkit.accelerate_compat.plugins import (
    DataLoaderConfiguration,
    ProjectConfiguration,
    apply_init_kwargs,
    check_argument_types,
    ddp_options,
    deepspeed_config,
    default_strategy,
    fsdp_strategy,
    launched_engine,
    precision_for,
    read_handlers,
)
from shardkit.accelerate_compat.preparing import (
    object_kind,
    pair_optimizers,
    share_generator,
    split_batches_loader,
    users_order,
)
from shardkit.accelerate_compat.state import (
    AcceleratorState,
    DistributedType,
    GradientState,
    ProcessFacts,
    mixed_precision_name,
    remember_plugins,
    use_strategy,
)
from shardkit.accelerate_compat.tracking import AcceleratorTracking
from shardkit.accelerate_compat.training import AcceleratorTraining
from shardkit.accelerate_compat.wrappers import AcceleratedOptimizer, AcceleratedScheduler, PreparedDataLoader
from shardkit.data.loader import ResumableSampler
from shardkit.runner.core import Runner
from shardkit.strategies.base import Strategy

__all__ = ["Accelerator"]

# Constructor arguments of Accelerate that shardkit does not take, and what to do instead.
_REFUSED = {"torch_tp_plugin": "use shardkit.TensorParallel through a shardkit.Runner",
            "megatron_lm_plugin": "Megatron-LM is not supported",
            "dynamo_plugin": "call torch.compile(model) in the script",
            "deepspeed_plugins": "pass one deepspeed_plugin",
            "parallelism_config": "use shardkit.TensorParallel(dp='fsdp') through a shardkit.Runner"}



class Accelerator(ProcessFacts):
    """Accelerate's ``Accelerator`` on shardkit: the same constructor, methods and meanings.

    Args:
        mixed_precision: "no", "fp16" or "bf16" (default: ``ACCELERATE_MIXED_PRECISION``, else the config file
            ``shardkit launch --config_file`` names, else "no"). fp16 scales the loss as torch's GradScaler does.
        gradient_accumulation_steps: micro-batches per optimizer step inside :meth:`accumulate`.
        cpu: run on the CPU even where a GPU is visible.
        dataloader_config: a :class:`DataLoaderConfiguration` (``split_batches``, ``data_seed`` ...).
        deepspeed_plugin: a DeepSpeed config dict, a dict of ``DeepSpeedPlugin``'s fields (``zero_stage``,
            ``offload_optimizer_device`` ...) or ``accelerate.utils.DeepSpeedPlugin``: the ZeRO strategies.
        fsdp_plugin: a dict of Accelerate's ``fsdp_config`` keys or ``FullyShardedDataParallelPlugin``'s fields,
            or that plugin: :class:`shardkit.FSDP`. Without either, under ``accelerate launch``, the FSDP or
            DeepSpeed settings its variables carry (:mod:`shardkit.config.accelerate_env`), or a refusal naming
            the variable shardkit cannot honour.
        log_with: tracker names of :data:`~shardkit.observability.trackers.TRACKERS` ("jsonl", "tensorboard", "all") or
            objects.
        project_dir: where automatically named checkpoints and the trackers' files go.
        project_config: a :class:`ProjectConfiguration` (automatic checkpoint naming, total_limit ...).
        gradient_accumulation_plugin: a :class:`GradientAccumulationPlugin` (instead of
            ``gradient_accumulation_steps``).
        step_scheduler_with_optimizer: the prepared scheduler steps only after optimizer steps that were taken.
        kwargs_handlers: ``DistributedDataParallelKwargs``, ``InitProcessGroupKwargs``, ``GradScalerKwargs``,
            ``AutocastKwargs`` (Accelerate's classes or the ones of :mod:`shardkit.accelerate_compat`).
        split_batches, device_placement, rng_types, dynamo_backend: Accelerate's; ``device_placement`` must stay
            True and ``dynamo_backend`` "no"; ``rng_types`` is accepted (the data order depends on the seed and the
            epoch only, so no RNG needs synchronising).

    Attributes:
        runner: the :class:`shardkit.Runner` underneath.
        gradient_state: the accumulation window and the data loader being iterated.
        step: micro-batches counted by :meth:`accumulate` (saved by :meth:`save_state`).

    The Accelerator is composed of parts that own their state, each handed what it needs, and forwards Accelerate's
    methods to them: ``training`` (:class:`~shardkit.accelerate_compat.training.AcceleratorTraining`: backward, the
    window, clipping, collectives), ``checkpoints`` (:class:`~shardkit.accelerate_compat.checkpointing.
    AcceleratorCheckpoints`: ``save_state``/``load_state``, ``save_model``), ``tracking``
    (:class:`~shardkit.accelerate_compat.tracking.AcceleratorTracking`) and ``prepared`` (what ``prepare`` set up).
    """

    def __init__(self, device_placement: bool = True, split_batches: bool | None = None,
                 mixed_precision: str | None = None, gradient_accumulation_steps: int = 1, cpu: bool = False,
                 dataloader_config: DataLoaderConfiguration | None = None, deepspeed_plugin: Any = None,
                 fsdp_plugin: Any = None, rng_types: Any = None, log_with: Any = None, project_dir: str | None = None,
                 project_config: ProjectConfiguration | None = None, gradient_accumulation_plugin: Any = None,
                 step_scheduler_with_optimizer: bool = True, kwargs_handlers: Any = None,
                 dynamo_backend: str | None = None, **unsupported: Any) -> None:
        _refuse(unsupported, device_placement, dynamo_backend)
        check_argument_types(dataloader_config=dataloader_config, project_config=project_config,
                             gradient_accumulation_plugin=gradient_accumulation_plugin, kwargs_handlers=kwargs_handlers,
                             deepspeed_plugin=deepspeed_plugin, fsdp_plugin=fsdp_plugin)
        cpu = bool(cpu) or _env_flag("ACCELERATE_USE_CPU")  # accelerate launch --cpu, as Accelerate reads it
        handlers = read_handlers(kwargs_handlers)
        if "init" in handlers:
            apply_init_kwargs(handlers["init"])
        self.gradient_state = _gradient_state(gradient_accumulation_steps, gradient_accumulation_plugin
                                              or handlers.get("accumulation"))
        self.dataloader_config = _dataloader_config(dataloader_config, split_batches)
        self.project_configuration = project_config if project_config is not None else ProjectConfiguration()
        if project_dir is not None and self.project_configuration.project_dir is None:
            self.project_configuration.set_directories(str(project_dir))
        self.runner = self._build_runner(mixed_precision, cpu, deepspeed_plugin, fsdp_plugin, handlers)
        use_strategy(self.runner.strategy)
        remember_plugins(self._deepspeed_for_state(deepspeed_plugin), fsdp_plugin)
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.rng_types = rng_types
        self.prepared = Prepared()
        self.training = AcceleratorTraining(self.runner, self.gradient_state, self.prepared, self,
                                            handlers.get("autocast"))
        self.tracking = AcceleratorTracking(log_with, self.runner, self.project_configuration, self)
        self.checkpoints = AcceleratorCheckpoints(self.runner, self.prepared, self.project_configuration,
                                                  self.training, self)

    def _build_runner(self, mixed_precision: str | None, cpu: bool, deepspeed_plugin: Any, fsdp_plugin: Any,
                      handlers: dict[str, Any]) -> Runner:
        from shardkit.config.accelerate_env import launcher_read
        from shardkit.config.common import CONFIG_FILE_ENV

        if deepspeed_plugin is not None and fsdp_plugin is not None:
            raise ValueError("Accelerator got both deepspeed_plugin and fsdp_plugin; pass one")
        precision = precision_for(mixed_precision, handlers.get("scaler"))
        ddp = ddp_options(handlers["ddp"]) if "ddp" in handlers else None
        strategy: Strategy | None = None
        config = None
        steps: int | None = self.gradient_state.num_steps
        mixed = mixed_precision_name(precision.compute_dtype) if precision is not None else "no"
        launched = launched_engine(mixed, deepspeed_plugin, fsdp_plugin)
        if launched is not None and launched.kind == "FSDP":
            strategy = launched.strategy
        elif launched is not None or deepspeed_plugin is not None:
            config = launched.deepspeed if launched is not None else deepspeed_config(deepspeed_plugin, mixed)
            if steps == 1 and config.get("gradient_accumulation_steps", "auto") != "auto":
                steps = None  # the DeepSpeed config's count, as Accelerate takes it from the plugin
        elif fsdp_plugin is not None:
            strategy = fsdp_strategy(fsdp_plugin)
        elif os.environ.get(CONFIG_FILE_ENV) is None or (ddp is not None and _world_size() > 1):
            strategy = default_strategy(cpu, ddp)
        keep = self.project_configuration.total_limit if self.project_configuration.automatic_checkpoint_naming \
            else None
        with launcher_read():  # launched_engine has reconciled the launcher's variables with the arguments
            runner = Runner(strategy, precision, config=config, gradient_accumulation_steps=steps,
                            checkpoint_keep_last=keep)
        self._deepspeed_config = config  # as written: DummyOptim/DummyScheduler fill its "auto" params at prepare
        self.gradient_state.num_steps = runner.gradient_accumulation_steps
        return runner

    def _deepspeed_for_state(self, plugin: Any) -> Any:
        """Accelerate's own DeepSpeedPlugin as given; for a DeepSpeed config from a dict, a file or accelerate
        launch's variables, a view with its ``deepspeed_config``."""
        if plugin is not None and not isinstance(plugin, Mapping):
            return plugin
        if self.distributed_type != DistributedType.DEEPSPEED:
            return plugin
        raw = raw_deepspeed_config(self._deepspeed_config, self.runner.config)
        return DeepSpeedConfigView(raw[0]) if raw is not None else plugin

    # ---- facts ------------------------------------------------------------------------------------------

    @property
    @override
    def _strategy(self) -> Strategy:
        return self.runner.strategy

    @property
    def state(self) -> AcceleratorState:
        """Accelerate's ``AcceleratorState`` of this process (shared by every state object)."""
        return AcceleratorState()

    @property
    def mixed_precision(self) -> str:
        """"no", "fp16" or "bf16": the compute dtype of the Runner's precision."""
        return mixed_precision_name(self.runner.precision.compute_dtype)

    @property
    def native_amp(self) -> bool:
        return self.runner.precision.uses_autocast

    @property
    def is_fsdp2(self) -> bool:
        return self.distributed_type == DistributedType.FSDP

    @property
    def deepspeed_plugin(self) -> Any:
        return self.state.deepspeed_plugin

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"gradient_accumulation_steps={steps!r} must be a whole number >= 1")
        self.gradient_state.num_steps = steps
        self.runner.gradient_accumulation_steps = steps

    @property
    def sync_gradients(self) -> bool:
        """Accelerate's meaning: the current micro-batch ends the accumulation window (its backward reduces the
        gradients and ``optimizer.step()`` steps). True outside :meth:`accumulate`; stays True after the step until
        the next ``accumulate()`` entry. NOTE: ``Runner.sync_gradients`` means something else (the last backward
        closed a window and ``runner.step()`` has not run yet)."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = bool(value)

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def dispatch_batches(self) -> bool | None:
        return self.dataloader_config.dispatch_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def use_stateful_dataloader(self) -> bool:
        return self.dataloader_config.use_stateful_dataloader

    # ---- prepare ----------------------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        """Set up models, optimizers, data loaders and schedulers, in any mix and order; returned in that order.

        A model and its optimizer (the one over its parameters) must come in the same call; a scheduler built
        over an optimizer is prepared with it. Anything else is returned unchanged.
        """
        if device_placement is not None and not all(device_placement):
            raise NotImplementedError("prepare(device_placement=False): shardkit always places what it prepares")
        args, built = self._from_deepspeed_sections(args)
        out = list(args)
        kinds = ["scheduler" if id(a) in built else object_kind(a) for a in args]
        for i, kind in enumerate(kinds):
            if kind == "dataloader":  # first: DeepSpeed's engine config takes the micro-batch size from it
                out[i] = self._prepare_loader(args[i])
        optimizers = {i: a for i, a in enumerate(args) if kinds[i] == "optimizer"}
        owners = pair_optimizers([(i, a) for i, a in enumerate(args) if kinds[i] == "model"], optimizers)
        schedulers = {i: a for i, a in enumerate(args) if kinds[i] == "scheduler"}
        prepared_opts: dict[int, AcceleratedOptimizer] = {}
        for i, kind in enumerate(kinds):
            if kind != "model":
                continue
            opt_index = next((o for o, m in owners.items() if m == i), None)
            optimizer = optimizers.get(opt_index)
            scheduler = next((s for s in schedulers.values() if getattr(s, "optimizer", None) is optimizer
                              and optimizer is not None), None)
            out[i], acc = self._prepare_model(args[i], optimizer, scheduler)
            if acc is not None:
                out[opt_index] = prepared_opts[opt_index] = acc
        for i, scheduler in schedulers.items():
            out[i] = self._prepare_scheduler(scheduler, list(prepared_opts.values()))
        return out[0] if len(out) == 1 else tuple(out)

    def _from_deepspeed_sections(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], set[int]]:
        """``args`` with each DummyOptim / DummyScheduler replaced by what the DeepSpeed config's ``optimizer`` /
        ``scheduler`` section describes, and the ids of the schedulers built; a torch optimizer or scheduler where
        the config has that section is refused, as Accelerate does (two would describe one thing)."""
        dummies = [a for a in args if is_dummy_optimizer(a) or is_dummy_scheduler(a)]
        resolved = self.runner.config
        sections = resolved is not None and (resolved.optimizer is not None or resolved.scheduler is not None)
        raw = raw_deepspeed_config(self._deepspeed_config, resolved) if dummies or sections else None
        for section, kind, name in (("optimizer", torch.optim.Optimizer, "DummyOptim"),
                                    ("scheduler", torch.optim.lr_scheduler.LRScheduler, "DummyScheduler")):
            if raw is not None and section in raw[0] and any(isinstance(a, kind) for a in args):
                article = "an" if section == "optimizer" else "a"
                raise ValueError(f"{raw[1]} has {article} {section} section and prepare() got a torch {section} too: "
                                 f"remove the section, or pass shardkit.accelerate_compat.{name} in its place")
        if not dummies:
            return args, set()
        out, real, built = list(args), {}, set()
        for i, arg in enumerate(args):
            if is_dummy_optimizer(arg):
                out[i] = real[id(arg)] = real_optimizer(arg, raw)
        for i, arg in enumerate(args):
            if is_dummy_scheduler(arg):
                optimizer = real.get(id(arg.optimizer))
                if optimizer is None:
                    raise ValueError("a DummyScheduler goes over the DummyOptim passed to the same prepare() call")
                out[i] = real_scheduler(arg, optimizer, raw, self.num_processes, self.split_batches)
                built.add(id(out[i]))
        return tuple(out), built

    def prepare_model(self, model: nn.Module, device_placement: Any = None, evaluation_mode: bool = False) -> nn.Module:
        """Set up a model on its own (for inference, or an optimizer-free model)."""
        return self.prepare(model)

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: Any = None,
                            slice_fn_for_dispatch: Any = None) -> PreparedDataLoader:
        """Set up one data loader (see :meth:`prepare`)."""
        return self.prepare(data_loader)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Any = None) -> Any:
        """Refused on its own: shardkit sets an optimizer up with its model (``prepare(model, optimizer)``)."""
        raise NotImplementedError("prepare_optimizer(optimizer) alone: pass the model and its optimizer to one "
                                  "prepare(model, optimizer) call (ZeRO and FSDP set them up together)")

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap a scheduler over an optimizer prepared earlier."""
        return self.prepare(scheduler)

    def _prepare_loader(self, loader: Any) -> PreparedDataLoader:
        if isinstance(loader, PreparedDataLoader):
            return loader
        seed = self.dataloader_config.data_seed
        seed = seed if seed is not None else default_data_seed()
        even = self.even_batches
        strategy = self.runner.strategy
        if makes_own_batches(loader):  # its batches are dealt whole (Accelerate's BatchSamplerShard)
            base = shard_batches(loader, strategy.data_parallel_size, strategy.data_parallel_rank, self.device, seed,
                                 self.split_batches, even)
            if base.batch_size is not None:
                strategy.set_runner_values(micro_batch_size=base.batch_size)
        else:
            if self.split_batches:
                loader = split_batches_loader(loader, strategy.data_parallel_size)
            base = self.runner.setup_dataloader(loader, seed=seed)
            if isinstance(base.sampler, ResumableSampler):
                base.sampler.even = even
                base.sampler.order_source = users_order(loader, self.use_seedable_sampler)
            elif not even:
                warnings.warn("even_batches=False applies to map-style datasets only: a streamed dataset is dealt item "
                              "by item, its last round completed with repeats", UserWarning, stacklevel=3)
        prepared = PreparedDataLoader(base, self.gradient_state, self.split_batches)
        if getattr(base.sampler, "generator", None) is not None and strategy.world_size > 1:
            prepared.before_epoch = functools.partial(share_generator, strategy, base.sampler.generator)
        self.prepared.dataloaders.append(prepared)
        return prepared

    def _prepare_model(self, model: nn.Module, optimizer: Any, scheduler: Any) -> tuple[nn.Module, Any]:
        models = self.prepared.models
        if any(model is m for m in models):
            if optimizer is not None:
                raise ValueError("the model was prepared before without this optimizer: pass the model and its "
                                 "optimizer to one prepare() call")
            return model, None
        if models and self.distributed_type == DistributedType.DEEPSPEED:
            raise NotImplementedError("one Accelerator prepares one model under DeepSpeed (ZeRO); prepared already: "
                                      f"{type(self.unwrap_model(models[0])).__name__}")
        setup = self.runner.setup(model, optimizer, scheduler)
        prepared, inner = (setup[0], setup[1]) if isinstance(setup, tuple) else (setup, None)
        # Accelerate reduces on every backward unless no_sync/accumulate say otherwise (the Runner's setup syncs
        # only at the end of its own window).
        self.runner.strategy.set_gradient_sync(prepared, True)
        models.append(prepared)
        if inner is None:
            return prepared, None
        acc = AcceleratedOptimizer(inner, self.training)
        self.prepared.add_optimizer(acc, prepared)
        return prepared, acc

    def _prepare_scheduler(self, scheduler: Any, prepared: list[AcceleratedOptimizer]) -> AcceleratedScheduler:
        if isinstance(scheduler, AcceleratedScheduler):
            return scheduler
        target = getattr(scheduler, "optimizer", None)
        optimizers = [o for o in self.prepared.optimizers if o is target or o.optimizer is target] or list(prepared)
        wrapped = AcceleratedScheduler(scheduler, optimizers, self, self.step_scheduler_with_optimizer,
                                       self.split_batches)
        self.prepared.schedulers.append(wrapped)
        return wrapped

    # ---- models -----------------------------------------------------------------------------------------

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> nn.Module:
        """The user's module inside the strategy's wrapper (DDP, DeepSpeed's engine).

        Args:
            keep_fp32_wrapper: False removes the mixed-precision autocast that ``prepare`` put on ``forward``.
            keep_torch_compile: False returns the module inside ``torch.compile``'s wrapper.
        """
        module = self.runner.unwrap_model(model)
        if not keep_torch_compile:
            module = getattr(module, "_orig_mod", module)
        for candidate in (model, module):
            forward = candidate.__dict__.get("forward")
            if not keep_fp32_wrapper and forward is not None and hasattr(forward, "__wrapped__"):
                del candidate.forward  # the class's forward again, without the autocast
        return module

    def free_memory(self, *objects: Any) -> list[None]:
        """Drop every reference to what was prepared (here and in the Runner) and collect garbage, between two
        trainings in one process; returns as many ``None`` as objects were given, for ``a, b = free_memory(a, b)``."""
        self.prepared.clear()
        self.runner.release()
        self.step = 0
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None] * len(objects)

    def clear(self, *objects: Any) -> list[None]:
        """Alias of :meth:`free_memory`."""
        return self.free_memory(*objects)

    # ---- Accelerate's methods, forwarded to the parts ----------------------------------------------------

    step = part_attribute("training", "step", "Micro-batches counted by :meth:`accumulate` (saved by "
                          ":meth:`save_state`).", settable=True)
    backward = forward_to("training", AcceleratorTraining.backward)
    accumulate = forward_to("training", AcceleratorTraining.accumulate)
    no_sync = forward_to("training", AcceleratorTraining.no_sync)
    trigger_sync_in_backward = forward_to("training", AcceleratorTraining.trigger_sync_in_backward)
    optimizer_step_was_skipped = part_attribute("training", "optimizer_step_was_skipped",
                                                AcceleratorTraining.optimizer_step_was_skipped.__doc__)
    unscale_gradients = forward_to("training", AcceleratorTraining.unscale_gradients)
    clip_grad_norm_ = forward_to("training", AcceleratorTraining.clip_grad_norm_)
    clip_grad_value_ = forward_to("training", AcceleratorTraining.clip_grad_value_)
    gather = forward_to("training", AcceleratorTraining.gather)
    reduce = forward_to("training", AcceleratorTraining.reduce)
    pad_across_processes = forward_to("training", AcceleratorTraining.pad_across_processes)
    gather_for_metrics = forward_to("training", AcceleratorTraining.gather_for_metrics)
    set_trigger = forward_to("training", AcceleratorTraining.set_trigger)
    check_trigger = forward_to("training", AcceleratorTraining.check_trigger)
    join_uneven_inputs = forward_to("training", AcceleratorTraining.join_uneven_inputs)
    autocast = forward_to("training", AcceleratorTraining.autocast)

    project_dir = part_attribute("checkpoints", "project_dir")
    logging_dir = part_attribute("checkpoints", "logging_dir")
    save_iteration = part_attribute("checkpoints", "save_iteration", AcceleratorCheckpoints.save_iteration.__doc__)
    register_for_checkpointing = forward_to("checkpoints", AcceleratorCheckpoints.register_for_checkpointing)
    save_state = forward_to("checkpoints", AcceleratorCheckpoints.save_state)
    load_state = forward_to("checkpoints", AcceleratorCheckpoints.load_state)
    skip_first_batches = forward_to("checkpoints", AcceleratorCheckpoints.skip_first_batches)
    get_state_dict = forward_to("checkpoints", AcceleratorCheckpoints.get_state_dict)
    save_model = forward_to("checkpoints", AcceleratorCheckpoints.save_model)
    save = forward_to("checkpoints", AcceleratorCheckpoints.save)

    log_with = part_attribute("tracking", "log_with", "The trackers named or given in ``log_with``.")
    trackers = part_attribute("tracking", "trackers", "The trackers started by :meth:`init_trackers` (main process).",
                              settable=True)
    init_trackers = forward_to("tracking", AcceleratorTracking.init_trackers)
    get_tracker = forward_to("tracking", AcceleratorTracking.get_tracker)
    log = forward_to("tracking", AcceleratorTracking.log)
    end_training = forward_to("tracking", AcceleratorTracking.end_training)

    def __repr__(self) -> str:
        return f"Accelerator(runner={self.runner!r}, gradient_accumulation_steps={self.gradient_accumulation_steps})"


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed ``random``, numpy and torch (every device), as ``accelerate.utils.set_seed``; loaders prepared afterwards
    shuffle with this seed too (unless ``DataLoaderConfiguration(data_seed=...)`` says otherwise).

    Args:
        device_specific: add the process index, so that each process draws differently.
        deterministic: use torch's deterministic algorithms.
    """
    from shardkit.utils.seeding import seed_everything

    remember_data_seed(seed)
    if device_specific:
        import torch.distributed as dist

        seed += dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    seed_everything(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


# ---- helpers --------------------------------------------------------------------------------------------

def _refuse(unsupported: dict[str, Any], device_placement: bool, dynamo_backend: str | None) -> None:
    for key, value in unsupported.items():
        if key == "downcast_bf16":
            if value:  # Accelerate reads it on TPUs only and ignores it elsewhere; so does shardkit, with a note
                from shardkit.config.common import warn_once

                warn_once("accelerator:downcast_bf16", "Accelerator(downcast_bf16=True) has no effect: it is a TPU "
                          "(XLA) option; on CPUs and GPUs mixed_precision='bf16' needs nothing more")
            continue
        if key not in _REFUSED:
            from shardkit.utils.suggest import did_you_mean

            known = [*_REFUSED, "downcast_bf16", "mixed_precision", "gradient_accumulation_steps"]
            raise TypeError(f"Accelerator() got an unexpected keyword argument {key!r}{did_you_mean(key, known)}")
        if value not in (None, False):
            raise NotImplementedError(f"Accelerator({key}=...) is not supported by shardkit; {_REFUSED[key]}")
    if device_placement is not True:
        raise NotImplementedError("Accelerator(device_placement=False): shardkit always places what it prepares")
    if dynamo_backend is not None and str(getattr(dynamo_backend, "value", dynamo_backend)).lower() != "no":
        raise NotImplementedError(f"Accelerator(dynamo_backend={dynamo_backend!r}): shardkit does not compile the "
                                  f"model for you; call torch.compile(model) in the script")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _gradient_state(steps: int, plugin: Any) -> GradientState:
    if plugin is not None:
        if steps != 1:
            raise ValueError("give gradient_accumulation_steps or gradient_accumulation_plugin, not both")
        fields = {k: getattr(plugin, k) for k in ("num_steps", "adjust_scheduler", "sync_with_dataloader",
                                                  "sync_each_batch") if hasattr(plugin, k)}
    else:
        fields = {"num_steps": steps}
    if fields.get("num_steps") is None or (plugin is None and steps == 1):
        text = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "").strip()
        if text and not text.isdigit():
            raise ValueError(f"ACCELERATE_GRADIENT_ACCUMULATION_STEPS={text!r} (set by accelerate launch) must be a "
                             f"whole number >= 1")
        fields["num_steps"] = int(text) if text else fields.get("num_steps") or 1
    steps = fields["num_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"gradient_accumulation_steps={steps!r} must be a whole number >= 1")
    return GradientState(**fields)


def _dataloader_config(config: Any, split_batches: bool | None) -> Any:
    config = config if config is not None else DataLoaderConfiguration()
    if split_batches is not None:
        config.split_batches = bool(split_batches)
    return config


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
