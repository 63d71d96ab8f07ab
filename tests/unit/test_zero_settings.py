"""ZeRO settings: named errors for impossible combinations, "auto" formulas, and the engine config."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.precision import BF16, FP16, FP32
from shardkit.strategies.zero import ZeRO1, ZeRO2, ZeRO3, ZeROInfinity, ZeROSettingsError
from shardkit.strategies.zero import config as zero_config


def _model():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def test_auto_formulas_use_the_largest_2d_weight_dim():
    section = ZeRO3().deepspeed_config(_model())["zero_optimization"]
    assert section["reduce_bucket_size"] == 64 * 64
    assert section["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert section["stage3_param_persistence_threshold"] == 10 * 64


def test_auto_formulas_prefer_config_hidden_size():
    model = _model()
    model.config = type("Config", (), {"hidden_size": 48})()
    assert ZeRO2().deepspeed_config(model)["zero_optimization"]["reduce_bucket_size"] == 48 * 48


def test_explicit_values_precision_sections_and_extra_merged_last():
    strategy = ZeRO3(reduce_bucket_size=1000, param_persistence_threshold=0,
                     extra={"zero_optimization": {"round_robin_gradients": True}, "gradient_clipping": 1.0})
    config = strategy.deepspeed_config(_model(), {"gradient_accumulation_steps": 4, "micro_batch_size": 2})
    zero = config["zero_optimization"]
    assert (zero["stage"], zero["reduce_bucket_size"], zero["stage3_param_persistence_threshold"]) == (3, 1000, 0)
    assert zero["round_robin_gradients"] is True and config["gradient_clipping"] == 1.0
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["gradient_accumulation_steps"] == 4
    assert config["bf16"] == {"enabled": False} and config["communication_data_type"] == "fp32"


def test_precision_sections_are_built_from_the_precisions_plain_attributes():
    # Precisions carry no DeepSpeed JSON (moved here from test_precision.py); the ZeRO config builds it.
    assert zero_config.precision_section(FP16())["fp16"]["initial_scale_power"] == 16
    assert zero_config.precision_section(BF16())["bf16"]["enabled"] is True
    assert zero_config.precision_section(FP32())["communication_data_type"] == "fp32"
    fp16 = zero_config.precision_section(FP16(loss_scale_window=50, hysteresis=3, min_loss_scale=2, comm_dtype="fp16"))
    assert fp16 == {"communication_data_type": "fp16", "bf16": {"enabled": False},
                    "fp16": {"enabled": True, "loss_scale": 0.0, "initial_scale_power": 16, "loss_scale_window": 50,
                             "hysteresis": 3, "min_loss_scale": 2.0}}
    assert zero_config.precision_section(BF16(mode="true"))["fp16"] == {"enabled": False}
    assert ZeRO2().deepspeed_config(_model())["fp16"] == {"enabled": False}  # FP32 by default
    assert not hasattr(FP16(), "deepspeed_config")


def test_pin_memory_is_off_without_a_gpu():
    config = ZeRO3(offload="cpu").deepspeed_config(_model())["zero_optimization"]
    assert config["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert config["offload_param"] == {"device": "cpu", "pin_memory": False}


@pytest.mark.parametrize("build, match", [
    (lambda: ZeRO1(offload_optimizer="cpu"), "ZeRO1.*use ZeRO2 or ZeRO3"),
    (lambda: ZeRO2(offload_optimizer="disk"), "offload_optimizer='disk'"),
    (lambda: ZeRO2(offload_optimizer="nvme"), "use ZeROInfinity"),
    (lambda: zero_config.ZeROSettings(2, offload_params="cpu"), "only in stage 3"),
    (lambda: ZeRO3(reduce_bucket_size=-5), "reduce_bucket_size=-5"),
    (lambda: ZeRO3(pin_memory=True), "pin_memory=True"),
    (lambda: ZeROInfinity(nvme_path="/tmp", aio={"blocksize": 1}), "unknown keys.*blocksize"),
    (lambda: ZeROInfinity(nvme_path="/tmp", aio={"thread_count": 2, "intra_op_parallelism": 4}),
     "thread_count=2 and intra_op_parallelism=4"),
])
def test_impossible_settings_raise_named_errors(build, match):
    with pytest.raises(ZeROSettingsError, match=match):
        build()


def test_aio_thread_count_reaches_deepspeed_under_its_current_name(tmp_path):
    # DeepSpeed 0.19 reads intra_op_parallelism and silently drops the older thread_count.
    for aio in ({"thread_count": 3}, {"intra_op_parallelism": 3}):
        config = ZeROInfinity(nvme_path=str(tmp_path), aio=aio).deepspeed_config(_model())["aio"]
        assert config["intra_op_parallelism"] == 3 and "thread_count" not in config, config
    assert ZeROInfinity(nvme_path=str(tmp_path)).deepspeed_config(_model())["aio"]["intra_op_parallelism"] == 1


def test_nvme_path_not_writable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ZeROSettingsError, match="not a writable directory"):
        ZeROInfinity(nvme_path=str(blocker / "swap"))


def test_libaio_missing_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(zero_config, "libaio_available", lambda: False)
    with pytest.raises(ZeROSettingsError, match="libaio"):
        ZeROInfinity(nvme_path=str(tmp_path))


def test_infinity_config_has_aio_and_nvme_sections(tmp_path):
    if not zero_config.libaio_available():
        pytest.skip("libaio is missing")
    config = ZeROInfinity(nvme_path=str(tmp_path), aio={"queue_depth": 16}).deepspeed_config(_model())
    zero = config["zero_optimization"]
    assert zero["offload_param"]["device"] == "nvme" and zero["offload_optimizer"]["nvme_path"] == str(tmp_path)
    assert config["aio"]["queue_depth"] == 16 and config["aio"]["block_size"] == 1_048_576


def test_fp16_on_a_cpu_without_fp16_support_names_the_device():
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator

    from shardkit import FP16, Runner

    del deepspeed
    if get_accelerator().is_fp16_supported():
        pytest.skip("this device supports fp16 under DeepSpeed")
    with pytest.raises(ZeROSettingsError, match="FP16 under DeepSpeed is not supported on this cpu device"):
        Runner(strategy=ZeRO2(), precision=FP16())


def test_importing_the_strategies_does_not_import_deepspeed():
    import subprocess
    import sys

    code = "import shardkit, shardkit.strategies.zero, sys; print('deepspeed' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_each_stage_brings_its_layout_and_inference_config():
    # Stage 3 is the ZeRO3 class's overrides, not a stage check: its layout and its engine without an optimizer.
    from shardkit.strategies.zero.layout import FlatPartitionLayout, ParameterPartitionLayout

    flat, partitioned = (ZeRO1(), ZeRO2()), (ZeRO3(), ZeROInfinity(nvme_path=None, offload_params="cpu",
                                                                   offload_optimizer="cpu"))
    assert [type(s.layout) for s in flat] == [FlatPartitionLayout] * 2 and [s.layout.stage for s in flat] == [1, 2]
    assert all(type(s.layout) is ParameterPartitionLayout and s.layout.stage == 3 for s in partitioned)
    assert ZeRO2()._inference_config(ZeRO2().deepspeed_config(_model()))["zero_optimization"] == {"stage": 0}
    assert ZeRO3()._inference_config(ZeRO3().deepspeed_config(_model()))["zero_optimization"]["stage"] == 3


def test_reading_whole_parameters_through_the_partitioned_interface_needs_no_engine():
    import subprocess
    import sys

    code = ("import sys, torch; from shardkit.utils.partitioned import full_shape, gathered_for_read, "
            "gathered_for_write\n"
            "w = torch.nn.Parameter(torch.ones(2))\n"
            "with gathered_for_read(w, None): print(bool(w.sum() == 2), 'deepspeed' in sys.modules)\n"
            "with torch.no_grad(), gathered_for_write(w): w.fill_(3)\n"
            "print(bool(w.sum() == 6), full_shape(w), 'deepspeed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.split("\n")[:2] == ["True False", "True (2,) False"], out.stderr


class _ListExperts(nn.Module):
    """An MoE block with one module per expert (older transformers, remote-code models)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 3)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))


