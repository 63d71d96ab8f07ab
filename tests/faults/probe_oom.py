"""A Runner loop that really runs out of host memory: ``python probe_oom.py KIND FOLDER``.

Trains a tiny model for two steps, saves ``FOLDER/ckpt/step-2``, then caps the address space (RLIMIT_AS: the
size now plus 256 MiB) and keeps 16 MiB more per step in the model's forward until an allocation fails, as a leak
would. KIND ``torch`` keeps tensors (the CPU allocator's RuntimeError), ``python`` keeps bytearrays (MemoryError).
The error is not caught: it ends the script, as it would a user's. Writes under ``FOLDER/runs``.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch
from torch import nn

from shardkit import Runner

CHUNK = 16 * 2**20 + 1024  # not a round size: the report must name it


def _virtual_bytes() -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmSize:"))
    return int(line.split()[1]) * 1024


def main(kind: str, folder: Path) -> None:
    torch.set_num_threads(1)  # no thread started under the cap (each reserves its stack)
    kept: list = []
    limited = False

    class Leaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if limited:
                kept.append(torch.ones(CHUNK, dtype=torch.uint8) if kind == "torch" else bytearray(CHUNK))
            return self.linear(x)

    runner = Runner(logging_dir=folder / "runs", seed=0)
    model = Leaky()
    model, optimizer = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(1000):
        loss = model(torch.randn(4, 32)).square().mean()
        runner.backward(loss)
        runner.step()
        if step == 1:
            runner.save(folder / "ckpt" / "step-2", {"model": model, "optimizer": optimizer})
            limit = _virtual_bytes() + 256 * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
            limited = True
    raise SystemExit("never ran out of memory")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
