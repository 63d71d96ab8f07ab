"""Trainer: Hugging Face's Trainer API on shardkit's Runner, with exact loss, O(1) resume and lean evaluation.

    trainer = Trainer(model, TrainingArguments(output_dir="out", gradient_accumulation_steps=4),
                      train_dataset=train, eval_dataset=val, compute_metrics=accuracy)
    trainer.train(resume_from_checkpoint=True)

The Trainer is composed of objects that own their state, each handed what it needs: the loop
(:class:`TrainLoop`: epochs, windows, logging and saving between steps), the loss settings
(:class:`LossSettings`), :class:`LossTracker`, :class:`StopRequests`, :class:`Checkpointer` (the files),
:class:`MemoryTracker` (memory metrics) and :class:`Prepared` (what setup made). Hugging Face's method names stay
on the Trainer, where subclasses override them: this module's, and those of ``train_loop``, ``training_step`` and
``evaluation`` (mixins that keep no state of their own); the metrics files are ``metrics_io``'s functions.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from shardkit.config.accelerate_env import asks_for_deepspeed
from shardkit.data.streaming import is_stream
from shardkit.strategies.activation_checkpointing import enable_gradient_checkpointing
from shardkit.strategies.facts import StrategyFamily
from shardkit.trainer import hub, metrics_io
from shardkit.trainer.arguments import TrainingArguments, UnknownArgumentError
from shardkit.trainer.callbacks import CallbackHandler, DefaultFlowCallback, PrinterCallback, ProgressCallback
from shardkit.trainer.checkpointing import Checkpointer, CheckpointParts
from shardkit.trainer.collate import ColumnFilter, check_columns, default_collator, loader_kwargs
from shardkit.trainer.engine import (
    build_runner,
    create_optimizer,
    create_scheduler,
    decay_parameter_names,
    estimate_steps,
    steps_per_epoch,
    total_steps,
)
from shardkit.trainer.evaluation import EvaluationMixin
from shardkit.trainer.loss import LossMode, LossSettings, accepts
from shardkit.trainer.loss_tracker import LossTracker
from shardkit.trainer.memory import MemoryTracker
from shardkit.trainer.model_prep import apply_model_prep
from shardkit.trainer.peft_support import base_model_of, is_peft_model, save_peft_model
from shardkit.trainer.reporting import reporter_callbacks
from shardkit.trainer.state import TrainerControl, TrainerState
from shardkit.trainer.stopping import StopRequests
from shardkit.trainer.train_loop import TrainLoop, TrainLoopMixin, TrainOutput
from shardkit.trainer.trainer_logging import follow_transformers_logging, set_trainer_log_level
from shardkit.trainer.training_step import TrainingStepMixin

__all__ = ["Prepared", "Trainer", "TrainOutput"]

logger = logging.getLogger("shardkit.trainer")

# Trainer keywords transformers removed -> what replaced them.
_REMOVED_KEYWORDS = {
    "tokenizer": "it was renamed processing_class (transformers 4.46, removed in 5): Trainer(processing_class=...)",
    "model_path": "transformers removed it: pass resume_from_checkpoint to train()",
}


@dataclass
class Prepared:
    """What :meth:`Trainer.ensure_setup` made with the Runner (once; again after ``model_init`` or a smaller batch).

    Attributes:
        done: the model, optimizer and schedule are set up with the Runner.
        train_loader: the Runner's loader over ``train_dataset`` (it shards, shuffles and resumes).
        per_epoch: optimizer steps per epoch (None for a stream until the run counts max_steps' windows).
        backward_stepper: LOMO, AdaLomo or layer-wise optimizers, which update inside backward; else None.
        metric_scheduler: the schedule steps on an evaluation metric (ReduceLROnPlateau), not per step.
    """

    done: bool = False
    train_loader: Any = None
    per_epoch: int | None = None
    backward_stepper: Any = None
    metric_scheduler: bool = False


class Trainer(TrainLoopMixin, TrainingStepMixin, EvaluationMixin):
    """Runs training, evaluation, checkpointing, logging and callbacks for a model (HF's Trainer API).

    Args:
        model: a torch module or HF PreTrainedModel (or give ``model_init``).
        args: TrainingArguments (default: ``TrainingArguments()``, output in ``trainer_output``).
        data_collator: turns a list of samples into a batch dict (default: pad with ``processing_class`` if it
            can, else Hugging Face's ``default_data_collator``).
        train_dataset, eval_dataset: map-style datasets of dicts; eval_dataset may be a dict of them.
        processing_class: tokenizer/processor, saved with the model and used for padding.
        model_init: a function returning a fresh model; called again (seeded with ``args.seed``) by each train().
        compute_loss_func: ``f(outputs, labels, num_items_in_batch=N)`` returning sum / N (the Trainer owns the loss).
        compute_metrics: ``f(EvalPrediction) -> dict`` (with ``batch_eval_metrics``: ``f(pred, compute_result)``).
        callbacks: TrainerCallback instances or classes added after the defaults.
        optimizers: ``(optimizer, scheduler)`` built over ``model.parameters()``; None builds them from ``args``.
        optimizer_cls_and_kwargs: ``(optimizer class, keyword arguments)`` to build the optimizer with.
        preprocess_logits_for_metrics: ``f(logits, labels)`` applied per batch before predictions are kept.
        strategy, precision: shardkit objects (e.g. ``FSDP()``, ``BF16()``) instead of the HF spellings in args.
    """

    def __init__(self, model=None, args: TrainingArguments | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, model_init=None, compute_loss_func=None,
                 compute_metrics=None, callbacks=None, optimizers=(None, None), optimizer_cls_and_kwargs=None,
                 preprocess_logits_for_metrics=None, *, strategy=None, precision=None, **removed):
        _refuse_removed(removed)
        self.args = args = args if args is not None else TrainingArguments()
        self.memory_tracker = MemoryTracker(args.skip_memory_metrics)
        self.memory_tracker.start("init")
        _check_init(args, optimizers, optimizer_cls_and_kwargs)
        self.model_init = model_init
        if model is None:
            if model_init is None:
                raise ValueError("Trainer needs a model (or model_init, a function that returns one)")
            model = self.call_model_init()
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.data_collator, self.processing_class = data_collator, processing_class
        self.compute_loss_func, self.compute_metrics = compute_loss_func, compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self.label_names = list(args.label_names or ["labels"])
        # for a DeepSpeed config's "auto" values, from the arguments or from accelerate launch
        deepspeed = args.deepspeed or asks_for_deepspeed()
        max_steps, warmup = self.estimate_run_steps(args, train_dataset) if deepspeed else (None, None)
        self.runner, self._deepspeed_sections = build_runner(args, strategy, precision, max_steps, warmup)
        # A subclass's compute_loss with HF's old signature returns a micro-batch mean (checked once, not per step).
        self.loss_settings = LossSettings(self.runner, args.average_tokens_across_devices,
                                          "num_items_in_batch" in inspect.signature(self.compute_loss).parameters)
        self.prepared = Prepared()
        self.is_deepspeed_enabled = self.runner.strategy.family is StrategyFamily.DEEPSPEED
        self.is_fsdp_enabled = self.runner.strategy.family is StrategyFamily.FSDP
        self.set_model(model)
        self._configure_logging()
        self._train_batch_size = args.train_batch_size
        self.state = TrainerState(is_world_process_zero=self.runner.is_main_process,
                                  is_local_process_zero=self.runner.local_rank == 0)
        self.control = TrainerControl()
        self.losses = LossTracker(self.runner, args.average_tokens_across_devices, args.logging_nan_inf_filter)
        self.stop_requests = StopRequests(self.runner, args.save_on_sigterm or args.enable_jit_checkpoint,
                                          args.max_time)
        self.checkpointer = Checkpointer(self.runner, args)
        self.checkpointer.before_delete = lambda path: hub.wait_for_folder(self, path)
        defaults = [DefaultFlowCallback, *reporter_callbacks(args.report_to)]
        defaults.append(PrinterCallback if args.disable_tqdm else ProgressCallback)
        self.callback_handler = CallbackHandler(defaults + list(callbacks or []), self.model, processing_class,
                                                self.optimizer, self.lr_scheduler)
        self.current_flos = 0.0
        self.is_in_train = False
        self.hp_name = None
        self._accelerator = None
        self.loss_settings.window_len = args.gradient_accumulation_steps
        self.loop = TrainLoop(self)
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)
        self.memory_tracker.stop("init")

    # ---- the model -----------------------------------------------------------------------------

    def set_model(self, model) -> None:
        """Train ``model`` (before setup, or from ``model_init``): the loss settings are read from it."""
        apply_model_prep(model, self.args)  # fused kernels, before anything reads the model's forward
        self._user_model = self.model = self.model_wrapped = model
        owns = self.compute_loss_func is not None or self.args.label_smoothing_factor > 0 or \
            not accepts(model, "labels")
        # A PeftModel forwards **kwargs: its base model says what the loss takes.
        self.loss_settings.set_model(base_model_of(model), owns)
        enable_gradient_checkpointing(model, self.args, self.runner)  # an HF model's own, else the Runner's switch

    def call_model_init(self, trial: Any = None):
        """A fresh model from ``model_init`` (with the trial when it takes one)."""
        takes = len(inspect.signature(self.model_init).parameters)
        model = self.model_init(trial) if takes == 1 else self.model_init()
        if model is None:
            raise RuntimeError("model_init returned None: it must return a model")
        return model

    @property
    def model_accepts_loss_kwargs(self) -> bool:
        """Whether the model's forward gets ``num_items_in_batch`` (set False for a forward that takes **kwargs
        but ignores it: its loss is then taken as a micro-batch mean)."""
        return self.loss_settings.mode == LossMode.NUM_ITEMS

    @model_accepts_loss_kwargs.setter
    def model_accepts_loss_kwargs(self, value: bool) -> None:
        settings = self.loss_settings
        if not value and settings.mode == LossMode.NUM_ITEMS:
            settings.mode = LossMode.MEAN
        elif value and settings.mode == LossMode.MEAN and accepts(self._user_model, "num_items_in_batch"):
            settings.mode = LossMode.NUM_ITEMS

    @property
    def deepspeed(self) -> Any:
        """The DeepSpeed engine under a ZeRO strategy once set up (``trainer.deepspeed.save_checkpoint(dir)``);
        None otherwise."""
        if self.is_deepspeed_enabled and self.prepared.done:
            return self.model_wrapped
        return None

    @property
    def deepspeed_config(self) -> Any:
        """The DeepSpeed config the ZeRO strategy built (None under other strategies)."""
        builder = getattr(self.runner.strategy, "deepspeed_config", None)
        return builder(self.runner.unwrap_model(self.model)) if callable(builder) else None

    @property
    def accelerator(self):
        """Answers what scripts ask Hugging Face's Accelerate object (see :class:`AcceleratorView`)."""
        if self._accelerator is None:
            from shardkit.trainer.accelerator import AcceleratorView

            self._accelerator = AcceleratorView(self)
        return self._accelerator

    # ---- setup ---------------------------------------------------------------------------------

    def _configure_logging(self) -> None:
        level = self.args.get_process_log_level() if self.args.log_level != "passive" or not self.args.should_log \
            else None
        if level is not None:
            set_trainer_log_level(level)
        else:
            follow_transformers_logging()

    def _collator_for(self, dataset: Any):
        base = self.data_collator or default_collator(self.processing_class)
        if not self.args.remove_unused_columns:
            return base
        model = self.runner.unwrap_model(self.model) if self.prepared.done else self._user_model
        check_columns(dataset, base_model_of(model), self.label_names)
        return ColumnFilter(base, base_model_of(model), self.label_names)

    def get_train_dataloader(self) -> DataLoader:
        """A plain DataLoader over train_dataset; the Runner shards, shuffles and resumes it. A stream (an
        ``IterableDataset``) is read in its own order, as Hugging Face's Trainer reads it: shuffle it at the
        source (``dataset.shuffle(buffer_size=...)``)."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset")
        shuffle = self.args.train_sampling_strategy == "random"
        if shuffle and is_stream(self.train_dataset):
            logger.info("train_dataset is a stream: read in its own order (train_sampling_strategy='random' applies "
                        "to datasets with random access; shuffle a stream at its source)")
            shuffle = False
        return DataLoader(self.train_dataset, batch_size=self._train_batch_size, shuffle=shuffle,
                          collate_fn=self._collator_for(self.train_dataset), drop_last=self.args.dataloader_drop_last,
                          **loader_kwargs(self.args))

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """The evaluation loader for ``eval_dataset`` (default: ``self.eval_dataset``; a key of it when it is a
        dict), sharded across ranks; override to change it."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, str):
            dataset = self.eval_dataset[dataset]
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset")
        return self._eval_loader(dataset)

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """The prediction loader for ``test_dataset``, sharded across ranks; override to change it."""
        return self._eval_loader(test_dataset)

    def _eval_loader(self, dataset: Any):
        # Set up anew for each run: gather_for_metrics drops the duplicates of the loader set up last (a stream's
        # too: the repeats padding its last round, known when its last batch is).
        loader = DataLoader(dataset, batch_size=self.args.eval_batch_size, shuffle=False,
                            collate_fn=self._collator_for(dataset), drop_last=False, **loader_kwargs(self.args))
        return self.runner.setup_dataloader(loader)

    def estimate_run_steps(self, args: TrainingArguments, train_dataset: Any) -> tuple[int | None, int | None]:
        """(max steps, warmup steps) before the Runner exists, for a DeepSpeed config's "auto" values. A subclass
        that prepares its rows itself (and hands this class none) answers from the rows it trains on."""
        return estimate_steps(args, train_dataset)

    def ensure_setup(self) -> None:
        """Set up loader, model, optimizer and schedule with the Runner, once (train() or evaluate() first)."""
        prepared = self.prepared
        if prepared.done:
            return
        from shardkit.trainer.backward_step import backward_stepper
        from shardkit.trainer.model_prep import maybe_compile
        from shardkit.trainer.optim_modes import check_optimizer_strategy
        from shardkit.trainer.schedulers import is_metric_driven

        args, runner = self.args, self.runner
        max_steps = args.max_steps if args.max_steps > 0 else 0
        if self.train_dataset is not None:
            # The train loader first: DeepSpeed's engine needs the micro-batch size at setup.
            prepared.train_loader = self._setup_train_loader()
            max_steps = total_steps(args, prepared.per_epoch)[0]
        model = maybe_compile(self._user_model, args)  # in place, the last change before setup
        if self.train_dataset is not None or self.optimizer is not None:
            optimizer = self.create_optimizer()
            prepared.backward_stepper = backward_stepper(optimizer, runner, args)  # LOMO, AdaLomo, layer-wise
            check_optimizer_strategy(optimizer, runner.strategy)
            scheduler = self.create_scheduler(max(max_steps, 1), optimizer)
            prepared.metric_scheduler = is_metric_driven(scheduler)
            if prepared.metric_scheduler:  # stepped on an eval metric by the Trainer, not per step by the Runner
                self.model, self.optimizer = runner.setup(model, optimizer)
            else:
                self.model, self.optimizer, scheduler = runner.setup(model, optimizer, scheduler)
            self.lr_scheduler = scheduler
            if prepared.backward_stepper is not None:  # under DDP: the hooks average gradients, not DDP
                prepared.backward_stepper.setup(self.model)
        else:
            self.model = runner.setup(model)
        self.model_wrapped = self.model
        self.model = runner.unwrap_model(self.model_wrapped)
        if "underflow_overflow" in args.debug:
            from shardkit.trainer.model_prep import install_overflow_check

            install_overflow_check(self.model)
        handler = self.callback_handler
        handler.model, handler.optimizer, handler.lr_scheduler = self.model, self.optimizer, self.lr_scheduler
        handler.train_dataloader = prepared.train_loader
        prepared.done = True

    def _setup_train_loader(self):
        loader = self.get_train_dataloader()
        if not isinstance(loader, DataLoader):
            raise TypeError(f"get_train_dataloader() returned a {type(loader).__name__}: shardkit's Trainer shards "
                            "and resumes a torch DataLoader (built with batch_size=...); return one")
        loader = self.runner.setup_dataloader(loader)
        try:
            self.prepared.per_epoch = steps_per_epoch(len(loader), self.args.gradient_accumulation_steps)
        except TypeError:  # a stream (shardkit.data.streaming): max_steps bounds the run, as in Hugging Face's Trainer
            self.prepared.per_epoch = None
        return loader

    def refresh_train_loader(self) -> None:
        """Build the train loader again once set up (a new ``_train_batch_size``); the callbacks see the new one."""
        if self.prepared.done and self.train_dataset is not None:
            self.prepared.train_loader = self._setup_train_loader()
            self.callback_handler.train_dataloader = self.prepared.train_loader

    # ---- optimizer and schedule ---------------------------------------------------------------

    def create_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer (``optimizers=``, ``optimizer_cls_and_kwargs``, ``args.optim`` or the DeepSpeed config's),
        built once over the model's trainable parameters in Hugging Face's two weight-decay groups."""
        if self.optimizer is None:
            model = self._user_model if not self.prepared.done else self.model
            self.optimizer = create_optimizer(model, self.args, self._deepspeed_sections, self.optimizer_cls_and_kwargs)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """The schedule ``args.lr_scheduler_type`` names (with warmup), built once."""
        if self.lr_scheduler is None:
            target = optimizer if optimizer is not None else self.optimizer
            if target is None:
                raise ValueError("create_scheduler() needs the optimizer: call create_optimizer() first")
            self.lr_scheduler = create_scheduler(target, self.args, self._deepspeed_sections, num_training_steps)
        return self.lr_scheduler

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        """:meth:`create_optimizer` then :meth:`create_scheduler` over ``num_training_steps``."""
        self.create_optimizer()
        self.create_scheduler(num_training_steps, self.optimizer)

    def get_decay_parameter_names(self, model) -> list[str]:
        """Names of the parameters that get weight decay (Hugging Face's rule: no biases, no norms)."""
        names = decay_parameter_names(model)
        return [n for n, _ in model.named_parameters() if n in names]

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: TrainingArguments, model: Any = None) -> tuple[Any, dict[str, Any]]:
        """(a factory ``f(params, **kwargs)`` building ``args.optim``, its keyword arguments from ``args``)."""
        import functools

        from shardkit.optim import create_optimizer as by_name

        kwargs: dict[str, Any] = {"lr": args.learning_rate}
        if "adam" in args.optim:
            kwargs.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
        kwargs.update(args.optim_args)
        context = {"model": model, "training_args": args, "optim_target_modules": args.optim_target_modules}
        return functools.partial(by_name, args.optim, context=context), kwargs

    def get_learning_rates(self) -> list[float]:
        """The learning rate of each param group now."""
        if self.optimizer is None:
            raise ValueError("Trainer optimizer is None: create it first (create_optimizer() or train())")
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_optimizer_group(self, param: Any = None) -> Any:
        """The param group holding ``param``, or every group's parameter list when ``param`` is None."""
        if self.optimizer is None:
            raise ValueError("Trainer optimizer is None: create it first (create_optimizer() or train())")
        if param is not None:
            for group in self.optimizer.param_groups:
                if any(p is param for p in group["params"]):
                    return group
        return [group["params"] for group in self.optimizer.param_groups]

    def get_num_trainable_parameters(self) -> int:
        """Elements of the trainable parameters (whole sizes, under every strategy)."""
        numel = self.runner.strategy.parameter_numel
        return sum(numel(p) for p in self.model.parameters() if p.requires_grad)

    def get_total_train_batch_size(self, args: TrainingArguments | None = None) -> int:
        """Samples per optimizer step over all ranks: micro-batch x accumulation x data-parallel ranks."""
        args = args or self.args
        return self._train_batch_size * args.gradient_accumulation_steps * self.runner.strategy.data_parallel_size

    def get_tp_size(self) -> int:
        """Tensor-parallel degree: the strategy's ``tp`` (TensorParallel, ContextParallel with tp_size), else 1."""
        return self._parallel_degree("tp")

    def get_cp_size(self) -> int:
        """Context-parallel degree: the strategy's ``cp`` (ContextParallel), else 1."""
        return self._parallel_degree("cp")

    def _parallel_degree(self, name: str) -> int:
        """One dimension of the strategy's ParallelDims mesh (1 for strategies without one, e.g. DDP or ZeRO)."""
        dims = getattr(self.runner.strategy, "dims", None)
        return int(getattr(dims, name, 1) or 1)

    def get_sp_size(self) -> int:
        """Sequence-parallel degree over the batch (Hugging Face's ALST): shardkit has none, so 1."""
        return 1

    # ---- callbacks and process facts ----------------------------------------------------------

    def add_callback(self, callback) -> None:
        """Add a TrainerCallback (instance or class)."""
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        """Remove and return a callback (instance, or the first of a class)."""
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback) -> None:
        """Remove a callback (instance, or the first of a class)."""
        self.callback_handler.remove_callback(callback)

    def is_world_process_zero(self) -> bool:
        """Whether this is the job's main process."""
        return self.runner.is_main_process

    def is_local_process_zero(self) -> bool:
        """Whether this is its machine's main process."""
        return self.runner.local_rank == 0

    def num_examples(self, dataloader: Any) -> int:
        """Samples in a loader's dataset (a stream's: the loader's batches times its batch size, as HF counts)."""
        try:
            return len(dataloader.dataset)
        except TypeError:
            batch = getattr(dataloader, "batch_size", None) or 1
            return self.args.max_steps * self.args.gradient_accumulation_steps * batch

    def floating_point_ops(self, inputs: Mapping[str, Any]) -> int:
        """Floating-point operations of one forward+backward on ``inputs`` (the model's own estimate, else 0)."""
        estimate = getattr(self.model, "floating_point_ops", None)
        return int(estimate(inputs)) if callable(estimate) else 0

    def store_flos(self) -> None:
        """Add the operations counted since the last call, over every rank, to ``state.total_flos``."""
        flos = torch.tensor([float(self.current_flos)], dtype=torch.float64, device=self.runner.device)
        if self.runner.world_size > 1:
            flos = self.runner.all_reduce(flos, "sum")
        self.state.total_flos += float(flos.item())
        self.current_flos = 0.0

    def compute_loss_context_manager(self):
        """Context around each loss computation (the Runner already runs forward in the precision's autocast)."""
        return contextlib.nullcontext()

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True):
        """The precision's autocast (the Runner applies it to forward already)."""
        return self.runner.autocast()

    def create_accelerator_and_postprocess(self) -> None:
        """Nothing to do: the Runner (strategy and precision) is built with the Trainer."""

    def hyperparameter_search(self, *args: Any, **kwargs: Any) -> Any:
        """Not available: run your search (optuna, ray) around ``Trainer(model_init=...)`` and ``train()``."""
        raise NotImplementedError("shardkit's Trainer has no hyperparameter_search: run the search loop (optuna, "
                                  "ray tune) yourself around Trainer(model_init=..., args=...) and trainer.train()")

    def end(self) -> None:
        """Finish: release the process group and anything the strategy holds (call once, at the end)."""
        self.runner.teardown()

    # ---- saving the model and pushing ----------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False,
                   merge_adapters: bool = False) -> None:
        """Save the model for inference in Hugging Face's format (``from_pretrained`` loads it): config.json and
        safetensors streamed from the (sharded) model one module at a time, plus the processing class.

        A peft ``PeftModel`` (LoRA) saves its adapters only (``adapter_model.safetensors`` + ``adapter_config.json``,
        for ``PeftModel.from_pretrained``); ``merge_adapters=True`` writes the base model with the adapters merged
        in, in HF format (``from_pretrained`` loads it without peft). Call on every rank."""
        from shardkit.trainer.export import save_full_model
        from shardkit.trainer.optim_modes import to_eval

        self.ensure_setup()
        to_eval(self)  # schedule-free: export the averaged weights
        output_dir = output_dir or self.args.output_dir
        if is_peft_model(self.runner.unwrap_model(self.model_wrapped)):
            save_peft_model(self.runner, self.model_wrapped, output_dir, merge_adapters, self.processing_class,
                            self.args)
            return
        if merge_adapters:
            raise ValueError(f"save_model(merge_adapters=True) merges LoRA adapters into the base model, but the model "
                             f"is a {type(self.model).__name__}, not a peft PeftModel")
        save_full_model(self.runner, self.model_wrapped, output_dir, self.processing_class, self.args,
                        self.data_collator)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, **kwargs: Any) -> Any:
        """Upload ``output_dir`` to ``hub_model_id`` (see :mod:`shardkit.trainer.hub`)."""
        self.control = self.callback_handler.on_push_begin(self.args, self.state, self.control)
        return hub.push_to_hub(self, commit_message=commit_message, blocking=blocking, token=token,
                               revision=revision, **kwargs)

    def init_hf_repo(self, token: str | None = None) -> None:
        """Create the Hub repository ``hub_model_id`` (see :mod:`shardkit.trainer.hub`)."""
        hub.push_to_hub(self, commit_message=None, token=token)

    def create_model_card(self, language: str | None = None, license: str | None = None,
                          tags: str | list[str] | None = None, model_name: str | None = None,
                          finetuned_from: str | None = None, tasks: str | list[str] | None = None,
                          dataset_tags: str | list[str] | None = None, dataset: str | list[str] | None = None,
                          dataset_args: str | list[str] | None = None) -> None:
        """Write the draft model card ``output_dir/README.md`` as Hugging Face's Trainer does (main process only;
        see :mod:`shardkit.trainer.model_card`)."""
        from shardkit.trainer.model_card import write_model_card

        write_model_card(self, language=language, license=license, tags=tags, model_name=model_name,
                         finetuned_from=finetuned_from, tasks=tasks, dataset_tags=dataset_tags, dataset=dataset,
                         dataset_args=dataset_args)

    # ---- metrics files (Hugging Face's helpers; see metrics_io) --------------------------------------------

    def metrics_format(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """The metrics as people read them: runtimes rounded, memory in MB, flos in GF."""
        return metrics_io.format_metrics(metrics)

    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """Print ``metrics`` under a ``***** <split> metrics *****`` header, on the main process."""
        if self.is_world_process_zero():
            metrics_io.print_metrics(split, self.metrics_format(metrics))

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """Write ``<output_dir>/<split>_results.json`` (and merge into ``all_results.json``), on the main process."""
        if self.is_world_process_zero():
            metrics_io.write_metrics(self.args.output_dir, split, metrics, combined)

    def save_state(self) -> None:
        """Write the TrainerState to ``<output_dir>/trainer_state.json``, on the main process."""
        if self.is_world_process_zero():
            metrics_io.write_state(self.args.output_dir, self.state)

    def checkpoint_parts(self) -> CheckpointParts:
        """What a checkpoint saves and a resume loads (the Checkpointer's view of this Trainer)."""
        return CheckpointParts(self.model_wrapped, self.optimizer, self.lr_scheduler, self.prepared.train_loader,
                               self.state,
                               self.control, self.callback_handler.callbacks, self.losses, self.processing_class,
                               self.data_collator)


def _check_init(args: TrainingArguments, optimizers: tuple[Any, Any], cls_and_kwargs: Any) -> None:
    hub.check_push_settings(args)
    if args.train_sampling_strategy == "group_by_length":
        raise ValueError("train_sampling_strategy='group_by_length' is not supported: shardkit's data loader "
                         "shards and resumes by sample position; use 'random' (the default) or 'sequential'")
    if cls_and_kwargs is not None and any(o is not None for o in optimizers):
        raise ValueError("Trainer got both optimizers=(optimizer, scheduler) and optimizer_cls_and_kwargs: pass "
                         "one of them")


def _refuse_removed(removed: dict[str, Any]) -> None:
    for key in removed:
        if key in _REMOVED_KEYWORDS:
            raise UnknownArgumentError(f"Trainer({key}=...): {_REMOVED_KEYWORDS[key]}")
        from shardkit.utils.suggest import did_you_mean

        known = [p for p in inspect.signature(Trainer.__init__).parameters if p not in ("self", "removed")]
        raise UnknownArgumentError(f"Trainer got an unknown argument {key!r}{did_you_mean(key, known)}")

