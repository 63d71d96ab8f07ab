"""What the TrainingArguments modules share and the checks, the parser and the fsdp_config reader all raise or
name: the errors, the log level names and the keywords transformers removed (with what replaced them).

It imports nothing of the Trainer's, so ``arguments`` (the dataclass) can import the checks and the parser at
module level, and they can import what they raise from here instead of from ``arguments``.
"""

from __future__ import annotations

import logging

__all__ = ["LOG_LEVELS", "OBSOLETE_ARGUMENTS", "TrainingArgumentsError", "UnknownArgumentError"]

LOG_LEVELS = {"passive": -1, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
              "error": logging.ERROR, "critical": logging.CRITICAL}

# Names transformers removed (or never had under that spelling) -> what replaced them.
OBSOLETE_ARGUMENTS = {
    "evaluation_strategy": "it was renamed eval_strategy (transformers 4.46, removed in 5): use eval_strategy=...",
    "overwrite_output_dir": "transformers 5 removed it: output_dir is written whatever it holds (its checkpoint-N "
                            "folders are resumed with resume_from_checkpoint=True); drop the flag",
    "warmup_ratio": "transformers 5 folded it into warmup_steps: a value below 1 is a fraction of the training "
                    "steps (warmup_ratio=0.1 -> warmup_steps=0.1)",
    "no_cuda": "it was renamed use_cpu: use use_cpu=True",
    "use_mps_device": "transformers 5 removed it: the device is chosen for you (use_cpu=True forces the CPU)",
    "per_gpu_train_batch_size": "it was renamed per_device_train_batch_size",
    "per_gpu_eval_batch_size": "it was renamed per_device_eval_batch_size",
    "push_to_hub_model_id": "it was replaced by hub_model_id",
    "push_to_hub_organization": "it was replaced by hub_model_id='organization/name'",
    "push_to_hub_token": "it was replaced by hub_token",
    "include_inputs_for_metrics": "it was replaced by include_for_metrics=['inputs']",
    "save_safetensors": "transformers 5 removed it: weights are always written as safetensors",
    "fp16_backend": "transformers 5 removed it (and apex): fp16=True uses torch's mixed precision",
    "half_precision_backend": "transformers 5 removed it: fp16=True / bf16=True use torch's mixed precision",
    "fp16_opt_level": "transformers 5 removed apex: fp16=True uses torch's mixed precision",
    "torchdynamo": "it was replaced by torch_compile_backend",
    "tpu_num_cores": "transformers 5 removed it; shardkit does not run on TPUs",
    "dispatch_batches": "it moved into accelerator_config; shardkit's Runner shards every batch per rank",
    "split_batches": "it moved into accelerator_config; shardkit's Runner shards every batch per rank",
}


class TrainingArgumentsError(ValueError):
    """A TrainingArguments value is out of range, of the wrong type or contradicts another; the message says
    which field, which value and what to set instead."""


class UnknownArgumentError(TypeError, ValueError):
    """A keyword TrainingArguments does not take: a typo (the closest field is named) or a name transformers
    removed (what replaced it is named). A TypeError, as Python's own, and a ValueError, as the other checks."""