def test_zero3_leaf_modules_are_the_moe_blocks_and_named_classes():
    pytest.importorskip("deepspeed")
    from shardkit.models import Llama, LlamaConfig
    from shardkit.models.moe import MoE
    from shardkit.strategies.zero.leaf import find_moe_blocks, mark_leaf_modules

    llama = Llama(LlamaConfig.small_moe(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, fused=False,
                                        moe=dict(num_experts=4, top_k=2, intermediate_size=8, first_dense_layers=1)))
    blocks = find_moe_blocks(llama)
    assert len(blocks) == 1 and all(isinstance(b, MoE) for b in blocks)  # layer 0 dense; not its experts again
    model = nn.Sequential(_ListExperts(), nn.LayerNorm(8), llama)
    strategy = ZeRO3(leaf_modules="LayerNorm, torch.nn.modules.sparse.Embedding")  # the --strategy-opt form
    leaves = mark_leaf_modules(model, strategy.leaf_modules)
    assert {type(m).__name__ for m in leaves} == {"_ListExperts", "MoE", "LayerNorm", "Embedding"}
    assert all(m._z3_leaf for m in leaves) and not hasattr(llama.layers[0].mlp, "_z3_leaf")
    with pytest.raises(ValueError, match="LayerNrom.*match no module"):
        mark_leaf_modules(model, ["LayerNrom"])


