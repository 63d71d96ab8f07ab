"""Inference on every strategy: synced generation and data-parallel batch inference.

    model = runner.setup(model)                                  # no optimizer needed
    with runner.split_between_processes(prompts) as mine:        # this rank's share, in order
        outputs = [runner.generate(model, ids, max_new_tokens=32) for ids in mine]
        everything = runner.gather_object(outputs)               # every prompt's output once, in order

``runner.generate`` must run on every rank (see :mod:`shardkit.inference.generate`).
"""

from shardkit.inference.batch import Split, gather_object, split_between_processes, split_counts
from shardkit.inference.generate import generate, is_hf_model
from shardkit.inference.sync import ENTRY_TIMEOUT_ENV_VAR, NotCalledOnAllRanksError, needs_sync, params_partitioned

__all__ = [
    "ENTRY_TIMEOUT_ENV_VAR",
    "NotCalledOnAllRanksError",
    "Split",
    "gather_object",
    "generate",
    "is_hf_model",
    "needs_sync",
    "params_partitioned",
    "split_between_processes",
    "split_counts",
]
