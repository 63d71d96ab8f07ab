"""Padding in MoE layers: masked tokens take no expert capacity and stay out of the routing statistics."""

from __future__ import annotations

import pytest
import torch

from shardkit.models.llama import Llama, LlamaConfig
from shardkit.models.moe import MoE, MoEConfig, moe_layers, update_router_biases
from shardkit.strategies.cp_moe import GroupStatistics


def _moe_llama(**moe) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.small_moe(moe=moe, fused=False))


def _left_pad(row: torch.Tensor, pad: int, pad_id: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([torch.full((1, pad), pad_id, dtype=row.dtype), row], dim=1)
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(row)], dim=1)
    return ids, mask


def test_left_padded_row_at_capacity_equals_the_row_alone() -> None:
    model = _moe_llama(capacity_factor=1.0).eval()
    row = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    ids, mask = _left_pad(row, 6)
    with torch.no_grad():
        alone = model(row)
        padded = model(ids, attention_mask=mask)
    torch.testing.assert_close(padded[:, 6:], alone, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(padded).all()
    greedy = model.generate(row, 5)
    assert torch.equal(model.generate(ids, 5, attention_mask=mask)[:, 6:], greedy)


def test_padded_llama_batch_counts_only_real_tokens() -> None:
    model = _moe_llama(capacity_factor=1.0, bias_update_rate=0.01).train()
    row = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(2))
    labels = row.clone()
    model(row, labels=labels)
    alone = [(m.last_load.clone(), m.aux_loss.detach().clone(), m.tokens_per_expert.clone(), m.dropped)
             for m in moe_layers(model)]
    update_router_biases(model)
    bias_alone = [m.router.expert_bias.clone() for m in moe_layers(model)]
    for m in moe_layers(model):
        m.router.expert_bias.zero_()
    ids, mask = _left_pad(row, 8)
    model(ids, labels=torch.cat([torch.full((1, 8), -100), labels], dim=1), attention_mask=mask)
    for m, (load, aux, counts, dropped) in zip(moe_layers(model), alone):
        assert torch.equal(m.last_load, load) and torch.equal(m.tokens_per_expert, counts) and m.dropped == dropped
        torch.testing.assert_close(m.aux_loss.detach(), aux, rtol=1e-6, atol=1e-9)
    update_router_biases(model)
    for m, bias in zip(moe_layers(model), bias_alone):
        assert torch.equal(m.router.expert_bias, bias)


def _layer(**fields) -> MoE:
    torch.manual_seed(3)
    cfg = MoEConfig(num_experts=4, top_k=2, intermediate_size=8, aux_loss_coef=0.5, **fields)
    return MoE(16, cfg).double().train()


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("dispatcher", [False, True])
def test_masked_tokens_statistics_equal_hand_computation(score_func: str, dispatcher: bool) -> None:
    layer = _layer(score_func=score_func, bias_update_rate=0.1)
    if dispatcher:  # the dispatcher path (expert and context parallelism's slot) with nothing to reduce
        layer.dispatcher = GroupStatistics(None)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 9, 16, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, :5] = False
    mask[1, :2] = False
    # the padding all points at expert 0: counted, it would overload expert 0 and move its bias
    x[~mask] = layer.router.weight[0].detach() * 50
    out = layer(x, token_mask=mask)
    real = x[mask]
    scores = real @ layer.router.weight.detach().T
    scores = scores.softmax(-1) if score_func == "softmax" else scores.sigmoid()
    picked = torch.topk(scores, 2, dim=-1).indices
    load = torch.bincount(picked.reshape(-1), minlength=4).double()
    probs = scores if score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
    n = real.shape[0]
    aux = 0.5 * ((4 / (2 * n)) * load * probs.mean(0)).sum()
    assert torch.equal(layer.last_load, load) and torch.equal(layer.tokens_per_expert, load)
    torch.testing.assert_close(layer.aux_loss.detach(), aux, rtol=1e-12, atol=1e-15)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[mask], layer(real), rtol=1e-12, atol=1e-12)  # the real tokens alone
    layer.tokens_per_expert.copy_(load)
    update_router_biases(layer)
    torch.testing.assert_close(layer.router.expert_bias, 0.1 * torch.sign(load.mean() - load))


def test_masked_tokens_take_no_capacity() -> None:
    layer = _layer(capacity_factor=1.0).eval()
    g = torch.Generator().manual_seed(5)
    real = torch.randn(1, 6, 16, generator=g, dtype=torch.float64)
    pad = layer.router.weight[0].detach().expand(1, 10, 16) * 50  # first in token order, all to expert 0
    x = torch.cat([pad, real], dim=1)
    mask = torch.cat([torch.zeros(1, 10, dtype=torch.bool), torch.ones(1, 6, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        alone = layer(real)
        dropped_alone = layer.dropped
        out = layer(x, token_mask=mask)
    torch.testing.assert_close(out[:, 10:], alone, rtol=1e-12, atol=1e-12)
    assert layer.dropped == dropped_alone


def test_token_mask_of_another_shape_is_refused() -> None:
    layer = _layer()
    with pytest.raises(ValueError, match="token_mask of shape"):
        layer(torch.randn(2, 3, 16, dtype=torch.float64), token_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="booleans or 0/1"):
        layer(torch.randn(2, 3, 16, dtype=torch.float64), token_mask=torch.ones(2, 3))


def test_pipeline_refuses_a_padded_attention_mask_by_name() -> None:
    """Pipeline stages carry no mask, so padding would be routed (and attended): the forward refuses it."""
    from types import SimpleNamespace

    from shardkit.strategies._pipeline_stages import _pipeline_forward

    ids = torch.zeros(2, 4, dtype=torch.long)
    mask = torch.ones(2, 4, dtype=torch.long)
    mask[0, 0] = 0
    with pytest.raises(NotImplementedError, match="Pipeline: an attention_mask with padding"):
        _pipeline_forward(SimpleNamespace(_shardkit_pipeline=None), ids, labels=ids, attention_mask=mask)
