"""DeepSpeed's ops that the ZeRO strategies load on this machine, built ahead for ``shardkit build-ops --deepspeed``
(the command is :mod:`shardkit.cli.build_ops`; the builds go through :func:`build_deepspeed_op`, a run's own path)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TextIO

__all__ = ["build_deepspeed_ops"]

# DeepSpeed builder -> (op name, when a ZeRO run loads it)
_DEEPSPEED_OPS = {
    "ShareMemCommBuilder": ("shm_comm", "collectives of the CPU accelerator"),
    "CPUAdamBuilder": ("cpu_adam", "optimizer offload"),
    "AsyncIOBuilder": ("async_io", "NVMe offload"),
}



def _deepspeed_op(builder_name: str) -> Path | None:
    from deepspeed.accelerator import get_accelerator

    from shardkit.ops.build_lock import extensions_root
    from shardkit.strategies.zero.strategy import build_deepspeed_op

    if not build_deepspeed_op(builder_name):
        return None
    return extensions_root() / get_accelerator().create_op_builder(builder_name).NAME



def build_deepspeed_ops(build: Callable[[str, Callable[[], Path | None]], bool], out: TextIO) -> bool:
    """Build each DeepSpeed op ZeRO loads here through ``build(label, fn)`` (it reports and returns False on a
    failure); an op this machine cannot have is skipped with the reason. True when none failed."""
    ok = True
    try:
        from shardkit.strategies.zero.config import libaio_available
        from shardkit.strategies.zero.strategy import choose_deepspeed_accelerator

        choose_deepspeed_accelerator()
        from deepspeed.accelerator import get_accelerator
    except ImportError as err:
        print(f"DeepSpeed ops: cannot import deepspeed ({err}); `pip install deepspeed` to use the ZeRO strategies",
              file=out, flush=True)
        return False
    from shardkit.strategies.zero.strategy import deepspeed_op_builders

    with_aio = libaio_available()
    for builder_name in deepspeed_op_builders(offload=True, nvme=True):
        name, use = _DEEPSPEED_OPS[builder_name]
        label = f"DeepSpeed {name} ({use})"
        if builder_name == "AsyncIOBuilder" and not with_aio:
            print(f"skipping {label}: libaio not found (header libaio.h and library libaio); install it "
                  "(apt-get install libaio-dev) and run this again to use NVMe offload", file=out, flush=True)
            continue
        if get_accelerator().create_op_builder(builder_name) is None:
            print(f"skipping {label}: DeepSpeed's {get_accelerator()._name} accelerator has no {builder_name}",
                  file=out, flush=True)
            continue
        ok &= build(label, lambda builder=builder_name: _deepspeed_op(builder))
    return ok
