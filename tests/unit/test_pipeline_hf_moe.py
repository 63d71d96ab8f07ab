"""Hugging Face MoE decoders cut into pipeline stages (in one process, no schedule): the stages chained give the
model's own hidden states, its router aux loss (transformers' formula over every layer's routers at once, not a sum
per stage) and every gradient, for Mixtral and Qwen3-MoE; an MoE architecture the pipeline does not split is refused
by name."""

from __future__ import annotations

import copy

import pytest
import torch

from shardkit.strategies._pipeline_hf_moe import make_stage
from shardkit.strategies._pipeline_models import UnsplittableModelError, model_layout


def _model(kind: str, **kw):
    import transformers

    common = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                  num_key_value_heads=1, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1,
                  tie_word_embeddings=False, **kw)
    torch.manual_seed(0)
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4, **common))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=8,
                                                                             head_dim=8, **common))
    model.set_experts_implementation("eager")
    return model.double()


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_hf_moe_stages_chained_give_the_models_aux_loss_and_gradients(kind):
    import importlib

    model = _model(kind)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    out = ref.model(input_ids=ids)
    balancing = importlib.import_module(type(ref).__module__).load_balancing_loss_func
    aux = ref.config.router_aux_loss_coef * balancing(out.router_logits, 4, 2, None)
    (out.last_hidden_state.pow(2).mean() + aux).backward()

    layout = model_layout(model)
    assert layout.router_aux
    body = layout.body
    first = make_stage(layout, body.embed_tokens, [body.layers[0]], None, None)
    middle = make_stage(layout, None, [body.layers[1]], None, None)
    last = make_stage(layout, None, [body.layers[2]], body.norm, None)
    h, stats = first(ids)
    h, stats = middle(h, stats)
    final = last(h, stats)  # the aux loss starts its own backward from here, weight 1
    assert torch.allclose(final, out.last_hidden_state, atol=1e-12)
    assert len(last.aux_values) == 1 and abs(last.aux_values[0].item() - aux.item()) < 1e-6, (last.aux_values, aux)
    final.pow(2).mean().backward()
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is None:
            assert want[name].grad is None or not want[name].grad.any(), name
            continue
        assert torch.allclose(p.grad, want[name].grad, atol=1e-6), (name, (p.grad - want[name].grad).abs().max())
    # every stage's routers got the aux loss's gradient
    assert all(want[f"model.layers.{i}.mlp.gate.weight"].grad.abs().max() > 0 for i in range(3))


def test_an_hf_moe_architecture_the_pipeline_does_not_split_is_named():
    import transformers

    config = transformers.Qwen2MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_experts=4, moe_intermediate_size=8,
                                         shared_expert_intermediate_size=8)
    with pytest.raises(UnsplittableModelError, match=r"Qwen2MoeForCausalLM \(model_type 'qwen2_moe'\): it splits HF "
                                                     r"decoders of model_type 'llama', 'mixtral', 'qwen3_moe'"):
        model_layout(transformers.Qwen2MoeForCausalLM(config))
