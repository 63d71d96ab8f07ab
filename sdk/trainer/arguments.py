"""TrainingArguments: Hugging Face's names and defaults, checked when built, with errors that name the fix."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from dataclasses import dataclass, field
from typing import Any

from shardkit.suggest import did_you_mean

__all__ = ["TrainingArguments", "IntervalStrategy", "SaveStrategy", "SCHEDULER_TYPES", "REPORTERS"]

IntervalStrategy = ("no", "steps", "epoch")
SaveStrategy = ("no", "steps", "epoch", "best")
SCHEDULER_TYPES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                   "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr", "warmup_stable_decay")
REPORTERS = ("none", "all", "jsonl", "tensorboard")
LOG_LEVELS = ("passive", "debug", "info", "warning", "error", "critical")


def _choice(name: str, value: Any, valid: tuple[str, ...]) -> str:
    value = str(value).lower() if value is not None else value
    if value not in valid:
        raise ValueError(f"TrainingArguments.{name}={value!r} is not valid{did_you_mean(str(value), valid)} "
                         f"Use one of {list(valid)}")
    return value


@dataclass
class TrainingArguments:
    """The settings of a :class:`~shardkit.trainer.Trainer` run, with Hugging Face's field names and defaults.

    Beyond Hugging Face: ``max_time`` (seconds of wall clock, then save and stop), ``save_on_sigterm``
    (a SIGTERM saves a checkpoint that resumes exactly, then stops), ``fast_dev_run`` (run that many
    training and eval batches, no saves), and ``report_to="jsonl"``.

    Build it directly, from command-line flags (:meth:`from_cli`), or from a JSON/YAML file
    (:meth:`from_file`). Contradictory settings raise ValueError naming the fields and the fix.
    """

    output_dir: str = "trainer_output"
    do_train: bool = False
    do_eval: bool = False
    do_predict: bool = False
    eval_strategy: str = "no"
    prediction_loss_only: bool = False
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    eval_accumulation_steps: int | None = None
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    num_train_epochs: float = 3.0
    max_steps: int = -1
    lr_scheduler_type: str = "linear"
    lr_scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    warmup_ratio: float = 0.0
    warmup_steps: int = 0
    log_level: str = "passive"
    log_level_replica: str = "warning"
    log_on_each_node: bool = True
    logging_dir: str | None = None
    logging_strategy: str = "steps"
    logging_first_step: bool = False
    logging_steps: float = 500
    logging_nan_inf_filter: bool = True
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    save_only_model: bool = False
    seed: int = 42
    data_seed: int | None = None
    bf16: bool = False
    fp16: bool = False
    tf32: bool | None = None
    eval_steps: float | None = None
    eval_on_start: bool = False
    eval_delay: float = 0
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = True
    dataloader_drop_last: bool = False
    dataloader_persistent_workers: bool = False
    dataloader_prefetch_factor: int | None = None
    run_name: str | None = None
    disable_tqdm: bool | None = None
    remove_unused_columns: bool = True
    label_names: list[str] | None = None
    load_best_model_at_end: bool = False
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    ignore_data_skip: bool = False
    fsdp: str | list[str] | bool = ""
    fsdp_config: dict[str, Any] | str | None = None
    deepspeed: str | dict[str, Any] | None = None
    label_smoothing_factor: float = 0.0
    optim: str = "adamw_torch_fused"
    optim_args: dict[str, Any] = field(default_factory=dict)
    optim_target_modules: str | list[str] | None = None  # GaLore's nn.Linear targets: names, a regex or "all-linear"
    report_to: str | list[str] = "none"
    resume_from_checkpoint: str | None = None
    gradient_checkpointing: bool = False
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = None  # torch checkpoint kwargs; use_reentrant
    batch_eval_metrics: bool = False
    average_tokens_across_devices: bool = True
    include_num_input_tokens_seen: bool = False
    max_time: float | None = None
    save_on_sigterm: bool = True
    fast_dev_run: int = 0
    neftune_noise_alpha: float | None = None  # NEFTune: embedding noise alpha/sqrt(L*d) in training (5 to 15)
    use_fused_kernels: bool = False  # patch an HF model with shardkit.nn.apply_fused_kernels before setup
    use_liger_kernel: bool = False  # Hugging Face's name for use_fused_kernels
    liger_kernel_config: dict[str, Any] | None = None  # Liger's switches: rope, swiglu, rms_norm, fused_linear_ce..
    torch_compile: bool = False  # compile the model in place (nn.Module.compile) before setup
    torch_compile_backend: str | None = None  # default "inductor"; setting it implies torch_compile
    torch_compile_mode: str | None = None  # inductor's mode; setting it implies torch_compile

    def __post_init__(self) -> None:
        self.output_dir = str(self.output_dir)
        self._check_choices()
        self._check_numbers()
        self._check_eval_and_save()
        self._check_precision_and_engines()
        _check_model_prep(self)  # neftune, fused kernels and torch_compile fields (shardkit.trainer.model_prep)
        _check_gradient_checkpointing(self)  # gradient_checkpointing_kwargs (shardkit.nn.checkpointing)
        if self.run_name is None:
            self.run_name = self.output_dir
        if self.logging_dir is None:
            self.logging_dir = f"{self.output_dir}/runs"

    # ---- validation -----------------------------------------------------------------------------

    def _check_choices(self) -> None:
        self.eval_strategy = _choice("eval_strategy", self.eval_strategy, IntervalStrategy)
        self.logging_strategy = _choice("logging_strategy", self.logging_strategy, IntervalStrategy)
        self.save_strategy = _choice("save_strategy", self.save_strategy, SaveStrategy)
        self.lr_scheduler_type = _choice("lr_scheduler_type", self.lr_scheduler_type, SCHEDULER_TYPES)
        self.log_level = _choice("log_level", self.log_level, LOG_LEVELS)
        self.log_level_replica = _choice("log_level_replica", self.log_level_replica, LOG_LEVELS)
        if isinstance(self.report_to, str):
            self.report_to = [self.report_to]
        self.report_to = [_choice("report_to", r, REPORTERS) for r in self.report_to]
        if "all" in self.report_to:
            self.report_to = ["jsonl"] + (["tensorboard"] if _has_tensorboard() else [])
        self.report_to = [r for r in self.report_to if r != "none"]
        if "tensorboard" in self.report_to and not _has_tensorboard():
            raise ValueError("report_to includes 'tensorboard' but the `tensorboard` package is not installed: "
                             "pip install tensorboard, or use report_to='jsonl'")
        if isinstance(self.lr_scheduler_kwargs, str):
            self.lr_scheduler_kwargs = _json_field("lr_scheduler_kwargs", self.lr_scheduler_kwargs)
        if isinstance(self.optim_args, str) or self.optim_args is None:
            from shardkit.optim.named import parse_optim_args  # JSON or HF's "rank=64,scale=0.25"

            self.optim_args = parse_optim_args(self.optim_args)
        if not isinstance(self.optim_target_modules, (str, list, tuple, type(None))) or (
                isinstance(self.optim_target_modules, (list, tuple))
                and not all(isinstance(t, str) for t in self.optim_target_modules)):
            raise ValueError(f"TrainingArguments.optim_target_modules={self.optim_target_modules!r} must be a list "
                             "of module names, a regex string or 'all-linear'")

    def _check_numbers(self) -> None:
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"TrainingArguments.{name}={getattr(self, name)} must be >= 1")
        if self.eval_accumulation_steps is not None and self.eval_accumulation_steps < 1:
            raise ValueError(f"eval_accumulation_steps={self.eval_accumulation_steps} must be >= 1 or None")
        if self.learning_rate < 0 or self.weight_decay < 0:
            raise ValueError(f"learning_rate={self.learning_rate} and weight_decay={self.weight_decay} must be >= 0")
        if not 0 <= self.warmup_ratio <= 1:
            raise ValueError(f"warmup_ratio={self.warmup_ratio} must be in [0, 1] (a fraction of the training steps)")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise ValueError(f"max_steps={self.max_steps} and num_train_epochs={self.num_train_epochs}: "
                             "set max_steps > 0 or num_train_epochs > 0")
        if not 0 <= self.label_smoothing_factor < 1:
            raise ValueError(f"label_smoothing_factor={self.label_smoothing_factor} must be in [0, 1)")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise ValueError(f"save_total_limit={self.save_total_limit} must be >= 1 or None (keep all)")
        if self.max_time is not None and self.max_time <= 0:
            raise ValueError(f"max_time={self.max_time} must be a positive number of seconds or None")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed={self.seed} must be in [0, 2**32)")
        for name in ("logging_steps", "save_steps", "eval_steps"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"TrainingArguments.{name}={value} must be > 0 (a step count, or a ratio < 1)")
            if value is not None and value > 1 and value != int(value):
                raise ValueError(f"TrainingArguments.{name}={value}: use an integer step count or a ratio < 1")

    def _check_eval_and_save(self) -> None:
        if self.eval_strategy == "steps" and self.eval_steps is None:
            if self.logging_strategy != "steps":
                raise ValueError("eval_strategy='steps' needs eval_steps (or logging_steps with logging_strategy="
                                 "'steps' as its default): set eval_steps")
            self.eval_steps = self.logging_steps
        if self.save_strategy == "best" and self.metric_for_best_model is None:
            raise ValueError("save_strategy='best' needs metric_for_best_model (e.g. 'loss' or 'eval_accuracy')")
        if self.load_best_model_at_end:
            self._check_best_model()
        if self.lr_scheduler_type == "reduce_lr_on_plateau" and self.eval_strategy == "no":
            raise ValueError("lr_scheduler_type='reduce_lr_on_plateau' steps on an eval metric: set eval_strategy "
                             "to 'steps' or 'epoch'")
        if self.metric_for_best_model is None and (self.load_best_model_at_end
                                                   or self.lr_scheduler_type == "reduce_lr_on_plateau"):
            self.metric_for_best_model = "loss"
        if self.metric_for_best_model is not None and self.greater_is_better is None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")

    def _check_best_model(self) -> None:
        if self.eval_strategy == "no":
            raise ValueError("load_best_model_at_end=True needs evaluations: set eval_strategy to 'steps' or "
                             "'epoch' (the same as save_strategy)")
        if self.save_strategy not in ("best", self.eval_strategy):
            raise ValueError(f"load_best_model_at_end=True needs save_strategy ({self.save_strategy!r}) to match "
                             f"eval_strategy ({self.eval_strategy!r}) or be 'best': set save_strategy="
                             f"{self.eval_strategy!r}")
        if self.save_strategy == "steps" and self.eval_steps is not None:
            eval_steps, save_steps = self.eval_steps, self.save_steps
            if (eval_steps < 1) != (save_steps < 1):
                raise ValueError(f"save_steps={save_steps} and eval_steps={eval_steps} must both be step counts or "
                                 "both ratios when load_best_model_at_end=True")
            if eval_steps >= 1 and int(save_steps) % int(eval_steps):
                raise ValueError(f"load_best_model_at_end=True needs save_steps ({int(save_steps)}) to be a multiple "
                                 f"of eval_steps ({int(eval_steps)}), so every save has an evaluation: set "
                                 f"save_steps={int(eval_steps) * max(1, round(save_steps / eval_steps))}")
            if eval_steps < 1 and not math.isclose(save_steps / eval_steps, round(save_steps / eval_steps)):
                raise ValueError(f"save_steps={save_steps} must be a multiple of eval_steps={eval_steps}")

    def _check_precision_and_engines(self) -> None:
        if self.fp16 and self.bf16:
            raise ValueError("fp16=True and bf16=True: choose one mixed precision")
        if isinstance(self.fsdp, bool):
            self.fsdp = "full_shard" if self.fsdp else ""
        if isinstance(self.fsdp, list):
            self.fsdp = " ".join(self.fsdp)
        if self.fsdp and self.deepspeed:
            raise ValueError("fsdp and deepspeed are both set: choose one engine (drop fsdp= or deepspeed=)")
        options = self.fsdp.split()
        valid = ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard", "offload", "auto_wrap")
        for option in options:
            _choice("fsdp", option, valid)
        if isinstance(self.fsdp_config, str):
            with open(self.fsdp_config) as handle:
                self.fsdp_config = json.load(handle)
        if isinstance(self.deepspeed, str) and self.deepspeed.lstrip().startswith("{"):
            self.deepspeed = _json_field("deepspeed", self.deepspeed)

    # ---- derived values ---------------------------------------------------------------------------

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Warmup steps: ``warmup_steps`` when set, else ``ceil(warmup_ratio * num_training_steps)``."""
        if self.warmup_steps > 0:
            return int(self.warmup_steps)
        return math.ceil(num_training_steps * self.warmup_ratio)

    def steps_of(self, name: str, max_steps: int) -> int:
        """``logging_steps``/``eval_steps``/``save_steps`` as a step count (a ratio < 1 is of ``max_steps``)."""
        value = getattr(self, name)
        return max(1, math.ceil(value * max_steps)) if value < 1 else int(value)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str)

    @classmethod
    def from_file(cls, path: str) -> TrainingArguments:
        """Build from a JSON or YAML file of field names to values (unknown keys are an error)."""
        from shardkit.trainer.parser import HfArgumentParser

        return HfArgumentParser(cls).parse_file(path)[0]

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> TrainingArguments:
        """Build from ``--field value`` flags (``sys.argv[1:]`` by default)."""
        from shardkit.trainer.parser import HfArgumentParser

        return HfArgumentParser(cls).parse_args_into_dataclasses(argv)[0]


def _json_field(name: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"TrainingArguments.{name} is not valid JSON ({err}): pass a dict or a JSON object") from err
    if not isinstance(value, dict):
        raise ValueError(f"TrainingArguments.{name} must be a JSON object, got {type(value).__name__}")
    return value


def _check_model_prep(args: TrainingArguments) -> None:
    from shardkit.trainer.model_prep import check_model_prep_args

    check_model_prep_args(args)


def _has_tensorboard() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def _check_gradient_checkpointing(args: TrainingArguments) -> None:
    from shardkit.strategies.activation_checkpointing import parse_checkpoint_kwargs

    if args.gradient_checkpointing_kwargs is not None:  # a JSON string (CLI, config file) becomes its dict
        args.gradient_checkpointing_kwargs = parse_checkpoint_kwargs(
            args.gradient_checkpointing_kwargs, "TrainingArguments.gradient_checkpointing_kwargs")
