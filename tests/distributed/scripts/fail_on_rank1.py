"""Run by `shardkit launch`: rank 1 raises while rank 0 waits in a collective."""

import torch
import torch.distributed as dist

from shardkit.distributed import init_distributed

env = init_distributed("cpu")
if env.rank == 1:
    raise RuntimeError("rank 1 fails on purpose")
dist.all_reduce(torch.ones(1))
