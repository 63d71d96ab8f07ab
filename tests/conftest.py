"""Settings every test module needs before it is imported.

Triton 3.x decides, when a kernel is *decorated* (``shardkit.kernels.<op>`` imported), whether it runs
compiled or through its interpreter. Any test collected before tests/kernels that imports the fused ops
(the Trainer's ``use_fused_kernels``, peft, ...) would otherwise fix them as compiled kernels, which cannot
run on CPU tensors, and the kernel tests that follow fail with "Cannot call @triton.jit'd outside of the
scope of a kernel". So on a machine without CUDA the interpreter is chosen here, first.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# tests/trainer_fixtures.py (shared by tests/unit and tests/distributed) imports by name from any test folder.
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


@pytest.fixture(autouse=True)
def _trainer_logs_reach_caplog():
    """With transformers in use the Trainer logs under transformers' library logger (as Hugging Face's Trainer
    does), which does not propagate to the root logger where caplog listens: let it, for the tests."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # a run without transformers: the Trainer logs under "shardkit"
        hf_logging = None
    if hf_logging is not None:
        hf_logging.enable_propagation()
    yield


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A front built in the test process (FSDP, ZeRO, TP or CP in a plain process) starts a private 1-rank group;
    one left behind makes the next forked workers refuse the parent ("already has a process group"). A group that
    existed before the test (a wider fixture's) is left alone."""
    import torch.distributed as dist

    had_group = dist.is_available() and dist.is_initialized()
    yield
    if not had_group and dist.is_available() and dist.is_initialized():
        from shardkit.distributed.process_group import destroy_distributed

        destroy_distributed()
