"""Run a test function on N real processes (gloo on CPU) and fail the test cleanly when a rank fails or hangs.

    from harness import run_distributed

    def _check_all_reduce(scale):            # top level: spawned children import it by name
        env = init_distributed("cpu")
        ...
        return value

    def test_all_reduce():
        results = run_distributed(_check_all_reduce, world_size=2, args=(3,))

Built on `shardkit.launch`, so the harness and the product share the code that starts
processes, picks the port and reports failures.

The ranks are forked from a multiprocessing forkserver that has imported torch (with the torch.distributed
modules the strategies load) and shardkit's core once for the whole session, instead of each spawned rank
importing them again: that import is most of a small launch's time (measured: 2.5 s of CPU per rank spawned,
0.3 s forked). transformers, DeepSpeed, peft and bitsandbytes are not preloaded: shardkit asks whether they are
imported (sys.modules) and behaves accordingly, so a rank imports them itself, as a spawned one would. Each rank
gets the caller's environment as it is at the launch (the launcher hands a forkserver child the whole of it).
"""

from __future__ import annotations

import contextlib
import multiprocessing
from typing import Any, Callable, Iterator, Mapping, Sequence

import pytest

from shardkit.distributed.launcher import LaunchError, LaunchTimeout, launch
from shardkit.distributed.process_group import TIMEOUT_ENV_VAR

__all__ = ["TEST_COLLECTIVE_TIMEOUT_S", "run_distributed"]

# A collective that waits this long for a peer in a test has hung: the tests' collectives on tiny
# tensors take milliseconds and init (spawn + import torch) about 3 s on an idle machine, but a
# loaded 2-core machine (load average 9 seen here) stretches a peer's start past 20 s. Tests of
# dead-rank handling set their own short timeout.
TEST_COLLECTIVE_TIMEOUT_S = 90

# None of these reads the environment when imported (a rank's variables arrive after the fork), starts a thread,
# or imports a package whose presence shardkit asks about (sys.modules: transformers, DeepSpeed, peft,
# bitsandbytes); the server inherits TRITON_INTERPRET from conftest, as spawned ranks did.
_PRELOAD = ["torch", "torch.distributed.tensor", "torch.distributed.tensor.parallel", "torch.distributed.fsdp",
            "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict", "torch.distributed.pipelining",
            "shardkit.distributed.launcher", "shardkit.runner.core", "shardkit.models", "shardkit.strategies"]
multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)


def run_distributed(fn: Callable[..., Any], world_size: int = 2, timeout: float = 600, args: Sequence[Any] = (),
                    env: Mapping[str, str] | None = None) -> list[Any]:
    """Run top-level `fn(*args)` on `world_size` processes; return each rank's result in rank order.

    Every rank, even a lone one, runs in a child process. A rank that raises, exits early or is
    killed fails the test with every rank's traceback; a job still running after `timeout` seconds
    fails it naming the ranks still alive. The collective timeout is TEST_COLLECTIVE_TIMEOUT_S
    unless `env` sets SHARDKIT_COLLECTIVE_TIMEOUT.
    """
    variables = {TIMEOUT_ENV_VAR: str(TEST_COLLECTIVE_TIMEOUT_S), **(env or {})}
    try:
        # in_process=False: even one rank gets a fresh process, so a "new process" in a test is one
        # and the hang timeout holds.
        return launch(fn, args=args, num_processes=world_size, timeout=timeout, env=variables, in_process=False,
                      start_method="forkserver")
    except LaunchTimeout as err:
        pytest.fail(f"{getattr(fn, '__name__', fn)} hung on {world_size} processes:\n{err}", pytrace=False)
    except LaunchError as err:
        pytest.fail(f"{getattr(fn, '__name__', fn)} failed on {world_size} processes:\n{err}", pytrace=False)


@contextlib.contextmanager
def transformers_without_zero3() -> Iterator[None]:
    """For a load on one rank only: while a ZeRO-3 run is registered with transformers (as Accelerate registers it),
    ``from_pretrained`` partitions through collectives that the other ranks never join, as it would under HF's
    Trainer. Inside this block the files are read as a user without shardkit would read them."""
    from transformers.integrations import deepspeed as hf_ds

    ref = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = ref
