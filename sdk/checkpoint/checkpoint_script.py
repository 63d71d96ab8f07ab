"""The ``zero_to_fp32.py`` script a ZeRO checkpoint carries, as DeepSpeed drops one into each of its checkpoints.

``python zero_to_fp32.py . OUT`` run inside the checkpoint consolidates it with shardkit's tool
(:mod:`shardkit.checkpoint.zero_to_fp32`), taking DeepSpeed's arguments. The script holds no logic of its own: a
checkpoint read later by a newer shardkit gets the newer reader.
"""

from __future__ import annotations

__all__ = ["SCRIPT_NAME", "script_text"]

SCRIPT_NAME = "zero_to_fp32.py"

_SCRIPT = '''#!/usr/bin/env python
"""Consolidates the checkpoint in this directory into full-precision safetensors, as DeepSpeed's zero_to_fp32.py.

    python zero_to_fp32.py . OUTPUT_DIR [--max_shard_size 5GB] [-t TAG] [--exclude_frozen_parameters]

shardkit wrote this file beside its checkpoint; the work is done by shardkit's `shardkit zero-to-fp32` (no DeepSpeed,
no GPU, no process group). OUTPUT_DIR receives model.safetensors (or shards and their index) and the model's
config.json when the checkpoint has one. `python zero_to_fp32.py -h` lists the options.
"""

import sys

try:
    from shardkit.checkpoint.zero_to_fp32 import main
except ImportError as e:
    sys.exit(f"zero_to_fp32.py: this checkpoint was written by shardkit, and converting it needs shardkit, which "
             f"this Python ({sys.executable}) cannot import ({e}). Install shardkit, or run "
             "`shardkit zero-to-fp32 CHECKPOINT OUTPUT_DIR` where it is installed.")

if __name__ == "__main__":
    sys.exit(main(prog="zero_to_fp32.py"))
'''


def script_text() -> bytes:
    """The script's bytes."""
    return _SCRIPT.encode()
