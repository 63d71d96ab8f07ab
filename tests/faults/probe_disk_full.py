"""Saves under a file-size limit, as a full disk would stop it: ``python probe_disk_full.py LIMIT KIND PATH ...``.

Each ``KIND PATH`` pair is ``export`` (``save_pretrained`` of a 256 KB model into PATH) or ``save``
(``Runner.save`` of it to PATH). RLIMIT_FSIZE makes every write past LIMIT bytes fail with EFBIG (Python ignores
SIGXFSZ). Prints one JSON line per pair: ``{"kind", "error": type or null, "message": str}``.
"""

from __future__ import annotations

import json
import resource
import sys

import torch
from torch import nn

from shardkit import Runner
from shardkit.checkpoint.hf import save_pretrained


def main(limit: int, jobs: list[str]) -> None:
    torch.manual_seed(1)
    runner = Runner(seed=0)
    model = runner.setup(nn.Linear(256, 256))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    for kind, path in zip(jobs[::2], jobs[1::2]):
        try:
            if kind == "export":
                save_pretrained(runner, path, model)
            else:
                runner.save(path, {"model": model})
            error, message = None, "saved"
        except Exception as e:  # noqa: BLE001 - the probe reports whatever comes out, bare errors included
            error, message = type(e).__name__, str(e)
        print(json.dumps({"kind": kind, "error": error, "message": message}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
