"""The Trainer's ``fsdp=`` / ``fsdp_config=`` as FSDP strategy settings: the one place they are read.

:func:`fsdp_strategy_kwargs` is the seam: the Trainer builds ``FSDP(**fsdp_strategy_kwargs(args))`` and
nothing else reads ``fsdp_config``. Its body is the translator shared with the Accelerate YAML reader
(:mod:`shardkit.config.fsdp_options`: every key honoured or refused by name); the file reading below stays.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shardkit.trainer.argument_errors import TrainingArgumentsError

__all__ = ["fsdp_strategy_kwargs", "read_fsdp_config_file"]

def read_fsdp_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """``fsdp_config`` given as a path, read as every config file is (``config.common.load_mapping``): a regular
    file of at most ``MAX_CONFIG_BYTES`` holding a JSON (or YAML) object.

    Raises:
        TrainingArgumentsError: missing, not a regular file, too large, not UTF-8, not JSON, a key written twice,
            or not an object (the path is named).
    """
    from shardkit.config.common import ConfigError, load_mapping

    try:
        return load_mapping(Path(path).expanduser())
    except ConfigError as err:
        raise TrainingArgumentsError(f"TrainingArguments.fsdp_config={str(path)!r}: {err} (pass a JSON file path or "
                                     "a dict)") from None


def fsdp_strategy_kwargs(args: Any) -> dict[str, Any]:
    """``FSDP(...)`` keywords for ``args.fsdp`` (``"full_shard offload"`` ...) and ``args.fsdp_config``."""
    from shardkit.config.fsdp_options import trainer_fsdp_spec

    _, kwargs = trainer_fsdp_spec(args.fsdp, args.fsdp_config)  # every key honoured or refused by name
    return kwargs
