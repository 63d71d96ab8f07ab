"""The facts a strategy declares for the fronts and tools that ask about it, so that none of them checks its class.

- :class:`StrategyFamily`: the engine family, which Accelerate's ``DistributedType`` and the Trainer's
  ``is_fsdp_enabled`` / ``is_deepspeed_enabled`` are read from (``Strategy.family``);
- :class:`MemoryJob` and :class:`StateBytes`: what the memory estimator asks and what each strategy answers from its
  own settings (``Strategy.model_state_memory``), so ``shardkit.memory`` knows no strategy by name and a new
  strategy is estimated by the formula it inherits or overrides.

Plain values only (no torch): ``shardkit estimate-memory --help`` imports this without torch.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = ["MemoryJob", "StateBytes", "StrategyFamily"]


class StrategyFamily(enum.Enum):
    """Which engine holds the model states, as the fronts name it: Accelerate's ``DistributedType`` and the
    Trainer's ``is_fsdp_enabled`` / ``is_deepspeed_enabled`` are read from it, never from a strategy's class.

    ``SINGLE``: one process (Accelerate's NO). ``DATA_PARALLEL``: torch collectives over whole or tensor-parallel
    weights, no FSDP2 sharding over the data-parallel ranks (MULTI_GPU / MULTI_CPU by device; NO in a world of
    one). ``FSDP``: FSDP2 shards the parameters over data-parallel ranks (Accelerate's FSDP, as its ND
    parallelism runs dp_shard and cp under it). ``DEEPSPEED``: DeepSpeed's engine.
    """

    SINGLE = "single"
    DATA_PARALLEL = "data_parallel"
    FSDP = "fsdp"
    DEEPSPEED = "deepspeed"


@dataclass(frozen=True)
class MemoryJob:
    """The model and job a per-rank estimate is for (Adam: two optimizer states per parameter).

    Attributes:
        params: Ψ, the model's parameters (tied ones once).
        largest_layer: parameters of the largest single module (what a sharded engine gathers at once).
        tp_params: parameters tensor parallelism splits (None: all of them).
        ranks: N, every rank of the job; ranks_per_node: G, the ranks of one node.
        param_bytes, grad_bytes, master_bytes, state_bytes: bytes per parameter of the parameters, their
            gradients, a separate fp32 master copy (0 where the engine steps the parameters themselves) and the
            optimizer's states, under the precision asked about.
        tp_size, pp_size: tensor-parallel and pipeline ranks asked about (None: the strategy's own, else a node).
        ep_size: expert-parallel ranks asked about (None: the strategy's own).
        expert_params: of ``params``, a mixture of experts' routed experts (every MoE layer's; expert parallelism
            splits them, the rest is dense); 0: a dense model, or not known.
        expert_block: one MoE layer's routed experts, all of them (the largest such layer): the unit an engine
            gathers for the experts.
        largest_dense_layer: the largest module outside the routed experts (None: ``largest_layer``).
        bucket: elements of a gradient reduction bucket (0: none counted).
        params_in_cpu: parameter elements per rank an NVMe-offloading engine keeps in host memory.
    """

    params: int
    largest_layer: int
    ranks: int
    ranks_per_node: int
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    state_bytes: int
    tp_params: int | None = None
    tp_size: int | None = None
    pp_size: int | None = None
    bucket: int = 0
    params_in_cpu: int = 0
    ep_size: int | None = None
    expert_params: int = 0
    expert_block: int = 0
    largest_dense_layer: int | None = None

    @property
    def optimizer_bytes(self) -> int:
        """Bytes per parameter the optimizer holds: the master copy and the states."""
        return self.master_bytes + self.state_bytes

    def share(self, amount: int, ways: int | None = None) -> int:
        """One rank's part of ``amount`` split ``ways`` ways (default: every rank), rounded up."""
        return math.ceil(amount / (ways or self.ranks))


@dataclass(frozen=True)
class StateBytes:
    """Bytes of model states one rank holds under a strategy.

    Attributes:
        params, grads, optimizer: held on the device between steps (optimizer includes an fp32 master).
        working: gathered on top during forward and backward (a sharded engine's layer, grad_op's whole model).
        host: held in CPU memory (offloaded states); nvme: swapped out to NVMe (not held in memory).
    """

    params: int
    grads: int
    optimizer: int
    working: int = 0
    host: int = 0
    nvme: int = 0

    @classmethod
    def replicated(cls, job: MemoryJob, held: int | None = None) -> StateBytes:
        """Every rank holds ``held`` parameters (default: all of them) whole, with their gradients and states."""
        n = job.params if held is None else held
        return cls(n * job.param_bytes, n * job.grad_bytes, n * job.optimizer_bytes)

    @classmethod
    def sharded(cls, job: MemoryJob, ways: int | None = None) -> StateBytes:
        """Parameters, gradients and states split ``ways`` ways (default: every rank); the largest layer gathered."""
        psi = job.params
        return cls(job.share(psi * job.param_bytes, ways), job.share(psi * job.grad_bytes, ways),
                   job.share(psi * job.optimizer_bytes, ways), working=job.largest_layer * job.param_bytes)
