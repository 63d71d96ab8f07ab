"""TrainingArguments: Hugging Face's fields, names and defaults (transformers 5), checked when built.

Every field transformers 5 has is here with its default; the ones shardkit runs differently or refuses are
listed in ``shardkit.trainer.compat`` (and in the README's table, generated from it). Checks live in
``shardkit.trainer.argument_checks``: bad values raise :class:`TrainingArgumentsError` naming the field, the
value and the fix; an unknown keyword raises naming the closest field; a name transformers removed is refused
naming what replaced it, and a deprecated one still accepted by transformers is accepted with a warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from shardkit.trainer.argument_checks import check_arguments, translate_keywords
from shardkit.trainer.argument_errors import (
    LOG_LEVELS,
    TrainingArgumentsError,
    UnknownArgumentError,
)
from shardkit.trainer.enums import (
    DebugOption,
    HubStrategy,
    IntervalStrategy,
    SaveStrategy,
    SchedulerType,
)
from shardkit.trainer.parser import HfArgumentParser

__all__ = ["TrainingArguments", "TrainingArgumentsError", "UnknownArgumentError", "IntervalStrategy", "SaveStrategy",
           "HubStrategy", "SchedulerType", "DebugOption", "SCHEDULER_TYPES", "LOG_LEVELS"]

SCHEDULER_TYPES = tuple(s.value for s in SchedulerType)



class _ArgumentsMeta(type):
    """Runs before the dataclass ``__init__`` (of TrainingArguments and of every subclass): unknown and obsolete
    keywords get a message naming the fix instead of Python's bare "unexpected keyword argument"."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **translate_keywords(cls, kwargs))


def optional_flag() -> Any:
    """A ``bool | None`` field (None: not set) whose bare ``--name`` on a command line means True, under
    transformers' ``HfArgumentParser`` as under shardkit's (transformers' own parser wants a value after it)."""
    return field(default=None, metadata={"nargs": "?", "const": True})