def test_zero3_generation_stays_per_layer_where_holding_the_model_whole_cannot_work(tmp_path):
    """NVMe parameter offload (swapped in a few buffers at a time) and DeepSpeed's leaf-module granularity (its hooks
    empty a leaf's parameters after each forward) keep generation per layer, said in the log phrase; forcing
    keep_unsharded=True there is refused by name. Otherwise the memory rule decides, CPU offload included."""
    from shardkit.strategies.zero.generation import per_layer_reason, zero3_gathered

    granular = ZeRO3(extra={"zero_optimization": {"stage3_module_granularity_threshold": 100}})
    strategies = [granular]
    if zero_config.libaio_available():
        strategies.append(ZeROInfinity(nvme_path=str(tmp_path)))
    for strategy, why in zip(strategies, ("stage3_module_granularity_threshold", "NVMe")):
        with strategy.generation_context(_model()) as how:  # per layer: decided without a collective
            assert how.startswith("ZeRO-3 parameters gathered per layer") and why in how, how
        with pytest.raises(ValueError, match=f"keep_unsharded=True cannot hold.*{why}"):
            strategy.generation_context(_model(), keep_unsharded=True)
    assert per_layer_reason("cpu", 0) is None and per_layer_reason(None, 0) is None
    one_rank = bool  # "some rank says so" on one rank is this rank's flag
    # a module with nothing partitioned: the rule decides, and there is nothing to gather
    for keep, held in ((None, True), (True, True), (False, False)):
        with zero3_gathered(_model(), torch.device("cpu"), keep, one_rank) as how:
            assert ("once for the call" in how) is held, (keep, how)


def test_detached_hooks_come_back_as_the_same_entries_in_their_order():
    from shardkit.strategies.zero.generation import hooks_detached

    module, ran = nn.Linear(2, 2), []

    def hook(name):
        return lambda *args: ran.append(name)

    a, b, c = (module.register_forward_pre_hook(hook(n)) for n in "abc")
    post = module.register_forward_hook(hook("post"))
    before = (list(module._forward_pre_hooks.items()), list(module._forward_hooks.items()))
    with hooks_detached([a, c, post]) as count:
        assert count == 3
        module(torch.zeros(1, 2))
        assert ran == ["b"]  # only the hook not handed over ran
        d = module.register_forward_pre_hook(hook("d"))
        b.remove()
    ran.clear()
    module(torch.zeros(1, 2))
    # the detached ones are back in their places (a before c, the post hook), the one added meanwhile stays after
    # them and the one removed meanwhile stays removed
    assert ran == ["a", "c", "d", "post"]
    pre = [entry for entry in before[0] if entry[0] != b.id]
    assert list(module._forward_pre_hooks.items())[:2] == pre and d.id in module._forward_pre_hooks
    assert list(module._forward_hooks.items()) == before[1]
