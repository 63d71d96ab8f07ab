"""Tensor parallelism inside the experts (``ExpertParallel(tp_size=..., expert_tp=True)``) without real collectives:
the sizes (ep borrowed from dp_shard only), the expert mesh each rank gets (a fake process group: the ep group is one
tp coordinate's data-parallel ranks), each tp rank's block of the stacked weights (its rows of gate AND of up, its
columns of down) whose partial SwiGLU outputs sum to the whole expert's, the boxes of the global weight that block is
(what checkpoints and the init replay read and write), and the named refusals. The 4-rank run
against one device is tests/distributed/test_expert_parallel.py::test_expert_tensor_parallel_equals_one_process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from shardkit.models.moe_experts import grouped_swiglu
from shardkit.strategies.ep_expert_tp import expert_tp_block, expert_tp_placement
from shardkit.strategies.ep_tensor import check_expert_tp
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
        gu = expert_tp_block(gate_up, "gate_up_proj", r, tp)
        dn = expert_tp_block(down, "down_proj", r, tp)
        assert torch.equal(gu, torch.cat([gate_up[:, r * b:(r + 1) * b], gate_up[:, inter + r * b:inter + (r + 1) * b]],
                                         dim=1))  # gate's block r and up's block r, not rows [r 2I/tp, (r+1) 2I/tp)
        assert torch.equal(dn, down[:, :, r * b:(r + 1) * b])
        partial += grouped_swiglu(tokens, counts, gu, dn, "loop")
    torch.testing.assert_close(partial, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rank", range(4))
def test_each_rank_holds_its_block_as_boxes_of_the_global_weight(rank):
    """ep 2 x tp 2 (a fake process group): the DTensor a rank holds is its block only (1/4 of the stacked weight), and
    the boxes the checkpoints and the init replay read are where that block lies in the global weight."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardkit.strategies._dtensor import dtensor_box, dtensor_boxes, local_part

    dist.init_process_group("fake", rank=rank, world_size=4, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
        ep, tp = rank // 2, rank % 2
        full = {"gate_up_proj": torch.arange(4 * 16 * 3.0).reshape(4, 16, 3),
                "down_proj": torch.arange(4 * 3 * 8.0).reshape(4, 3, 8)}
        for name, whole in full.items():
            block = expert_tp_block(whole[2 * ep:2 * ep + 2], name, tp, 2)
            t = DTensor.from_local(block, mesh, [Shard(0), expert_tp_placement(name)], run_check=False,
                                   shape=whole.shape, stride=whole.stride())
            assert block.numel() * 4 == whole.numel()
            boxes = dtensor_boxes(t)
            rebuilt = torch.empty_like(block)
            for offsets, shape, index in boxes:
                rebuilt[index] = whole[tuple(slice(o, o + s) for o, s in zip(offsets, shape))]
            assert torch.equal(rebuilt, block) and torch.equal(local_part(whole, t), block)
        block = expert_tp_block(full["gate_up_proj"][2 * ep:2 * ep + 2], "gate_up_proj", tp, 2)
        gate_up = DTensor.from_local(block, mesh, [Shard(0), expert_tp_placement("gate_up_proj")], run_check=False,
                                     shape=(4, 16, 3), stride=(48, 3, 1))
        # gate rows [4 tp, 4 tp + 4) and up rows [8 + 4 tp, ...): two boxes; one offset would be the wrong data
        assert [b[:2] for b in dtensor_boxes(gate_up)] == [((2 * ep, 4 * tp, 0), (2, 4, 3)),
                                                           ((2 * ep, 8 + 4 * tp, 0), (2, 4, 3))]
        with pytest.raises(ValueError, match="holds 2 boxes"):
            dtensor_box(gate_up)
        # a replica dimension in front (expert_sharding="none") leaves the boxes as they are
        wide = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("rep", "ep", "tp"))
        again = DTensor.from_local(block, wide, [Replicate(), Shard(0), expert_tp_placement("gate_up_proj")],
                                   run_check=False, shape=(4, 16, 3), stride=(48, 3, 1))
        assert [b[:2] for b in dtensor_boxes(again)] == [b[:2] for b in dtensor_boxes(gate_up)]
    finally:
        dist.destroy_process_group()


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