@dataclass
class TrainingArguments(metaclass=_ArgumentsMeta):
    """The settings of a :class:`~shardkit.trainer.Trainer` run, with Hugging Face's field names and defaults.

    Beyond Hugging Face: ``max_time`` (seconds of wall clock, then save and stop), ``save_on_sigterm``
    (a SIGTERM saves a checkpoint that resumes exactly, then stops), ``fast_dev_run`` (run that many
    training and eval batches, no saves), ``logging_dir`` (where ``report_to`` writes), ``use_fused_kernels``,
    ``async_save`` (checkpoints written by a background thread while training goes on), ``profile_steps``
    (torch.profiler traces of those optimizer steps under ``<logging_dir>/profile``), ``peak_tflops`` (the device's
    dense TFLOP/s that ``mfu`` divides by; default $SHARDKIT_PEAK_TFLOPS, the GPU's data sheet, or a measurement on
    CPU) and ``report_to="jsonl"``.
    The logs sent to ``report_to`` carry ``tokens_per_s``, ``tflops`` (model TFLOP/s per device) and ``mfu`` when
    the batches hold ``input_ids``; ``state.log_history`` keeps Hugging Face's keys only (no timing).

    Build it directly, from command-line flags (:meth:`from_cli`), or from a JSON/YAML file
    (:meth:`from_file`). Bad or contradictory settings raise :class:`TrainingArgumentsError` naming the
    fields and the fix.
    """

    output_dir: str | None = None
    per_device_train_batch_size: int = 8
    num_train_epochs: float = 3.0
    max_steps: int = -1
    learning_rate: float = 5e-5
    lr_scheduler_type: str = "linear"
    lr_scheduler_kwargs: dict[str, Any] | str | None = None
    warmup_steps: float = 0  # >= 1: steps; < 1: a fraction of the training steps (transformers 5)
    optim: str = "adamw_torch_fused"
    optim_args: dict[str, Any] | str | None = None
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    optim_target_modules: None | str | list[str] = None  # GaLore's nn.Linear targets (transformers' matching rules)
    gradient_accumulation_steps: int = 1
    average_tokens_across_devices: bool = True
    max_grad_norm: float = 1.0  # <= 0 turns clipping off
    label_smoothing_factor: float = 0.0
    bf16: bool = False
    fp16: bool = False
    bf16_full_eval: bool = False  # evaluate in bf16 (a bf16 copy of the weights, not autocast)
    fp16_full_eval: bool = False
    tf32: bool | None = optional_flag()
    activation_checkpointing: bool | None = optional_flag()
    activation_checkpointing_kwargs: dict[str, Any] | str | None = None
    # transformers 5's deprecated alias of activation_checkpointing
    gradient_checkpointing: bool | None = optional_flag()
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = None
    torch_compile: bool = False
    torch_compile_backend: str | None = None
    torch_compile_mode: str | None = None
    use_liger_kernel: bool = False  # shardkit's fused kernels under Liger's switch name
    liger_kernel_config: dict[str, Any] | str | None = None
    use_cache: bool = False
    neftune_noise_alpha: float | None = None
    torch_empty_cache_steps: int | None = None
    auto_find_batch_size: bool = False
    logging_strategy: str = "steps"
    logging_steps: float = 500
    logging_first_step: bool = False
    log_on_each_node: bool = True
    logging_nan_inf_filter: bool = True
    include_num_input_tokens_seen: str | bool = "no"
    log_level: str = "passive"
    log_level_replica: str = "warning"
    disable_tqdm: bool | None = optional_flag()
    report_to: None | str | list[str] = "none"
    run_name: str | None = None
    project: str = "huggingface"
    trackio_space_id: str | None = None
    trackio_bucket_id: str | None = None
    trackio_static_space_id: str | None = None
    eval_strategy: str = "no"
    eval_steps: float | None = None
    eval_delay: float = 0
    per_device_eval_batch_size: int = 8
    prediction_loss_only: bool = False
    eval_on_start: bool = False
    eval_do_concat_batches: bool = True
    eval_use_gather_object: bool = False
    eval_accumulation_steps: int | None = None
    include_for_metrics: list[str] = field(default_factory=list)
    batch_eval_metrics: bool = False
    save_only_model: bool = False
    save_strategy: str = "steps"
    save_steps: float = 500
    save_on_each_node: bool = False
    save_total_limit: int | None = None
    enable_jit_checkpoint: bool = False
    push_to_hub: bool = False
    hub_token: str | None = None
    hub_private_repo: bool | None = optional_flag()
    hub_model_id: str | None = None
    hub_strategy: str = "every_save"
    hub_always_push: bool = False
    hub_revision: str | None = None
    load_best_model_at_end: bool = False
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = optional_flag()
    ignore_data_skip: bool = False
    restore_callback_states_from_checkpoint: bool = False
    full_determinism: bool = False
    seed: int = 42
    data_seed: int | None = None
    use_cpu: bool = False
    accelerator_config: dict[str, Any] | str | None = None
    parallelism_config: str | None = None  # refused by name: the Trainer takes a strategy
    dataloader_drop_last: bool = False
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = True
    dataloader_persistent_workers: bool = False
    dataloader_prefetch_factor: int | None = None
    dataloader_multiprocessing_context: str | None = None
    dataloader_in_order: bool = True
    remove_unused_columns: bool = True
    label_names: list[str] | None = None
    train_sampling_strategy: str = "random"
    length_column_name: str = "length"
    ddp_find_unused_parameters: bool | None = optional_flag()
    ddp_bucket_cap_mb: int | None = None
    ddp_broadcast_buffers: bool | None = optional_flag()
    ddp_static_graph: bool | None = optional_flag()
    ddp_backend: str | None = None
    ddp_timeout: int = 1800
    fsdp: None | str | list[str] = None  # True/False are taken too: "full_shard" / off
    fsdp_config: dict[str, Any] | str | None = None
    deepspeed: dict[str, Any] | str | None = None
    debug: str | list[str] = ""
    skip_memory_metrics: bool = True
    do_train: bool = False
    do_eval: bool = False
    do_predict: bool = False
    resume_from_checkpoint: str | None = None
    local_rank: int = -1
    # ---- shardkit's own ----
    logging_dir: str | None = None  # where report_to writes (jsonl, tensorboard); default <output_dir>/runs
    max_time: float | None = None  # seconds of wall clock; then save a checkpoint and stop
    save_on_sigterm: bool = True  # SIGTERM on any rank: save a checkpoint that resumes exactly, then stop
    fast_dev_run: int = 0  # run that many training and evaluation batches, save nothing
    use_fused_kernels: bool = False  # patch an HF model with shardkit.nn.apply_fused_kernels before setup
    # Runner.save(blocking=False): the state is copied to host memory and written by a background thread; the
    # next save, a load and the end of train() wait for it (peft models' saves block: adapters are gathered).
    async_save: bool = False
    profile_steps: None | str | int | tuple[int, int] = None  # Runner(profile_steps=...): (2, 4), "2-3" or 2
    peak_tflops: float | None = None  # Runner(peak_tflops=...): the TFLOP/s per device that mfu divides by

    def __post_init__(self) -> None:
        check_arguments(self)

    # ---- facts about this process (known before the Runner exists: the launcher's environment) --------

    @property
    def world_size(self) -> int:
        """Processes in the job (the launcher's ``WORLD_SIZE``; 1 without a launcher)."""
        return _env_int("WORLD_SIZE", 1)

    @property
    def process_index(self) -> int:
        """This process's rank in the job."""
        return _env_int("RANK", 0)

    @property
    def local_process_index(self) -> int:
        """This process's rank on its machine."""
        return _env_int("LOCAL_RANK", max(self.local_rank, 0))

    @property
    def n_gpu(self) -> int:
        """GPUs this process uses: 1 on a CUDA machine (one process per GPU), 0 on CPU or with ``use_cpu``."""
        return 0 if self.use_cpu or not torch.cuda.is_available() else 1

    @property
    def device(self) -> torch.device:
        """The device this process trains on (the Trainer's Runner decides; this is its default)."""
        if self.n_gpu:
            return torch.device("cuda", self.local_process_index)
        return torch.device("cpu")

    @property
    def train_batch_size(self) -> int:
        """Samples per forward on this process: ``per_device_train_batch_size * max(1, n_gpu)``."""
        return self.per_device_train_batch_size * max(1, self.n_gpu)

    @property
    def eval_batch_size(self) -> int:
        """Samples per evaluation forward on this process."""
        return self.per_device_eval_batch_size * max(1, self.n_gpu)

    @property
    def parallel_mode(self) -> str:
        """``"not_parallel"`` on one process, ``"distributed"`` under a launcher (Hugging Face's names)."""
        return "distributed" if self.world_size > 1 else "not_parallel"

    @property
    def should_log(self) -> bool:
        """Whether this process logs: the main process (each node's with ``log_on_each_node``)."""
        return self.local_process_index == 0 if self.log_on_each_node else self.process_index == 0

    @property
    def should_save(self) -> bool:
        """Whether this process writes files: the main process (each node's with ``save_on_each_node``)."""
        return self.local_process_index == 0 if self.save_on_each_node else self.process_index == 0

    @property
    def ddp_timeout_delta(self):
        """``ddp_timeout`` as a ``datetime.timedelta``."""
        from datetime import timedelta

        return timedelta(seconds=self.ddp_timeout)

    @property
    def place_model_on_device(self) -> bool | None:
        """Hugging Face's hook for integrations; the Runner places the model, so always None here."""
        return None

    def get_process_log_level(self) -> int:
        """The log level for this process: ``log_level`` on the process that logs (see :attr:`should_log`),
        ``log_level_replica`` on the others; ``"passive"`` keeps the level the Trainer's logger has now
        (transformers' verbosity when transformers is in use, as for Hugging Face's Trainer)."""
        from shardkit.trainer.trainer_logging import trainer_log_level

        name = self.log_level if self.should_log else self.log_level_replica
        level = LOG_LEVELS[name]
        return trainer_log_level() if level == -1 else level

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Iterator[None]:
        """Run the block on the main process first, then on the others (e.g. dataset preprocessing that
        caches): the others wait at a barrier until it is done. Needs the process group of a running job."""
        import torch.distributed as dist

        grouped = dist.is_available() and dist.is_initialized() and self.world_size > 1
        main = (self.local_process_index if local else self.process_index) == 0
        if grouped and not main:
            dist.barrier()
        try:
            yield
        finally:
            if grouped and main:
                dist.barrier()

    # ---- derived values ---------------------------------------------------------------------------

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Warmup steps: ``warmup_steps`` when >= 1, else that fraction of ``num_training_steps`` (rounded up)."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil(num_training_steps * self.warmup_steps)

    def steps_of(self, name: str, max_steps: int) -> int:
        """``logging_steps``/``eval_steps``/``save_steps`` as a step count (a ratio < 1 is of ``max_steps``)."""
        value = getattr(self, name)
        return max(1, math.ceil(value * max_steps)) if value < 1 else int(value)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON values: enums as their values, torch dtypes as names, tokens masked."""
        out = {}
        for item in dataclasses.fields(self):
            if item.init:
                value = _plain(getattr(self, item.name))
                out[item.name] = f"<{item.name.upper()}>" if item.name.endswith("_token") and value else value
        return out

    def to_json_string(self) -> str:
        """:meth:`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str)

    def to_sanitized_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` with only the types TensorBoard's hparams take (others as strings)."""
        return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in self.to_dict().items()}

    @classmethod
    def from_file(cls, path: str) -> TrainingArguments:
        """Build from a JSON or YAML file of field names to values (unknown keys are an error)."""
        return HfArgumentParser(cls).parse_file(path)[0]

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> TrainingArguments:
        """Build from ``--field value`` flags (``sys.argv[1:]`` by default)."""
        return HfArgumentParser(cls).parse_args_into_dataclasses(argv)[0]


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _plain(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value).split(".", 1)[1]
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value

