"""The MoE layer against a per-expert reference loop written here, its routing rules, losses and the MoE Llama."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from shardkit.models import Llama, LlamaConfig
from shardkit.models.moe import MoE, MoEConfig, expert_load, moe_aux_loss, update_router_biases
from shardkit.models.moe_experts import grouped_mm_works

H = 16
BACKENDS = ["loop", "bmm"] + (["grouped_mm"] if grouped_mm_works("cpu", torch.float64) else [])


def reference(layer: MoE, x: torch.Tensor, drop: set[tuple[int, int]] = frozenset()) -> torch.Tensor:
    """The layer's function written the plain way: per token, its k chosen experts one by one (HF's loop form)."""
    cfg = layer.config
    logits = x @ layer.router.weight.T
    scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
    choice = (scores + layer.router.expert_bias).detach()
    out = torch.zeros_like(x)
    gu, dn = layer.experts.gate_up_proj, layer.experts.down_proj
    for t in range(x.shape[0]):
        # highest first, ties to the lower index
        ranked = sorted(range(cfg.num_experts), key=lambda e: (-float(choice[t, e]), e))[: cfg.top_k]
        w = scores[t, ranked]
        if cfg.norm_topk_prob:
            w = w / w.sum()
        for weight, e in zip(w * cfg.route_scale, ranked):
            if (t, e) in drop:
                continue
            gate, up = (gu[e] @ x[t]).chunk(2)
            out[t] = out[t] + weight * (dn[e] @ (F.silu(gate) * up))
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(x)
    return out


def _layer(seed: int = 0, **fields) -> MoE:
    torch.manual_seed(seed)
    cfg = MoEConfig(**{"num_experts": 4, "top_k": 2, "intermediate_size": 8, **fields})
    return MoE(H, cfg).double()


def _grads(layer: MoE, out: torch.Tensor) -> dict[str, torch.Tensor]:
    layer.zero_grad()
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return {n: p.grad.clone() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("score_func,shared", [("softmax", 0), ("sigmoid", 1)])
def test_dropless_routing_equals_a_per_expert_loop_in_fp64(backend, score_func, shared):
    layer = _layer(experts_backend=backend, score_func=score_func, num_shared_experts=shared, aux_loss_coef=0.0,
                   norm_topk_prob=score_func == "sigmoid", route_scale=1.5)
    x = torch.randn(3, 5, H, dtype=torch.float64)
    got = layer(x)
    want = reference(layer, x.reshape(-1, H)).reshape(x.shape)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g_got, g_want = _grads(layer, got), _grads(layer, want)
    for name in g_want:
        torch.testing.assert_close(g_got[name], g_want[name], rtol=1e-10, atol=1e-12, msg=name)
    assert layer.dropped == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_expert_without_tokens_gets_a_zero_gradient_not_none(backend):
    layer = _layer(experts_backend=backend)
    layer.router.expert_bias[2] = -1e9  # never chosen
    x = torch.randn(10, H, dtype=torch.float64)
    out = layer(x)
    assert layer.last_load[2] == 0 and layer.last_load.sum() == 10 * 2
    torch.testing.assert_close(out, reference(layer, x), rtol=1e-12, atol=1e-12)
    grads = _grads(layer, out)
    assert grads["experts.gate_up_proj"][2].abs().max() == 0 and grads["experts.down_proj"][2].abs().max() == 0
    assert grads["experts.gate_up_proj"][0].abs().max() > 0
    # every token to one expert: the others' gradients are zero too, and the layer still equals the reference
    layer.router.expert_bias.copy_(torch.tensor([0.0, 1e9, -1e9, -1e9]))
    x = torch.randn(4, H, dtype=torch.float64)
    torch.testing.assert_close(layer(x), reference(layer, x), rtol=1e-12, atol=1e-12)


def test_top_k_ties_pick_the_lower_expert_indices():
    layer = _layer(num_experts=6, top_k=3)
    with torch.no_grad():
        layer.router.weight.zero_()  # every score equal
    _, picked, weights = layer.router(torch.randn(7, H, dtype=torch.float64))
    assert picked.tolist() == [[0, 1, 2]] * 7
    torch.testing.assert_close(weights, torch.full((7, 3), 1 / 3, dtype=torch.float64))
    # a tie between two experts further down: the lower index wins it
    layer.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.5, 0.5, 0.5]))
    _, picked, _ = layer.router(torch.randn(2, H, dtype=torch.float64))
    assert picked.tolist() == [[3, 4, 5]] * 2


def test_capacity_overflow_is_dropped_in_token_order_and_counted():
    layer = _layer(capacity_factor=1.0)
    layer.router.expert_bias.copy_(torch.tensor([1e9, 1e9, 0.0, 0.0]))  # every token picks experts 0 and 1
    x = torch.randn(6, H, dtype=torch.float64)
    capacity = math.ceil(1.0 * 6 * 2 / 4)  # 3 per expert
    out = layer(x)
    assert layer.dropped == 2 * (6 - capacity)
    dropped = {(t, e) for t in range(capacity, 6) for e in (0, 1)}
    torch.testing.assert_close(out, reference(layer, x, dropped), rtol=1e-12, atol=1e-12)
    assert expert_load(torch.nn.Sequential(layer))["moe/layer0/dropped"] == 2 * (6 - capacity)
    layer.config = MoEConfig(num_experts=4, top_k=2, intermediate_size=8, capacity_factor=100.0)
    layer(x)
    assert layer.dropped == 0


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_loss_equals_a_hand_computation(score_func):
    layer = _layer(score_func=score_func, aux_loss_coef=0.1, num_experts=5, top_k=2)
    x = torch.randn(9, H, dtype=torch.float64)
    layer(x)
    scores = (x @ layer.router.weight.T)
    scores = scores.softmax(-1) if score_func == "softmax" else scores.sigmoid()
    picked = scores.topk(2, dim=-1).indices
    counts = torch.zeros(5, dtype=torch.float64)
    for row in picked.tolist():
        for e in row:
            counts[e] += 1
    probs = scores / scores.sum(-1, keepdim=True)
    f = counts * 5 / (2 * 9)
    want = 0.1 * (f * probs.mean(0)).sum()
    torch.testing.assert_close(layer.aux_loss, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(moe_aux_loss(torch.nn.Sequential(layer, _layer(1))), layer.aux_loss)
    # uniform scores give sum f * P = 1 whatever the picks: the loss is the coefficient
    with torch.no_grad():
        layer.router.weight.zero_()
    layer(torch.randn(10, H, dtype=torch.float64))
    torch.testing.assert_close(layer.aux_loss, torch.tensor(0.1, dtype=torch.float64))
    layer.eval()
    layer(x)
    assert layer.aux_loss is None


def test_bias_update_moves_towards_the_underloaded_experts():
    layer = _layer(bias_update_rate=0.01, aux_loss_coef=0.0)
    layer.router.expert_bias.copy_(torch.tensor([0.5, 0.0, 0.0, -0.5]))  # experts 0 and 1,2 favoured, 3 shunned
    for _ in range(2):
        layer(torch.randn(8, H, dtype=torch.float64))
    load = layer.tokens_per_expert.clone()
    before = layer.router.expert_bias.clone()
    assert update_router_biases(layer) == 1
    step = layer.router.expert_bias - before
    for e in range(4):
        want = 0.01 * (1 if load[e] < load.mean() else -1 if load[e] > load.mean() else 0)
        assert step[e].item() == pytest.approx(want), (e, load)
    assert step[3] > 0 and step[0] < 0
    assert layer.tokens_per_expert.sum() == 0  # the counts restart
    # a sum over ranks (all_reduce) scales the counts: the direction stays
    layer(torch.randn(8, H, dtype=torch.float64))
    load = layer.tokens_per_expert.clone()
    before = layer.router.expert_bias.clone()
    update_router_biases(layer, all_reduce=lambda t: t.mul_(2))
    want = 0.01 * torch.sign(load.mean() - load).to(before.dtype)
    torch.testing.assert_close(layer.router.expert_bias - before, want)


def test_config_errors_are_named():
    with pytest.raises(ValueError, match="top_k\\(9\\) > num_experts\\(8\\)"):
        MoEConfig(top_k=9)
    with pytest.raises(ValueError, match="did you mean 'sigmoid'"):
        MoEConfig(score_func="sigmoidd")
    with pytest.raises(ValueError, match="capacity_factor"):
        MoEConfig(capacity_factor=0)
    with pytest.raises(ValueError, match="no field 'num_expert'"):
        LlamaConfig(moe={"num_expert": 4})
    # each of these was accepted and changed the layer unsaid (NaN or sign-flipped weights, a string read as True,
    # a width of 0 read as intermediate_size)
    for fields, match in [({"route_scale": float("nan")}, "route_scale=nan"), ({"route_scale": -1.0}, "route_scale"),
                          ({"norm_topk_prob": "false"}, "norm_topk_prob='false'"),
                          ({"num_shared_experts": 1, "shared_intermediate_size": 0}, "shared_intermediate_size=0")]:
        with pytest.raises(ValueError, match=match):
            MoEConfig(**fields)
    assert MoEConfig(route_scale=2.5, shared_intermediate_size=16).route_scale == 2.5


def test_a_tiny_moe_llama_learns_and_reports_its_load():
    torch.manual_seed(0)
    cfg = LlamaConfig.small_moe(fused=False, num_layers=2, moe={"bias_update_rate": 1e-3})
    assert LlamaConfig(**cfg.to_dict()) == cfg  # the nested config round-trips through a dict
    model = Llama(cfg)
    assert type(model.layers[0].mlp).__name__ != "MoE" and isinstance(model.layers[1].mlp, MoE)
    data = torch.randint(0, 32, (2, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        loss = model(data, labels=data)
        loss.backward()
        opt.step()
        opt.zero_grad()
        update_router_biases(model)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    model.eval()
    eval_loss = model(data, labels=data)
    model.train()
    train_loss = model(data, labels=data)
    assert train_loss.item() > eval_loss.item()  # the aux loss joins the training loss only
    report = expert_load(model)
    assert set(report) >= {"moe/layer0/max_over_mean_load", "moe/layer0/aux_loss", "moe/layer0/bias_abs_max"}
    assert report["moe/layer0/bias_abs_max"] > 0


def test_estimate_memory_counts_total_and_active_parameters(tmp_path, capsys):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from shardkit.cli import main as cli_main
    from shardkit.memory.model_spec import spec_from_hf_config, spec_from_llama_config, spec_from_model

    cfg = LlamaConfig.small_moe(fused=False)
    model = Llama(cfg)
    spec = spec_from_llama_config(cfg)
    assert spec.total_params == sum(p.numel() for p in model.parameters()) == spec_from_model(model).total_params
    routed = 3 * cfg.hidden_size * cfg.moe.intermediate_size
    moe_layers = cfg.num_layers - cfg.moe.first_dense_layers
    assert spec.active_params == spec.total_params - moe_layers * (cfg.moe.num_experts - cfg.moe.top_k) * routed
    # Hugging Face's Qwen3-MoE built from a tiny config: the same count as the model's
    hf = Qwen3MoeConfig(vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                        num_experts_per_tok=2, tie_word_embeddings=False)
    hf_params = sum(p.numel() for p in Qwen3MoeForCausalLM(hf).parameters())
    assert spec_from_hf_config(hf.to_dict()).total_params == hf_params
    # the published sizes: Qwen3-30B-A3B (30.5B, 3.3B active) and Mixtral-8x7B (46.7B, 12.9B active)
    qwen = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                moe_intermediate_size=768, model_type="qwen3_moe")
    mixtral = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2)
    for config, total, active in ((qwen, 30.5e9, 3.3e9), (mixtral, 46.7e9, 12.9e9)):
        spec = spec_from_hf_config(config)
        assert abs(spec.total_params - total) < 0.06e9 and abs(spec.active_params - active) < 0.06e9, spec
    hf.save_pretrained(tmp_path)
    assert cli_main(["estimate-memory", "--config", str(tmp_path / "config.json")]) == 0
    assert "M active per token)" in capsys.readouterr().out


@pytest.mark.parametrize("backend", ["bmm", "auto"])  # auto: the routed-experts function's engine for this build
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_hugging_face_expert_blocks_through_the_grouped_experts_equal_their_own(kind, backend):
    import copy

    import transformers

    from shardkit.models.moe_hf import use_grouped_experts

    shape = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 num_experts_per_tok=2)
    if kind == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=16, num_local_experts=4, **shape)
        cls = transformers.MixtralForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                             head_dim=8, **shape)
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    theirs = cls(config).double()
    theirs.set_experts_implementation("eager")  # transformers' own loop over the experts
    ours = copy.deepcopy(theirs)
    assert use_grouped_experts(ours, backend=backend) == 2
    ids = torch.randint(0, 64, (2, 9))
    want, got = theirs(ids, labels=ids), ours(ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-10, atol=1e-12)
    want.loss.backward()
    got.loss.backward()
    mine = dict(ours.named_parameters())
    for name, p in theirs.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(mine[name].grad, p.grad, rtol=1e-9, atol=1e-12, msg=name)
    with pytest.raises(ValueError, match="did you mean 'loop'"):
        use_grouped_experts(ours, backend="lop")
    with pytest.raises(ValueError, match="has no expert block"):
        use_grouped_experts(torch.nn.Linear(2, 2))


def test_expert_parallel_sizes_are_checked_by_name():
    from shardkit.strategies.expert_parallel import ExpertParallel
    from shardkit.strategies.parallel_dims import ParallelDims

    assert ParallelDims(ep=2).resolve(4).dp_shard == 4  # ep borrows from dp_shard: not a factor of the world
    with pytest.raises(ValueError, match="dp_shard\\(4\\) % ep\\(3\\) != 0"):
        ParallelDims(ep=3).resolve(4)
    with pytest.raises(ValueError, match="num_experts\\(6\\) % ep\\(4\\) != 0"):
        ParallelDims(ep=4).resolve(4).validate_experts(6)
    with pytest.raises(ValueError, match="ep=0"):
        ParallelDims(ep=0)
    with pytest.raises(ValueError, match="ep_size=0 must be an int >= 1"):
        ExpertParallel(ep_size=0)


def test_the_trainer_moves_the_router_bias_after_each_optimizer_step(tmp_path):
    """bias_update_rate > 0 under shardkit's Trainer: the bias moves after each step (never left at zero unsaid)."""
    from shardkit.trainer import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = Llama(LlamaConfig.small_moe(fused=False, num_layers=2, moe={"bias_update_rate": 1e-2}))
    data = [{"input_ids": torch.randint(0, 32, (16,)), "labels": torch.randint(0, 32, (16,))} for _ in range(4)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, learning_rate=1e-3,
                             save_strategy="no", report_to=[], disable_tqdm=True, seed=0, use_cpu=True)
    Trainer(model, args, train_dataset=data).train()
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers and all(float(layer.router.expert_bias.abs().max()) == pytest.approx(1e-2) for layer in layers)
    assert all(layer.tokens_per_expert.sum() == 0 for layer in layers)  # the counts restart after each update


