"""The MoE Llama's pieces for context parallelism, tensor parallelism and pipelines, in one process (the 2-rank
runs against one device are in tests/distributed/test_context_parallel.py): the tensor-parallel plan keeps the
router and routed experts whole, a pipeline stage starts its auxiliary loss's backward, a bias update sums each
layer's counts where its dispatcher says, and what does not compose is refused by name."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel

from shardkit.models import Llama, LlamaConfig
from shardkit.models.llama import llama_plan
from shardkit.models.moe import MoE, MoEConfig, moe_aux_loss, update_router_biases
from shardkit.strategies._pipeline_models import StageModule, model_layout
from shardkit.strategies.context_parallel import _refuse_hf_router_loss
from shardkit.strategies.cp_moe import GroupStatistics, install_statistics

CONFIG = LlamaConfig.small_moe(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, max_position=16,
                               fused=False, moe={"num_experts": 4, "intermediate_size": 8, "aux_loss_coef": 0.1})


def test_tp_plan_splits_attention_and_shared_experts_and_keeps_router_and_experts_whole():
    model = Llama(CONFIG)  # layer 0 dense, layer 1 MoE with a shared expert
    plan = llama_plan(model, 2)
    assert isinstance(plan["layers.0.mlp.gate_proj"], ColwiseParallel)
    assert isinstance(plan["layers.1.mlp.shared_experts.up_proj"], ColwiseParallel)
    assert isinstance(plan["layers.1.mlp.shared_experts.down_proj"], RowwiseParallel)
    assert not [k for k in plan if ".router" in k or ".experts" in k or k.endswith("layers.1.mlp.gate_proj")], plan
    sp = llama_plan(model, 2, sequence_parallel=True)
    # Whole tokens into the MoE layer (the router sees every token), its whole output split back on the sequence.
    assert isinstance(sp["layers.1.mlp"], PrepareModuleInputOutput)
    no_shared = Llama(LlamaConfig.small_moe(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, fused=False,
                                            moe={"num_experts": 4, "num_shared_experts": 0}))
    assert not [k for k in llama_plan(no_shared, 2) if k.startswith("layers.1.mlp")]


def test_pipeline_stage_adds_its_aux_loss_to_the_backward_with_the_runners_weight():
    model = Llama(CONFIG)
    model_layout(model)  # an MoE Llama is splittable (its aux loss reaches the loss through the stages)
    ref, plain = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randint(0, CONFIG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    stage = StageModule(model.embed_tokens, list(model.layers), None, None)
    stage.aux_weight = 0.25
    stage(x).square().sum().backward()  # the stage's output gradient, as the next stage would send it
    hidden = ref.embed_tokens(x)
    for layer in ref.layers:
        hidden = layer(hidden)
    (hidden.square().sum() + 0.25 * moe_aux_loss(ref)).backward()
    router = "layers.1.mlp.router.weight"
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is not None or grads[name].grad is not None:
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-6, atol=1e-8, msg=name)
    assert stage.aux_values and float(stage.aux_values[0]) == pytest.approx(float(moe_aux_loss(ref).detach()))
    # Without the aux loss the router's gradient differs: the check above is not vacuous.
    hidden = plain.embed_tokens(x)
    for layer in plain.layers:
        hidden = layer(hidden)
    hidden.square().sum().backward()
    assert not torch.allclose(dict(plain.named_parameters())[router].grad, grads[router].grad)


def test_bias_update_sums_counts_where_the_dispatcher_says():
    layer = MoE(8, MoEConfig(num_experts=4, top_k=1, intermediate_size=4, bias_update_rate=0.1))
    calls = []

    def world_sum(counts):
        calls.append("world")
        counts.mul_(2)

    layer.tokens_per_expert.copy_(torch.tensor([4.0, 0, 0, 0], dtype=torch.float64))
    layer.dispatcher = types.SimpleNamespace(reduce_counts=lambda counts: calls.append("stage") or True)
    update_router_biases(layer, world_sum)
    assert calls == ["stage"]  # a pipeline stage's layer: its data-parallel peers only, never the world
    layer.tokens_per_expert.copy_(torch.tensor([4.0, 0, 0, 0], dtype=torch.float64))
    layer.dispatcher = GroupStatistics(group=None)  # context parallelism: the caller's sum over the world
    update_router_biases(layer, world_sum)
    assert calls == ["stage", "world"]
    assert layer.router.expert_bias.tolist() == pytest.approx([-0.2, 0.2, 0.2, 0.2])


def test_expert_parallel_dispatcher_is_not_replaced_by_name():
    model = Llama(CONFIG)
    model.layers[1].mlp.dispatcher = object()  # as expert parallelism's all-to-all would be
    with pytest.raises(ValueError, match="expert parallelism does not compose with ContextParallel"):
        install_statistics(model, "ContextParallel", GroupStatistics)


def test_context_parallel_refuses_an_hf_moe_whose_router_loss_it_would_drop():
    def model(**config):
        return types.SimpleNamespace(config=types.SimpleNamespace(**config))

    with pytest.raises(ValueError, match="router_aux_loss_coef=0.001, output_router_logits=True"):
        _refuse_hf_router_loss(model(output_router_logits=True, router_aux_loss_coef=0.001))
    _refuse_hf_router_loss(model(output_router_logits=False, router_aux_loss_coef=0.001))  # HF adds none either
    _refuse_hf_router_loss(model(num_attention_heads=4))  # a dense model


def test_activation_checkpointing_keeps_the_aux_loss_gradient_and_reentrant_is_refused():
    from shardkit.strategies.activation_checkpointing import (
        ActivationCheckpointing,
        ActivationCheckpointingError,
        apply_activation_checkpointing,
    )

    torch.manual_seed(0)
    base = Llama(CONFIG).double()
    batch = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))

    def grads(model):
        model(batch, labels=batch).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    plain = grads(copy.deepcopy(base))
    recomputed = copy.deepcopy(base)
    assert len(apply_activation_checkpointing(recomputed, ActivationCheckpointing())) == 2
    got = grads(recomputed)
    assert all(torch.allclose(got[n], plain[n]) for n in plain)
    # Reentrant checkpointing runs the block without grad: the aux loss's value would count, its gradient not.
    with pytest.raises(ActivationCheckpointingError, match=r"use_reentrant=True cannot checkpoint LlamaBlock: its "
                                                           r"MoE layer MoE adds an auxiliary loss"):
        apply_activation_checkpointing(copy.deepcopy(base), ActivationCheckpointing(use_reentrant=True))
    no_aux = Llama(LlamaConfig.small_moe(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, fused=False,
                                         moe={"num_experts": 4, "aux_loss_coef": 0.0}))
    assert len(apply_activation_checkpointing(no_aux, ActivationCheckpointing(use_reentrant=True))) == 2


def test_a_statistics_dispatcher_keeps_the_one_device_routed_path():
    """Context parallelism and pipelines keep every expert on the rank: the layer runs the same routed function as
    on one device (its bf16 sums in fp32, the same tensors kept for the backward), not the sorted-copy form."""
    torch.manual_seed(0)
    local = MoE(16, MoEConfig(num_experts=4, top_k=4, intermediate_size=8))
    split = copy.deepcopy(local)
    split.dispatcher = GroupStatistics(group=None)
    x = torch.randn(3, 16, 16)

    def saved_bytes(layer, inputs):
        sizes = []

        def pack(t):
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(inputs)
        return out, sum(sizes)

    local(x)  # the engine's one-time probe of torch._grouped_mm runs outside the count
    want, want_bytes = saved_bytes(local, x)
    got, got_bytes = saved_bytes(split, x)
    assert got_bytes == want_bytes
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(split.bfloat16()(x.bfloat16()), local.bfloat16()(x.bfloat16()))
