"""shardkit's Llama, dense and MoE, exported as the transformers architecture it equals.

``save_pretrained``, zero-to-fp32 and ``convert --to hf`` write config.json + safetensors that
``AutoModelForCausalLM.from_pretrained`` loads with every tensor it holds and gives shardkit's logits (fp32, 1e-5),
each MoE router picking the same experts with the same weights; ``load_pretrained`` reads the export back; a config no
transformers architecture computes exactly is refused by the field's name. Tiny models, one process (the export of
a checkpoint saved under expert parallelism is in tests/distributed/test_expert_parallel.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shardkit import Runner
from shardkit.checkpoint import CheckpointError
from shardkit.checkpoint.convert import convert
from shardkit.checkpoint.hf import load_pretrained, save_pretrained
from shardkit.checkpoint.zero_to_fp32 import main as zero_to_fp32
from shardkit.models import Llama, LlamaConfig
from shardkit.models.hf_export import hf_export, hf_state_dict
from shardkit.models.moe import moe_layers
from shardkit.strategies import SingleDevice

transformers = pytest.importorskip("transformers")

_SMALL = dict(fused=False, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2, max_position=32)
_MOE = dict(num_experts=4, top_k=2, intermediate_size=16)

CASES = {
    "dense-tied": (LlamaConfig(num_layers=2, **_SMALL), "LlamaForCausalLM"),
    "dense-untied": (LlamaConfig(num_layers=2, tie_embeddings=False, **{**_SMALL, "num_kv_heads": None}),
                     "LlamaForCausalLM"),
    "mixtral": (LlamaConfig.small_moe(num_layers=2, moe=dict(_MOE, num_shared_experts=0, first_dense_layers=0),
                                      **_SMALL), "MixtralForCausalLM"),
    # shared experts (the zero gate and doubled down_proj) and a dense first layer
    "qwen2_moe": (LlamaConfig.small_moe(num_layers=3, moe=_MOE, **_SMALL), "Qwen2MoeForCausalLM"),
    "qwen2_moe-unnormalised": (LlamaConfig.small_moe(num_layers=2, moe=dict(_MOE, norm_topk_prob=False,
                                                                            num_shared_experts=0), **_SMALL),
                               "Qwen2MoeForCausalLM"),
    # DeepSeek-V3's router: the bias steers the choice, route_scale scales the weights
    "glm4_moe": (LlamaConfig.small_moe(num_layers=3, tie_embeddings=False, moe=dict(
        _MOE, score_func="sigmoid", route_scale=2.5, bias_update_rate=1e-3), **_SMALL), "Glm4MoeForCausalLM"),
    "glm4_moe-no-shared": (LlamaConfig.small_moe(num_layers=2, moe=dict(
        _MOE, score_func="sigmoid", norm_topk_prob=False, num_shared_experts=0, first_dense_layers=0), **_SMALL),
        "Glm4MoeForCausalLM"),
}
IDS = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(3))


def _llama(config: LlamaConfig, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    model = Llama(config).float().eval()
    with torch.no_grad():
        for layer in moe_layers(model):  # a trained router's bias; large enough to change which experts win
            if config.moe.score_func == "sigmoid":
                layer.router.expert_bias.copy_(torch.randn(config.moe.num_experts) * 0.05)
            layer.router.weight.mul_(20)  # scores far from uniform: ties would make the choice arbitrary
    return model


def _set_up(model: Llama):
    runner = Runner(SingleDevice("cpu"))
    set_up, _ = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return runner, set_up


def _routes(model: torch.nn.Module, routers: list[torch.nn.Module], ids: torch.Tensor) -> list:
    """(experts, weights) each router picks per token in a forward of ``model``, experts sorted per token."""
    seen = []

    def hook(module, args, output):
        if isinstance(model, Llama):
            _, picked, weights = output
        else:  # transformers' routers: (logits, weights, indices)
            _, weights, picked = output
        order = picked.argsort(-1)
        seen.append((picked.gather(-1, order), weights.gather(-1, order)))

    handles = [r.register_forward_hook(hook) for r in routers]
    try:
        with torch.no_grad():
            logits = model(ids) if isinstance(model, Llama) else model(ids).logits
    finally:
        for h in handles:
            h.remove()
    return [logits, seen]


@pytest.mark.parametrize("case", list(CASES))
def test_from_pretrained_equals_shardkit_and_routes_alike(case, tmp_path):
    config, architecture = CASES[case]
    model = _llama(config)
    runner, set_up = _set_up(model)
    save_pretrained(runner, tmp_path / "hf", set_up)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                                 output_loading_info=True)
    assert type(hf).__name__ == architecture
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    hf.eval()
    ours, our_routes = _routes(model, [m.router for m in moe_layers(model)], IDS)
    gates = [m.gate for m in hf.modules() if type(m).__name__.endswith("SparseMoeBlock")
             or type(m).__name__ == "Glm4MoeMoE"]
    theirs, their_routes = _routes(hf, gates, IDS)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    assert len(our_routes) == len(their_routes) == sum(
        i >= config.moe.first_dense_layers for i in range(config.num_layers)) if config.moe else not their_routes
    for (our_experts, our_weights), (their_experts, their_weights) in zip(our_routes, their_routes):
        assert torch.equal(our_experts, their_experts)
        torch.testing.assert_close(their_weights, our_weights, rtol=0, atol=1e-6)
    # the same tensors without files, and back into a shardkit Llama from the files
    state = hf_state_dict(model)
    fresh = transformers.AutoModelForCausalLM.from_config(hf.config).float().eval()
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    with torch.no_grad():
        torch.testing.assert_close(fresh(IDS).logits, ours, rtol=0, atol=1e-5)
    back = _llama(config, seed=5)
    runner2, back_set_up = _set_up(back)
    assert load_pretrained(runner2, back_set_up, tmp_path / "hf") == []
    want = model.state_dict()
    assert all(torch.equal(back.state_dict()[k], want[k]) for k in want)
    if config.moe is not None and config.moe.score_func == "sigmoid":  # the exported bias decides some choices
        with torch.no_grad():
            for gate in gates:
                gate.e_score_correction_bias.zero_()
        _, unbiased = _routes(hf, gates, IDS)
        assert any(not torch.equal(a[0], b[0]) for a, b in zip(unbiased, their_routes))


def _softmax_bias(config: LlamaConfig) -> Llama:
    model = _llama(config)
    with torch.no_grad():
        moe_layers(model)[0].router.expert_bias[1] = 0.25
    return model


@pytest.mark.parametrize("changes, field", [
    (dict(moe=dict(_MOE, capacity_factor=1.25)), "moe.capacity_factor=1.25"),
    (dict(moe=dict(_MOE, bias_update_rate=1e-3)), "moe.bias_update_rate=0.001"),
    (dict(moe=dict(_MOE, route_scale=2.0)), "moe.route_scale=2.0"),
    (dict(moe=dict(_MOE, score_func="sigmoid", shared_intermediate_size=24)), "moe.shared_intermediate_size=24"),
])
def test_a_config_no_transformers_architecture_computes_is_refused_by_name(changes, field):
    config = LlamaConfig.small_moe(**{**_SMALL, **changes})
    with pytest.raises(CheckpointError, match=f"{field}.*; "):
        hf_export(config)
    with pytest.raises(CheckpointError, match=field):
        Llama(config).hf_export()


def test_a_softmax_router_with_a_bias_is_refused_and_nothing_is_written(tmp_path):
    model = _softmax_bias(LlamaConfig.small_moe(**_SMALL, moe=_MOE))
    runner, set_up = _set_up(model)
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.router\.expert_bias.*score_func='sigmoid'"):
        save_pretrained(runner, tmp_path / "hf", set_up)
    assert not (tmp_path / "hf" / "model.safetensors").exists()


@pytest.mark.parametrize("case", ["qwen2_moe", "glm4_moe"])
def test_zero_to_fp32_and_convert_write_the_export_from_a_checkpoint(case, tmp_path, capsys):
    config, architecture = CASES[case]
    model = _llama(config)
    runner, set_up = _set_up(model)
    runner.save(tmp_path / "ckpt", {"model": set_up})  # records the model's config
    assert zero_to_fp32([str(tmp_path / "ckpt"), str(tmp_path / "fp32")]) == 0
    assert "transformers architecture" in capsys.readouterr().err
    convert(tmp_path / "ckpt", tmp_path / "converted", "hf")
    convert(tmp_path / "ckpt", tmp_path / "resaved", "shardkit")  # carries the recorded config
    convert(tmp_path / "resaved", tmp_path / "resaved-hf", "hf")
    save_pretrained(runner, tmp_path / "saved", set_up)
    with torch.no_grad():
        ours = model(IDS)
    files = {}
    for out in ("fp32", "converted", "resaved-hf", "saved"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / out, dtype=torch.float32).eval()
        assert type(hf).__name__ == architecture
        with torch.no_grad():
            torch.testing.assert_close(hf(IDS).logits, ours, rtol=0, atol=1e-5)
        with safe_open(str(tmp_path / out / "model.safetensors"), "pt") as f:
            files[out] = {k: f.get_tensor(k) for k in f.keys()}
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in files["saved"]  # the Hub's per-expert layout
    # a bf16 export keeps the routing bias in fp32, as shardkit holds it and transformers loads it
    assert zero_to_fp32([str(tmp_path / "ckpt"), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    save_pretrained(runner, tmp_path / "saved-bf16", set_up, dtype=torch.bfloat16)
    for out in ("bf16", "saved-bf16"):
        with safe_open(str(tmp_path / out / "model.safetensors"), "pt") as f:
            dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
        bias = {k for k in dtypes if k.endswith("e_score_correction_bias")}
        assert bool(bias) == (case == "glm4_moe") and all(dtypes[k] == "F32" for k in bias), dtypes
        assert dtypes["model.layers.1.mlp.gate.weight"] == "BF16"
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / out)  # the weights' dtype by default
        assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    for out in ("fp32", "converted", "resaved-hf"):  # the checkpoint tools write what save_pretrained writes
        # (--to shardkit does not carry the tie: that copy holds lm_head.weight too)
        extra = {"lm_head.weight"} if out == "resaved-hf" and config.tie_embeddings else set()
        assert sorted(set(files[out]) - extra) == sorted(files["saved"])
        assert all(torch.equal(files[out][k], files["saved"][k]) for k in files["saved"])
    # the model's own names on request, which a shardkit Llama loads as before
    assert zero_to_fp32([str(tmp_path / "ckpt"), str(tmp_path / "own"), "--shardkit-names"]) == 0
    assert not (tmp_path / "own" / "config.json").exists()
    back = _llama(config, seed=5)
    runner2, back_set_up = _set_up(back)
    load_pretrained(runner2, back_set_up, tmp_path / "own")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_refused_checkpoint_names_the_field_and_the_way_out(tmp_path, capsys):
    config = LlamaConfig.small_moe(**{**_SMALL}, moe=dict(_MOE, capacity_factor=1.25))
    runner, set_up = _set_up(_llama(config))
    runner.save(tmp_path / "ckpt", {"model": set_up})
    assert zero_to_fp32([str(tmp_path / "ckpt"), str(tmp_path / "fp32")]) == 2
    err = capsys.readouterr().err
    assert "capacity_factor=1.25" in err and "--shardkit-names" in err
    assert not (tmp_path / "fp32").exists()


def test_dropout_is_left_out_of_the_export_with_a_warning_and_eval_outputs_are_exact(tmp_path, caplog):
    config = LlamaConfig.small_moe(**{**_SMALL, "dropout": 0.1}, moe=_MOE)
    model = _llama(config).eval()
    runner, set_up = _set_up(model)
    with caplog.at_level("WARNING", logger="shardkit.checkpoint.llama_hf"):
        save_pretrained(runner, tmp_path / "hf", set_up)
    assert "dropout=0.1" in caplog.text and "eval-mode outputs are exact" in caplog.text
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS).logits, model(IDS), rtol=0, atol=1e-5)


def test_the_qwen2_moe_shared_expert_gate_must_stay_zero_to_load_back(tmp_path):
    config = CASES["qwen2_moe"][0]
    runner, set_up = _set_up(_llama(config))
    save_pretrained(runner, tmp_path / "hf", set_up)
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["model.layers.1.mlp.shared_expert_gate.weight"][0, 3] = 0.5  # trained as Qwen2-MoE since the export
    (tmp_path / "trained").mkdir()
    save_file(tensors, tmp_path / "trained" / "model.safetensors")
    runner2, back = _set_up(_llama(config, seed=5))
    with pytest.raises(CheckpointError, match=r"shared_expert_gate\.weight is not all zeros"):
        load_pretrained(runner2, back, tmp_path / "trained")


def test_the_recorded_config_is_the_models(tmp_path):
    config = dataclasses.replace(CASES["mixtral"][0], rope_theta=5e5, rms_eps=1e-5)
    exported = hf_export(config).config
    assert (exported["model_type"], exported["rope_parameters"]["rope_theta"], exported["rms_norm_eps"],
            exported["num_local_experts"], exported["num_key_value_heads"]) == ("mixtral", 5e5, 1e-5, 4, 2)


@pytest.mark.parametrize("field, value", [("num_heads", 0), ("hidden_size", "64"), ("moe.top_k", -1),
                                          ("moe.score_func", "tanh"), ("num_kv_heads", 0)])
def test_a_damaged_recorded_config_is_refused_by_name(field, value):
    fields = CASES["qwen2_moe"][0].to_dict()
    *parent, key = field.split(".")
    (fields[parent[0]] if parent else fields)[key] = value
    with pytest.raises(CheckpointError, match=rf"config's {field} is not a value"):
        hf_export(fields)
