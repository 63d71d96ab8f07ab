"""How shardkit's Trainer stands against Hugging Face's (transformers 5): every argument and public method,
supported / different / refused. The README's table is generated from this module
(``python scripts/trainer_compat_table.py``) and a test keeps the two equal.

A name absent from the notes below is supported as Hugging Face documents it.
"""

from __future__ import annotations

import dataclasses
import inspect

__all__ = ["ARGUMENT_NOTES", "HF_INIT", "HF_METHODS", "INIT_NOTES", "METHOD_NOTES", "SHARDKIT_ONLY", "compat_rows",
           "init_rows", "markdown_table"]

# transformers 5.23's public Trainer methods.
HF_METHODS = (
    "add_callback", "autocast_smart_context_manager", "call_model_init", "compute_loss", "compute_loss_context_manager",
    "create_accelerator_and_postprocess", "create_model_card", "create_optimizer", "create_optimizer_and_scheduler",
    "create_scheduler", "end", "evaluate", "evaluation_loop", "floating_point_ops", "get_batch_samples",
    "get_cp_size", "get_decay_parameter_names", "get_eval_dataloader", "get_learning_rates",
    "get_num_trainable_parameters", "get_optimizer_cls_and_kwargs", "get_optimizer_group", "get_sp_size",
    "get_test_dataloader", "get_total_train_batch_size", "get_tp_size", "get_train_dataloader",
    "hyperparameter_search", "init_hf_repo", "is_local_process_zero", "is_world_process_zero", "log", "log_metrics",
    "loss_is_scaled_for_ga", "metrics_format", "num_examples", "pop_callback", "predict", "prediction_step",
    "push_to_hub", "remove_callback", "save_metrics", "save_model", "save_state", "set_initial_training_values",
    "store_flos", "train", "training_step",
)

SHARDKIT_ONLY = ("logging_dir", "max_time", "save_on_sigterm", "fast_dev_run", "use_fused_kernels", "async_save",
                 "profile_steps", "peak_tflops")

_HUB = ("uploads through huggingface_hub (trainer.hub_pusher) from the main process; push_to_hub=True pushes each "
        "checkpoint save in the background as hub_strategy says; 'checkpoint' and 'all_checkpoints' push the whole "
        "checkpoint folder (shardkit's sharded resume state included: resume from a downloaded last-checkpoint)")
