"""Tensor parallelism inside the experts (``ExpertParallel(tp_size=..., expert_tp=True)``) without real collectives:
the sizes (ep borrowed from dp_shard only), the expert mesh each rank gets (a fake process group: the ep group is one
tp coordinate's data-parallel ranks), each tp rank's block of the stacked weights (its rows of gate AND of up, its
columns of down) whose partial SwiGLU outputs sum to the whole expert's, and the named refusals. The 4-rank run
against one device is tests/distributed/test_expert_parallel.py::test_expert_tensor_parallel_equals_one_process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardkit.models.moe_experts import grouped_swiglu
from shardkit.strategies.ep_tensor import _ColumnShare, check_expert_tp
from shardkit.strategies.parallel_dims import ParallelDims
from shardkit.strategies.registry import STRATEGIES


def test_ep_is_borrowed_from_dp_shard_only():
    assert ParallelDims(tp=2, ep=2, expert_tp=True).resolve(4).expert_replicas == 1  # dp_shard 2 over ep 2
    assert ParallelDims(tp=4, ep=2, expert_tp=True).resolve(8).expert_replicas == 1  # etp=1 would refuse ep < tp
    assert ParallelDims(tp=2, ep=2, expert_tp=True).resolve(8).expert_replicas == 2
    with pytest.raises(ValueError, match=r"dp_shard\(2\) % ep\(4\) != 0"):
        ParallelDims(tp=2, ep=4, expert_tp=True).resolve(4)
    with pytest.raises(ValueError, match=r"expert_tp='yes' must be True or False"):
        ParallelDims(expert_tp="yes")


@pytest.mark.parametrize("rank, ep", [(0, [0, 2]), (1, [1, 3]), (2, [0, 2]), (3, [1, 3])])
def test_expert_mesh_ep_group_is_one_tp_coordinate(rank, ep):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=4, store=FakeStore())
    try:
        mesh = ParallelDims(tp=2, ep=2, expert_tp=True).resolve(4).build_expert("cpu")
        assert mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")
        assert mesh["ep"].mesh.tolist() == ep and mesh["tp"].mesh.tolist() == [rank // 2 * 2, rank // 2 * 2 + 1]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp", [2, 4])
def test_each_tp_block_holds_its_gate_and_up_rows_and_the_partials_sum_to_the_expert(tp):
    torch.manual_seed(0)
    experts, hidden, inter = 3, 6, 8
    gate_up = torch.randn(experts, 2 * inter, hidden, dtype=torch.float64)
    down = torch.randn(experts, hidden, inter, dtype=torch.float64)
    tokens, counts = torch.randn(7, hidden, dtype=torch.float64), torch.tensor([3, 0, 4])
    whole = grouped_swiglu(tokens, counts, gate_up, down, "loop")
    partial = torch.zeros_like(whole)
    b = inter // tp
    for r in range(tp):
        gu = _ColumnShare.apply(gate_up, True, r, tp, None, 1.0)
        dn = _ColumnShare.apply(down, False, r, tp, None, 1.0)
        assert torch.equal(gu, torch.cat([gate_up[:, r * b:(r + 1) * b], gate_up[:, inter + r * b:inter + (r + 1) * b]],
                                         dim=1))  # gate's block r and up's block r, not rows [r 2I/tp, (r+1) 2I/tp)
        assert torch.equal(dn, down[:, :, r * b:(r + 1) * b])
        partial += grouped_swiglu(tokens, counts, gu, dn, "loop")
    torch.testing.assert_close(partial, whole, rtol=1e-12, atol=1e-12)


def test_selection_and_refusals():
    ep = STRATEGIES.build_from_cli("ep", ["ep_size=2", "tp_size=2", "expert_tp=true"])
    assert (ep.ep_size, ep.tp_size, ep.dims.expert_tp) == (2, 2, True)
    with pytest.raises(ValueError, match=r"expert_tp=True splits each expert's matrices .*needs tp_size > 1"):
        STRATEGIES.build("ep", ep_size=2, expert_tp=True)
    with pytest.raises(ValueError, match=r"expert_tp=1 must be True or False"):
        STRATEGIES.build("ep", tp_size=2, expert_tp=1)
    with pytest.raises(ValueError, match=r"intermediate size \(6\) % tp\(4\) != 0"):
        check_expert_tp(ParallelDims(tp=4, ep=2, expert_tp=True).resolve(8), 6, "full")
    with pytest.raises(ValueError, match=r"2 ranks holding the same experts .*use expert_sharding='none'"):
        check_expert_tp(ParallelDims(tp=2, ep=2, expert_tp=True).resolve(8), 8, "full")
    check_expert_tp(ParallelDims(tp=2, ep=2, expert_tp=True).resolve(8), 8, "none")
