"""The Trainer's ``fsdp=`` / ``fsdp_config=`` as FSDP strategy settings: the one place they are read.

:func:`fsdp_strategy_kwargs` is the seam: the Trainer builds ``FSDP(**fsdp_strategy_kwargs(args))`` and
nothing else reads ``fsdp_config``. Its body is the translator shared with the Accelerate YAML reader
(:mod:`shardkit.config.fsdp_options`: every key honoured or refused by name); the file reading below stays.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

__all__ = ["fsdp_strategy_kwargs", "read_fsdp_config_file"]

_MAX_BYTES = 1 << 20  # an fsdp_config JSON is a few hundred bytes; a larger file is not one


def read_fsdp_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """``fsdp_config`` given as a path: a regular JSON file of at most 1 MiB holding an object.

    Raises:
        ValueError: missing, not a regular file, too large, not JSON, or not an object (the path is named).
    """
    from shardkit.trainer.arguments import TrainingArgumentsError

    file = Path(path).expanduser()
    try:
        info = os.stat(file)
    except OSError as err:
        raise TrainingArgumentsError(f"TrainingArguments.fsdp_config={str(path)!r} cannot be read ({err.strerror}):"
                                     " pass a JSON file path or a dict") from None
    if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_BYTES:
        raise TrainingArgumentsError(f"TrainingArguments.fsdp_config={str(path)!r} must be a regular JSON file of at "
                                     f"most {_MAX_BYTES} bytes")
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TrainingArgumentsError(f"TrainingArguments.fsdp_config file {str(path)!r} is not valid JSON ({err})"
                                     ) from None
    if not isinstance(value, dict):
        raise TrainingArgumentsError(f"TrainingArguments.fsdp_config file {str(path)!r} must hold a JSON object, "
                                     f"not a {type(value).__name__}")
    return value


def fsdp_strategy_kwargs(args: Any) -> dict[str, Any]:
    """``FSDP(...)`` keywords for ``args.fsdp`` (``"full_shard offload"`` ...) and ``args.fsdp_config``."""
    from shardkit.config.fsdp_options import trainer_fsdp_spec

    _, kwargs = trainer_fsdp_spec(args.fsdp, args.fsdp_config)  # every key honoured or refused by name
    return kwargs
