"""Hugging Face MoE expert blocks run by shardkit (``use_grouped_experts``) leave padding out of the experts: a
left-padded row's real tokens route, load and come out as the row alone, also under a KV cache (generation) and
activation checkpointing's recompute; the router's aux loss stays transformers' own formula over the real tokens."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func  # noqa: E402

from shardkit.models.moe_hf import hf_expert_modules, use_grouped_experts  # noqa: E402

PAD = 5


def _model(**extra) -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                                         pad_token_id=0, **extra)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).float()
    model.set_experts_implementation("eager")
    assert use_grouped_experts(model, backend="loop") == 2
    return model


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, 64, (1, 6), generator=g), torch.randint(1, 64, (1, 6 + PAD), generator=g)


def _padded(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.cat([torch.cat([torch.zeros(1, PAD, dtype=a.dtype), a], 1), b])
    mask = torch.ones_like(ids)
    mask[0, :PAD] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _loads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [block.last_load.clone() for block in hf_expert_modules(model)]


def test_padded_rows_route_load_and_output_as_alone_and_the_aux_loss_is_transformers():
    model = _model(output_router_logits=True, router_aux_loss_coef=0.1)
    a, b = _rows()
    alone = []
    for row in (a, b):
        out = model(input_ids=row)
        alone.append((out.logits, _loads(model), out.router_logits))
    ids, mask, positions = _padded(a, b)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions)
    assert torch.allclose(out.logits[0, PAD:], alone[0][0][0], atol=1e-5)
    assert torch.allclose(out.logits[1], alone[1][0][0], atol=1e-5)
    # padding runs no expert: each block's load is the two rows' loads alone
    assert all(torch.equal(got, x + y) for got, x, y in zip(_loads(model), alone[0][1], alone[1][1]))
    # the aux loss: transformers' load_balancing_loss_func over the real tokens' router logits alone
    real = tuple(torch.cat([x, y]) for x, y in zip(alone[0][2], alone[1][2]))
    want = load_balancing_loss_func(real, 4, 2)
    assert torch.allclose(out.aux_loss, want, atol=1e-6), (out.aux_loss, want)
    # without a mask (or an all-ones one, as packed sequences give) everything routes, padding included
    model(input_ids=ids, position_ids=positions)
    assert all(int(load.sum()) == ids.numel() * 2 for load in _loads(model))


def test_generation_with_a_kv_cache_masks_the_new_tokens_only():
    model = _model().eval()
    a, b = _rows()
    ids, mask, _ = _padded(a, b)
    with torch.no_grad():
        want = model.generate(a, max_new_tokens=4, do_sample=False)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        # each decode step routes the batch's 2 new tokens
        assert all(int(load.sum()) == 2 * 2 for load in _loads(model))
    assert torch.equal(got[0, PAD:], want[0])
    # a prompt fed in two chunks through the cache: the second call's mask covers both, its tokens are the last 7
    # columns (one of them padding)
    with torch.no_grad():
        whole = model(input_ids=ids, attention_mask=mask).logits
        first = model(input_ids=ids[:, :4], attention_mask=mask[:, :4], use_cache=True)
        second = model(input_ids=ids[:, 4:], attention_mask=mask, past_key_values=first.past_key_values)
    assert all(int(load.sum()) == (6 + 7) * 2 for load in _loads(model))
    assert torch.allclose(second.logits[0, PAD - 4:], whole[0, PAD:], atol=1e-5)
    assert torch.allclose(second.logits[1], whole[1, 4:], atol=1e-5)


def test_activation_checkpointing_recomputes_the_padded_routing():
    model = _model().train()
    checkpointed = copy.deepcopy(model)
    use_grouped_experts(checkpointed, backend="loop")
    checkpointed.activation_checkpointing_enable({"use_reentrant": False})
    ids, mask, positions = _padded(*_rows())
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for m in (model, checkpointed):
        m(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert all(torch.allclose(grads[1][n], g, atol=1e-6) for n, g in grads[0].items())
