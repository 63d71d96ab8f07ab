"""MoE experts in Hugging Face files: ``save_pretrained`` and zero-to-fp32 write the Hub's per-expert layout, as
transformers' own ``save_pretrained`` does, and ``load_pretrained`` reads it into the stacked expert weights.

Tiny Qwen3-MoE and Mixtral models built here, one process (the EP-2 export is in test_expert_parallel.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardkit import Runner
from shardkit.checkpoint import CheckpointError
from shardkit.checkpoint.expert_layout import export_plan, layout_for
from shardkit.checkpoint.hf import load_pretrained, save_pretrained
from shardkit.checkpoint.zero_to_fp32 import main as zero_to_fp32
from shardkit.strategies import SingleDevice

transformers = pytest.importorskip("transformers")


def _model(kind: str, seed: int = 0):
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, tie_word_embeddings=False)
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, head_dim=8,
                                             num_experts=4, **common)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.MixtralConfig(intermediate_size=16, num_local_experts=4, **common)
        cls = transformers.MixtralForCausalLM
    torch.manual_seed(seed)
    return cls(config).float().eval()


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _set_up(model):
    runner = Runner(SingleDevice("cpu"))
    model, _ = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return runner, model


INPUT = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_save_pretrained_writes_the_files_transformers_writes_and_they_load_back(kind, tmp_path):
    model = _model(kind)
    model.save_pretrained(tmp_path / "hf")  # transformers' own: one tensor per expert and projection
    runner, set_up = _set_up(model)
    save_pretrained(runner, tmp_path / "ours", set_up)
    ours, theirs = _tensors(tmp_path / "ours"), _tensors(tmp_path / "hf")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    expert = {"qwen3_moe": "model.layers.1.mlp.experts.3.up_proj.weight",
              "mixtral": "model.layers.1.block_sparse_moe.experts.3.w3.weight"}[kind]
    assert tuple(ours[expert].shape) == (16, 32), sorted(ours)
    back = type(model).from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert torch.equal(back(INPUT).logits, model(INPUT).logits)
    # and back in through shardkit: a fresh model loads the Hub-layout files into its stacked experts
    runner, fresh = _set_up(_model(kind, seed=1))
    assert load_pretrained(runner, fresh, tmp_path / "hf") == []
    with torch.no_grad():
        assert torch.equal(fresh(INPUT).logits, model(INPUT).logits)


def test_save_original_format_false_writes_the_stacked_weights_transformers_5_also_loads(tmp_path):
    model = _model("qwen3_moe")
    runner, set_up = _set_up(model)
    save_pretrained(runner, tmp_path, set_up, save_original_format=False)
    keys = _tensors(tmp_path)
    assert tuple(keys["model.layers.0.mlp.experts.gate_up_proj"].shape) == (4, 32, 32)
    assert not any(".experts.0." in k for k in keys)
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(back(INPUT).logits, model(INPUT).logits)


def test_zero_to_fp32_writes_the_per_expert_layout_from_the_config_beside_the_checkpoint(tmp_path, capsys):
    model = _model("qwen3_moe")
    runner, set_up = _set_up(model)
    runner.save(tmp_path / "ckpt", {"model": set_up})
    model.config.save_pretrained(tmp_path / "ckpt")
    assert zero_to_fp32([str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    assert sorted(_tensors(tmp_path / "out")) == sorted(model.state_dict().keys() - {
        k for k in model.state_dict() if ".experts." in k} | {
        f"model.layers.{i}.mlp.experts.{e}.{p}.weight" for i in range(2) for e in range(4)
        for p in ("gate_proj", "up_proj", "down_proj")})
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.equal(back(INPUT).logits, model(INPUT).logits)
    assert zero_to_fp32([str(tmp_path / "ckpt"), str(tmp_path / "stacked"), "--stacked-experts"]) == 0
    assert "model.layers.1.mlp.experts.down_proj" in _tensors(tmp_path / "stacked")
    # `shardkit convert --to hf` writes the same files as zero-to-fp32
    from shardkit.checkpoint.convert import convert

    convert(tmp_path / "ckpt", tmp_path / "converted", "hf")
    converted, fp32 = _tensors(tmp_path / "converted"), _tensors(tmp_path / "out")
    assert sorted(converted) == sorted(fp32) and all(torch.equal(converted[k], fp32[k]) for k in fp32)


def test_export_plan_reads_each_stacked_tensor_once_and_splits_gate_from_up():
    gate_up, down = torch.arange(2 * 6 * 3.0).reshape(2, 6, 3), torch.arange(2 * 3 * 3.0).reshape(2, 3, 3)
    source = {"m.layers.0.mlp.experts.gate_up_proj": gate_up, "m.layers.0.mlp.experts.down_proj": down}
    reads = []

    def fetch(k):
        reads.append(k)
        return source[k]

    keys, read = export_plan({k: (tuple(v.shape), v.dtype) for k, v in source.items()}, fetch,
                             layout_for("mixtral"))
    assert keys["m.layers.0.block_sparse_moe.experts.1.w3.weight"] == ((3, 3), torch.float32)
    got = {k: read(k) for k in sorted(keys)}  # the order a writer may ask in, the two sources interleaved
    assert sorted(reads) == sorted(source)
    assert torch.equal(got["m.layers.0.block_sparse_moe.experts.1.w1.weight"], gate_up[1, :3])
    assert torch.equal(got["m.layers.0.block_sparse_moe.experts.1.w3.weight"], gate_up[1, 3:])
    assert torch.equal(got["m.layers.0.block_sparse_moe.experts.0.w2.weight"], down[0])


def test_a_per_expert_tensor_of_the_wrong_shape_is_named(tmp_path):
    model = _model("qwen3_moe")
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    bad = "model.layers.1.mlp.experts.2.up_proj.weight"
    tensors[bad] = tensors[bad][:8].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    runner, fresh = _set_up(_model("qwen3_moe", seed=1))
    with pytest.raises(CheckpointError, match=r"experts\.2\.up_proj\.weight has shape \[8, 32\]"):
        load_pretrained(runner, fresh, tmp_path)


def _more_experts(t):  # a file written for 5 experts read by a 4-expert model
    for proj in ("gate_proj", "up_proj", "down_proj"):
        t[f"model.layers.1.mlp.experts.4.{proj}.weight"] = t[f"model.layers.1.mlp.experts.0.{proj}.weight"].clone()


def _one_missing(t):
    del t["model.layers.1.mlp.experts.3.up_proj.weight"]


def _both_layouts(t):
    t["model.layers.1.mlp.experts.gate_up_proj"] = torch.zeros(4, 32, 32)
    t["model.layers.1.mlp.experts.down_proj"] = torch.zeros(4, 32, 16)


@pytest.mark.parametrize("edit, match", [
    (_more_experts, r"gate_proj\.weight is stored for 5 experts.* has 4; experts \[4\] beyond"),
    (_one_missing, r"up_proj\.weight is stored for 3 experts.* has 4; missing experts \[3\]"),
    (_both_layouts, r"both the stacked model\.layers\.1\.mlp\.experts\.gate_up_proj and per-expert"),
])
def test_per_expert_files_that_disagree_with_the_model_are_named_even_when_not_strict(edit, match, tmp_path):
    model = _model("qwen3_moe")
    model.save_pretrained(tmp_path)
    tensors = _tensors(tmp_path)
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    runner, fresh = _set_up(_model("qwen3_moe", seed=1))
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    for strict in (True, False):  # strict=False loaded the matching part silently
        with pytest.raises(CheckpointError, match=match):
            load_pretrained(runner, fresh, tmp_path, strict=strict)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