ARGUMENT_NOTES: dict[str, tuple[str, str]] = {
    "output_dir": ("supported", "None is 'trainer_output'; ~ is expanded"),
    "warmup_steps": ("supported", "below 1 it is a fraction of the training steps (warmup_ratio folded in)"),
    "optim": ("different", "every name shardkit builds (its registry); torchao, APOLLO, StableAdamW, XLA/NPU names "
                           "are refused naming an alternative"),
    "optim_target_modules": ("supported", "Hugging Face's matching: a string is a full-match regex; a list entry "
                                          "matches exactly, as a substring or as a regex; non-Linear matches warned "
                                          "and skipped"),
    "max_grad_norm": ("supported", "<= 0 turns clipping off; NaN refused"),
    "bf16_full_eval": ("different", "outside training the whole model is cast, as Hugging Face does; refused under "
                                    "strategies that partition the weights"),
    "fp16_full_eval": ("different", "as bf16_full_eval"),
    "tf32": ("supported", "FP32(tf32=True) precision"),
    "gradient_checkpointing": ("supported", "deprecated alias of activation_checkpointing (FutureWarning), as in "
                                            "transformers 5"),
    "gradient_checkpointing_kwargs": ("supported", "deprecated alias of activation_checkpointing_kwargs"),
    "use_liger_kernel": ("different", "patches the model with shardkit's fused kernels (not the liger package)"),
    "liger_kernel_config": ("different", "Liger's switch names; kernels shardkit lacks are refused by name"),
    "use_cache": ("supported", "sets model.config.use_cache for training"),
    "torch_empty_cache_steps": ("supported", "empties the CUDA cache every N steps (nothing to free on CPU)"),
    "auto_find_batch_size": ("supported", "on an out-of-memory error the run restarts with 90% of the batch, as "
                                          "Hugging Face does; a resumed run starts from the checkpoint's batch"),
    "logging_nan_inf_filter": ("different", "NaN/inf steps are left out of the logged mean (a warning counts them); "
                                            "a window of only NaN/inf repeats the last logged value"),
    "include_num_input_tokens_seen": ("different", "counted and logged; log_history carries no timing (tokens/s, "
                                                   "TFLOP/s and MFU go to the reporters only)"),
    "log_level": ("supported", "sets transformers' verbosity, which the Trainer's lines follow, when transformers is "
                               "imported; else the 'shardkit' loggers"),
    "log_level_replica": ("supported", "as log_level, on the other processes"),
    "report_to": ("different", "every tracker of observability.trackers (jsonl, tensorboard; logs tagged train/..., "
                               "eval/... as HF's) and callbacks added with shardkit.trainer.reporting."
                               "register_reporter; other names refused"),
    "project": ("different", "accepted; read by reporters that use it (no trackio reporter)"),
    "trackio_space_id": ("different", "accepted, unused: no trackio reporter (report_to='trackio' is refused)"),
    "trackio_bucket_id": ("different", "accepted, unused: no trackio reporter (report_to='trackio' is refused)"),
    "trackio_static_space_id": ("different", "accepted, unused: no trackio reporter (report_to='trackio' is "
                                             "refused)"),
    "eval_use_gather_object": ("different", "accepted; tensors are gathered the same way (objects are not)"),
    "eval_accumulation_steps": ("different", "accepted; predictions move to the CPU after every batch anyway"),
    "include_for_metrics": ("different", "'inputs' and 'loss' reach EvalPrediction.inputs / .losses"),
    "save_on_each_node": ("different", "checkpoints are written once, to a filesystem every rank shares"),
    "enable_jit_checkpoint": ("different", "shardkit's save_on_sigterm (on by default) saves at the next step "
                                           "boundary on SIGTERM"),
    "push_to_hub": ("different", _HUB),
    "hub_token": ("different", _HUB), "hub_private_repo": ("different", _HUB), "hub_model_id": ("different", _HUB),
    "hub_strategy": ("different", _HUB), "hub_always_push": ("different", _HUB), "hub_revision": ("different", _HUB),
    "restore_callback_states_from_checkpoint": ("different", "callback counters are always restored (exact resume); "
                                                             "True also rebuilds the callbacks from saved arguments"),
    "full_determinism": ("supported", "torch.use_deterministic_algorithms and the cuBLAS workspace setting"),
    "use_cpu": ("supported", "SingleDevice('cpu') on one process"),
    "accelerator_config": ("different", "no Accelerate object: only its defaults are accepted, another value is "
                                        "refused by name"),
    "parallelism_config": ("refused", "pass strategy=TensorParallel(...) / FSDP(...) to the Trainer"),
    "dataloader_in_order": ("supported", "each rank's order is fixed by (seed, epoch)"),
    "train_sampling_strategy": ("different", "'random' and 'sequential' ('random' leaves a stream in its own order, "
                                             "as Hugging Face's does); 'group_by_length' refused"),
    "length_column_name": ("different", "accepted, unused: only group_by_length reads it, and that is refused"),
    "ddp_find_unused_parameters": ("supported", "passed to DDP under a launcher"),
    "ddp_bucket_cap_mb": ("supported", "passed to DDP under a launcher"),
    "ddp_broadcast_buffers": ("different", "False is refused (buffers are always broadcast)"),
    "ddp_static_graph": ("supported", "passed to DDP under a launcher"),
    "ddp_backend": ("different", "the backend follows the device (nccl on GPUs, gloo on CPUs)"),
    "ddp_timeout": ("supported", "the collective timeout of DDP"),
    "fsdp": ("different", "torch FSDP2 (fully_shard) through shardkit's FSDP strategy"),
    "fsdp_config": ("different", "read through one translator (shardkit.trainer.fsdp_config)"),
    "deepspeed": ("different", "the DeepSpeed JSON picks shardkit's ZeRO strategy; 'auto' values are filled"),
    "debug": ("different", "'underflow_overflow' stops at the first module output with inf/NaN, naming the module; "
                           "'tpu_metrics_debug' refused"),
    "skip_memory_metrics": ("supported", "CPU memory from the process's resident set, GPU from torch's allocator"),
    "local_rank": ("different", "accepted; the launcher's LOCAL_RANK decides"),
}

# Trainer(...) keywords: transformers 5.23's, then the removed ones, then shardkit's.
HF_INIT = ("model", "args", "data_collator", "train_dataset", "eval_dataset", "processing_class", "model_init",
           "compute_loss_func", "compute_metrics", "callbacks", "optimizers", "optimizer_cls_and_kwargs",
           "preprocess_logits_for_metrics")
