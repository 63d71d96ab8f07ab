"""The expert-parallel combine (the experts' outputs weighted and summed per token after the all-to-all) sums as the
one-device routed function does: in fp32 for bf16 activations, so the two paths give the same bits. The dispatch is
stood in for by one that keeps every expert here (no process group), which runs the same combine code."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardkit.models.moe import MoE, MoEConfig
from shardkit.models.moe_hf import _grouped_forward
from shardkit.strategies.expert_parallel import _hf_expert_parallel_forward


class _HereDispatch:
    """An expert-parallel dispatcher of one rank: the all-to-alls are the identity, the combine is the layer's."""

    routes_locally = False

    def run(self, experts, tokens, counts):
        return experts(tokens, counts)

    def global_sum(self, local):
        return local

    def global_counts(self, local):
        return local

    def weight_view(self, weight):
        return weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_expert_parallel_combine_sums_as_the_one_device_function(dtype):
    torch.manual_seed(0)
    local = MoE(64, MoEConfig(num_experts=4, top_k=4, intermediate_size=32, experts_backend="loop")).to(dtype)
    ep = copy.deepcopy(local)
    ep.dispatcher = _HereDispatch()
    x = torch.randn(4, 16, 64).to(dtype).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    want, got = local(x), ep(x2)
    # top_k = 4: each token sums 4 outputs; summed in the low precision they round 3 more times
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    want.float().square().sum().backward()
    got.float().square().sum().backward()
    # the backward's products run in another order (its autograd against the routed function's own), so only close
    assert torch.allclose(x2.grad.float(), x.grad.float(), rtol=2e-2, atol=2e-2 * float(x.grad.float().abs().max()))


_SUMS = {torch.ops.aten.index_add.default, torch.ops.aten.index_add_.default, torch.ops.aten.index_put.default,
         torch.ops.aten.index_put_.default, torch.ops.aten._index_put_impl_.default}


class _SumDtypes(TorchDispatchMode):
    """The dtypes of the sums by index an MoE forward and backward run (a gather's gradient, a combine)."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SUMS:
            if "index_add" in func.__name__:
                index = args[2]
            else:
                accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
                index = args[1][0] if accumulate else None
            # rows added into a total (a chunk of them, or several per row), not a permutation's scatter
            if index is not None and not index.unique().numel() == index.numel() == args[0].shape[0]:
                self.dtypes.add(args[0].dtype)
        return func(*args, **kwargs)


def test_expert_parallel_sums_over_assignments_run_in_fp32_as_on_one_device():
    """The top-k outputs of a token (forward) and the gradients of its k copies (backward) are summed in fp32 by both
    the one-device routed function and the expert-parallel combine (CUDA's bf16 index_add rounds per addition)."""
    torch.manual_seed(0)
    local = MoE(32, MoEConfig(num_experts=4, top_k=2, intermediate_size=16, experts_backend="loop")).bfloat16()
    ep = copy.deepcopy(local)
    ep.dispatcher = _HereDispatch()
    found = []
    for layer in (local, ep):
        x = torch.randn(24, 32).bfloat16().requires_grad_()
        with _SumDtypes() as mode:
            layer(x).float().sum().backward()
        found.append(mode.dtypes)
    assert found == [{torch.float32}, {torch.float32}]


class _HFBlock(nn.Module):
    """transformers 5's expert block layout (Qwen3-MoE's): stacked gate_up_proj / down_proj, an act_fn."""

    def __init__(self, experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, hidden) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inter) * 0.1)
        self.act_fn = nn.SiLU()


def test_hf_expert_parallel_combine_sums_as_the_one_device_function():
    torch.manual_seed(0)
    one = _HFBlock(4, 64, 32).bfloat16()
    one._shardkit_backend = "loop"
    ep = copy.deepcopy(one)
    ep._shardkit_dispatch = _HereDispatch()
    x = torch.randn(48, 64).bfloat16()
    index = torch.stack([torch.randperm(4)[:4] for _ in range(48)])
    weights = torch.rand(48, 4).softmax(-1).bfloat16()
    want = types.MethodType(_grouped_forward, one)(x, index, weights)
    got = types.MethodType(_hf_expert_parallel_forward, ep)(x, index, weights)
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
