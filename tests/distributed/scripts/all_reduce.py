"""Run by `shardkit launch`: every rank all-reduces its rank id and checks the sum."""

import torch
import torch.distributed as dist

from shardkit.distributed import destroy_distributed, init_distributed

env = init_distributed("cpu")
total = torch.tensor([float(env.rank)])
dist.all_reduce(total)
expected = env.world_size * (env.world_size - 1) / 2
assert total.item() == expected, f"rank {env.rank}: all_reduce gave {total.item()}, expected {expected}"
print(f"rank {env.rank}/{env.world_size} ({env.source}): sum of ranks = {total.item():g}", flush=True)
destroy_distributed()
