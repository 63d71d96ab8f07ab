"""For tests/faults/test_oom_kill.py: a Runner loop under `shardkit launch` whose rank 1 holds 64 MiB more each
step from step 3 on, until the kernel's out-of-memory killer ends it (the test caps the job's memory with a cgroup)."""
import torch

from shardkit import Runner

runner = Runner(strategy="ddp", seed=0)
model = torch.nn.Linear(256, 256)
model, opt = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
hoard = []
for step in range(200):  # 12.8 GiB by the end: past any cap the test sets
    loss = model(torch.randn(8, 256)).pow(2).mean()
    runner.backward(loss)
    runner.step()
    if step >= 3 and runner.rank == 1:
        hoard.append(torch.ones(64 * 2**20 // 4))  # 64 MiB a step, touched
runner.teardown()