INIT_NOTES: dict[str, tuple[str, str]] = {
    "data_collator": ("supported", "default: Hugging Face's default_data_collator (padding with a tokenizer)"),
    "model_init": ("supported", "each train() builds a fresh model seeded with args.seed"),
    "optimizer_cls_and_kwargs": ("different", "the kwargs' weight_decay applies to the decay group (Hugging Face's "
                                              "groups override it with args.weight_decay, 0 by default)"),
    "tokenizer": ("refused", "renamed processing_class (removed in transformers 5); the error says so"),
    "strategy": ("shardkit only", "a shardkit strategy object (FSDP(), ZeRO3(), TensorParallel() ...)"),
    "precision": ("shardkit only", "a shardkit precision object (BF16(), FP16() ...)"),
}

METHOD_NOTES: dict[str, tuple[str, str]] = {
    "create_accelerator_and_postprocess": ("different", "no-op: the Runner is built with the Trainer"),
    "create_model_card": ("supported", "transformers' TrainingSummary writes output_dir/README.md; push_to_hub() "
                                       "writes it before uploading"),
    "init_hf_repo": ("supported", "creates hub_model_id's repository through huggingface_hub (exist_ok)"),
    "push_to_hub": ("supported", "saves the model, then uploads output_dir (not its checkpoints) through "
                    "huggingface_hub after the uploads still running"),
    "hyperparameter_search": ("refused", "run the search loop yourself around Trainer(model_init=...)"),
    "get_cp_size": ("supported", "the strategy's cp degree (ContextParallel), else 1"),
    "get_sp_size": ("different", "always 1 (no sequence parallelism over the batch)"),
    "get_optimizer_cls_and_kwargs": ("different", "returns a factory f(params, **kwargs) from shardkit's registry"),
    "autocast_smart_context_manager": ("different", "the precision's autocast (forward is autocast already)"),
    "compute_loss_context_manager": ("different", "a no-op context (forward is autocast already)"),
    "floating_point_ops": ("different", "the model's own floating_point_ops(), else 0"),
    "end": ("supported", "tears the Runner down"),
    "save_model": ("different", "also streams from ZeRO-3/FSDP shards one module at a time; merge_adapters=True for "
                                "LoRA"),
    "get_train_dataloader": ("different", "must return a torch DataLoader (the Runner shards and resumes it)"),
}


def compat_rows() -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """(argument rows, method rows) of (name, status, note)."""
    from shardkit.trainer import Trainer, TrainingArguments
    from shardkit.trainer.argument_errors import OBSOLETE_ARGUMENTS

    fields = [f.name for f in dataclasses.fields(TrainingArguments) if f.init]
    args = [(n, *ARGUMENT_NOTES.get(n, ("supported", ""))) for n in fields if n not in SHARDKIT_ONLY]
    args += [(n, "shardkit only", "") for n in SHARDKIT_ONLY]
    args += [(n, "refused", why) for n, why in OBSOLETE_ARGUMENTS.items()]
    methods = []
    for name in HF_METHODS:
        present = hasattr(Trainer, name) and (callable(getattr(Trainer, name)) or name == "loss_is_scaled_for_ga")
        status, note = METHOD_NOTES.get(name, ("supported" if present else "missing", ""))
        methods.append((name, status, note))
    extra = sorted(n for n, v in inspect.getmembers(Trainer) if not n.startswith("_") and callable(v)
                   and n not in HF_METHODS and n != "load_model")
    methods += [(n, "shardkit only", "") for n in [*extra, "load_model"]]
    return args, methods


def init_rows() -> list[tuple[str, str, str]]:
    """(keyword, status, note) for ``Trainer(...)``."""
    names = [*HF_INIT, "tokenizer", "strategy", "precision"]
    return [(n, *INIT_NOTES.get(n, ("supported", ""))) for n in names]


def markdown_table() -> str:
    """The README's table (Trainer keywords, TrainingArguments fields, then methods)."""
    args, methods = compat_rows()
    lines = ["| Trainer(...) keyword | status | notes |", "|---|---|---|"]
    lines += [f"| `{n}` | {s} | {note} |" for n, s, note in init_rows()]
    lines += ["", "| TrainingArguments field | status | notes |", "|---|---|---|"]
    lines += [f"| `{n}` | {s} | {note} |" for n, s, note in args]
    lines += ["", "| Trainer method | status | notes |", "|---|---|---|"]
    lines += [f"| `{n}` | {s} | {note} |" for n, s, note in methods]
    return "\n".join(lines)
