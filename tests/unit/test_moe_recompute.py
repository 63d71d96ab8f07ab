"""Activation checkpointing's recompute and the MoE layer's routing statistics: a checkpointed run counts, balances
and trains as the same run without checkpointing."""

from __future__ import annotations

import copy

import torch

from shardkit.models import Llama, LlamaConfig
from shardkit.models.moe import expert_load, moe_layers, update_router_biases
from shardkit.strategies.activation_checkpointing import ActivationCheckpointing, apply_activation_checkpointing

CONFIG = LlamaConfig.small_moe(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, max_position=16, fused=False,
                               moe={"num_experts": 4, "intermediate_size": 8, "aux_loss_coef": 0.1,
                                    "bias_update_rate": 0.05, "num_shared_experts": 1})


def _train(model: Llama, steps: int = 2) -> dict:
    """Per step: a train-mode forward without grad (an RL trainer's log-probs of its own samples), then a training
    forward and backward, AdamW, the aux-loss-free bias update; the counts are read before each update."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    out: dict = {"loss": [], "counts": [], "bias": [], "load": [], "logged": []}
    for _ in range(steps):
        scored, batch = torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (3, 8), generator=g)
        with torch.no_grad():
            model(scored, labels=scored)
        loss = model(batch, labels=batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["loss"].append(loss.item())
        out["counts"].append([layer.tokens_per_expert.tolist() for layer in moe_layers(model)])
        out["load"].append([layer.last_load.tolist() for layer in moe_layers(model)])
        out["logged"].append(expert_load(model))
        update_router_biases(model)
        out["bias"].append([layer.router.expert_bias.clone() for layer in moe_layers(model)])
    return out


def test_activation_checkpointing_counts_each_token_once():
    torch.manual_seed(0)
    base = Llama(CONFIG).double()
    recomputed = copy.deepcopy(base)
    assert len(apply_activation_checkpointing(recomputed, ActivationCheckpointing())) == 2
    plain, got = _train(base), _train(recomputed)
    # each step's counts are the no-grad forward's plus the training forward's, once each (the recompute in
    # backward counted them a second time)
    assert got["counts"] == plain["counts"]
    assert got["load"] == plain["load"]
    for a, b in zip(got["bias"], plain["bias"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    # the bias moved, and the losses of the later steps (routed by it) are the plain run's
    assert any(bool(b.abs().max() > 0) for b in plain["bias"][-1])
    assert all(abs(x - y) < 1e-10 for x, y in zip(got["loss"], plain["loss"]))
    for a, b in zip(got["logged"], plain["logged"]):
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-12 for k in a)