def test_hf_expert_blocks_of_another_layout_are_refused_not_miscomputed():
    """transformers declares expert blocks whose function the plain stacked-SwiGLU forward is not (a norm after the
    experts, transposed weights): patching them would drop the norm or misread the weights, so both are refused."""
    from transformers.models.aria.configuration_aria import AriaTextConfig
    from transformers.models.aria.modeling_aria import AriaExperts
    from transformers.models.muse_spark.configuration_muse_spark import MuseSparkTextConfig
    from transformers.models.muse_spark.modeling_muse_spark import MuseSparkExperts

    from shardkit.models.moe_hf import use_grouped_experts

    normed = MuseSparkExperts(MuseSparkTextConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=2,
                                                  moe_hidden_size=16, moe_intermediate_size=8,
                                                  num_local_experts=4, vocab_size=64))
    with pytest.raises(ValueError, match="MuseSparkExperts.*has_post_expert_norm.*post_expert_norm"):
        use_grouped_experts(torch.nn.Sequential(normed))
    transposed = AriaExperts(AriaTextConfig(hidden_size=16, intermediate_size=16, moe_num_experts=4, vocab_size=64,
                                            num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match="AriaExperts.*is_transposed"):
        use_grouped_experts(torch.nn.Sequential(transposed))


def test_a_bf16_cast_keeps_the_balancing_state_precise():
    """model.bfloat16() casts every buffer: the router bias (steps of 1e-3, below bf16's spacing from 0.25 up) and the
    counts stay in full precision, so the bias still moves."""
    layer = _layer(bias_update_rate=1e-3, aux_loss_coef=0.0)
    layer.router.expert_bias.fill_(1.0)
    layer = layer.to(torch.bfloat16)
    assert layer.router.expert_bias.dtype == torch.float32 and layer.tokens_per_expert.dtype == torch.float64
    layer.train()
    layer(torch.randn(8, H, dtype=torch.bfloat16))
    update_router_biases(layer)
    assert (layer.router.expert_bias - 1.0).abs().max().item() == pytest.approx(1e-3, rel=1e-3)
