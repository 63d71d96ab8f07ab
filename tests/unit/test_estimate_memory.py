"""The memory estimator: DeepSpeed's ZeRO-2/3 numbers and tables, model sizes from every source, strategies."""

import json

import pytest
from torch import nn

from shardkit.cli import main as cli_main
from shardkit.memory import (
    LAYOUTS,
    ModelSpec,
    activation_bytes,
    deepspeed_table,
    estimate_model_states,
    find_layout,
    listed_layouts,
    parse_count,
    recommend,
    spec_from_hf_config,
    spec_from_llama_config,
    spec_from_model,
    zero2_mem_needs,
    zero3_mem_needs,
)
from shardkit.models import Llama, LlamaConfig
from shardkit.precision.registry import PRECISIONS
from shardkit.strategies.registry import STRATEGIES

SHAPES = [(2_783_000_000, 131_000_000, 8, 1), (125_000_000, 38_000_000, 1, 1), (7_000_000_000, 262_000_000, 4, 3),
          (1_000_003, 1_001, 3, 2)]


def test_parse_count():
    assert parse_count("2783M") == 2_783_000_000
    assert parse_count("2.78B") == 2_780_000_000
    assert parse_count("350k") == 350_000 and parse_count("1e9") == 10**9 and parse_count(12) == 12
    with pytest.raises(ValueError, match="2783X"):
        parse_count("2783X")


@pytest.mark.parametrize("total,largest,gpus,nodes", SHAPES)
def test_numbers_equal_deepspeeds_formulas(total, largest, gpus, nodes):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    for off in (True, False):
        assert zero2_mem_needs(total, gpus, nodes, off) == estimate_zero2_model_states_mem_needs(total, gpus, nodes,
                                                                                                  off)
        for off_params in (True, False):
            for init in (True, False):
                assert zero3_mem_needs(total, largest, gpus, nodes, off, off_params, init) == \
                    estimate_zero3_model_states_mem_needs(total, largest, gpus, nodes, off, off_params, init)


def _printed(capsys):
    # NOTE: on Python >= 3.11 DeepSpeed 0.19.8 prints its str-Enum as "OffloadDeviceEnum.cpu" where it means
    # f"{'cpu':4}"; the numbers and every other character are compared as printed.
    return capsys.readouterr().out.rstrip("\n").replace("OffloadDeviceEnum.cpu", "cpu ")


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 64)
        self.mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.head = nn.Linear(64, 1000, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize("gpus,nodes", [(1, 1), (8, 1), (4, 2)])
def test_tables_equal_deepspeeds_all_live_output(capsys, gpus, nodes):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live

    model = _Tied()
    spec = spec_from_model(model)
    assert spec.total_params == 1000 * 64 + 64 * 256 + 256 + 256 * 64 + 64  # tied weight once
    capsys.readouterr()
    estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=gpus, num_nodes=nodes)
    assert _printed(capsys) == deepspeed_table(2, spec.total_params, spec.largest_layer_params,
                                                                   gpus, nodes)
    estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=gpus, num_nodes=nodes)
    assert _printed(capsys) == deepspeed_table(3, spec.total_params, spec.largest_layer_params,
                                                                   gpus, nodes)


def test_cli_prints_deepspeeds_table_for_counts(capsys):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold

    estimate_zero3_model_states_mem_needs_all_cold(2_783_000_000, 131_000_000, num_gpus_per_node=8)
    want = _printed(capsys)
    assert cli_main(["estimate-memory", "--params", "2783M", "--largest-layer-params", "131M", "--num-gpus", "8",
                     "--device-memory", "24GB"]) == 0
    out = capsys.readouterr().out
    # the same numbers, labelled as what they are (DeepSpeed divides by 2**30 and prints "GB")
    want = want.replace("GB |", "GiB |").replace("  per CPU  |  per GPU |", "  per CPU   |  per GPU   |")
    assert want.strip() in out
    assert "GB |" not in out and "Sizes in GiB" in out
    assert "Recommended for 24GB per device:" in out
    assert "offload_param=none, offload_optimizer=none, zero_init=1" in out


def test_specs_from_llama_config_hf_config_and_model(tmp_path):
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=176, num_layers=3, num_heads=4, num_kv_heads=2)
    model = Llama(cfg)
    params = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    assert spec_from_llama_config(cfg).total_params == params
    assert spec_from_model(model).total_params == params and spec_from_model(model).hidden_size == 64
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    hf = HFConfig(vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False)
    hf.save_pretrained(tmp_path)
    hf_model = LlamaForCausalLM(hf)
    spec = spec_from_hf_config(tmp_path)
    assert spec.total_params == sum(p.numel() for p in hf_model.parameters())
    assert spec.largest_layer_params == spec_from_model(hf_model).largest_layer_params == 300 * 64
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="bad.json: lacks"):
        spec_from_hf_config(tmp_path / "bad.json")


def test_strategies_shard_as_documented():
    spec = ModelSpec(total_params=1_000_000, largest_layer_params=10_000, tp_params=800_000)
    n = 4

    def total(name, **kw):
        return estimate_model_states(spec, name, num_gpus_per_node=n, precision="fp32", **kw).device_total

    psi = spec.total_params
    assert total("ddp") == 16 * psi
    assert total("zero1") == total("zero2") == 4 * psi + 16 * psi // n  # DeepSpeed's separate fp32 master
    zero1 = estimate_model_states(spec, "zero1", num_gpus_per_node=n, precision="fp32")
    assert zero1.device_peak == 8 * psi + 12 * psi // n  # the paper's 4+4+12/N while gradients are whole
    assert total("zero3") == 20 * psi // n and total("fsdp") == 16 * psi // n
    assert total("tensor_parallel") == 16 * (800_000 // n + 200_000)
    two_nodes = estimate_model_states(spec, "fsdp_hybrid", num_gpus_per_node=n, num_nodes=2, precision="fp32")
    assert two_nodes.device_total == 16 * psi // n  # sharded within the node only
    grad_op = estimate_model_states(spec, "fsdp_grad_op", num_gpus_per_node=n, precision="fp32")
    assert grad_op.device_peak == grad_op.device_total + 4 * psi - 4 * psi // n
    # precision: true bf16 halves a torch engine's states; mixed bf16 halves DeepSpeed's params only
    assert estimate_model_states(spec, "ddp", precision="bf16-true").device_total == 8 * psi
    assert estimate_model_states(spec, "zero1", precision="bf16").params == 2 * psi
    # CPU offload: ZeRO-2 keeps whole 16-bit params on the device and steps on the host from an fp32 gradient
    # partition beside master and states (measured at 0.4B on 2 ranks, issue 15); FSDP keeps only a layer
    zero2_off = estimate_model_states(spec, "zero2_offload", num_gpus_per_node=n)
    assert (zero2_off.params, zero2_off.grads, zero2_off.optimizer) == (2 * psi, 0, 0)
    assert zero2_off.host == 16 * psi // n
    fsdp_off = estimate_model_states(spec, "fsdp_offload", num_gpus_per_node=n, precision="fp32")
    assert fsdp_off.device_total == 0 and fsdp_off.working == 4 * 10_000
    assert fsdp_off.host == total("fsdp")  # the same bytes, moved to the host
    offload = estimate_model_states(spec, "zero_infinity", num_gpus_per_node=n)
    assert offload.device_total == 0 and offload.working == 2 * 10_000
    # parameters within DeepSpeed's max_in_cpu stay on the host; master, states and an fp32 gradient go to NVMe
    assert offload.host == 4 * psi // n and offload.nvme == 16 * psi // n
    some_in_cpu = estimate_model_states(spec, "zero_infinity", num_gpus_per_node=n, params_in_cpu=psi // n // 4)
    assert some_in_cpu.host == 2 * psi // n + 2 * (psi // n // 4)
    assert some_in_cpu.nvme == 2 * (psi // n - psi // n // 4) + 16 * psi // n


def test_activations_and_checkpointing():
    spec = spec_from_llama_config(LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                              num_layers=32, num_heads=32))
    full = activation_bytes(spec, 1, 4096)
    assert activation_bytes(spec, 2, 4096) == pytest.approx(2 * full, rel=1e-6)
    ckpt = activation_bytes(spec, 1, 4096, checkpointing=True)
    assert ckpt < full / 5
    with pytest.raises(ValueError, match="shape"):
        activation_bytes(ModelSpec(total_params=10), 1, 8)


def test_recommend_picks_the_smallest_strategy_that_fits():
    spec = spec_from_llama_config(LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                              num_layers=32, num_heads=32))  # ~6.7B
    gib = 2**30
    best, peaks = recommend(spec, 1024 * gib, num_gpus_per_node=8)
    assert best == "ddp"
    best, peaks = recommend(spec, 80 * gib, num_gpus_per_node=8, batch_size=1, seq_len=2048)
    assert best == "zero1" and peaks["ddp"] > 0.9 * 80 * gib
    best, _ = recommend(spec, 16 * gib, num_gpus_per_node=8, batch_size=1, seq_len=2048, checkpointing=True)
    assert best in ("fsdp_grad_op", "tp", "fsdp", "zero3")
    assert recommend(spec, 1 * gib, num_gpus_per_node=1, batch_size=8, seq_len=4096)[0] is None


def test_rows_are_registered_strategies_with_their_constructor_options_and_names_come_from_the_registries(capsys):
    for layout in LAYOUTS:  # a row cannot name a strategy or an option the registry does not have
        assert layout.strategy == STRATEGIES.canonical(layout.strategy)
        assert layout.name == layout.strategy or layout.name.startswith(layout.strategy + "_")
        assert set(layout.options) <= set(STRATEGIES.options(layout.strategy)), layout
    assert type(find_layout("fsdp_offload").build()).__name__ == "FSDP" and \
        find_layout("fsdp_offload").build().settings.cpu_offload
    spec = ModelSpec(total_params=1_000_000, largest_layer_params=10_000)
    # any alias of a registered name, and every precision the registry knows, by any of its names
    assert find_layout("tensor_parallel") is find_layout("TensorParallel") is find_layout("tp")
    assert estimate_model_states(spec, "zero-3").strategy == "zero3"
    for name in PRECISIONS.names():
        assert estimate_model_states(spec, "fsdp", precision=name).device_total > 0
    assert estimate_model_states(spec, "ddp", precision="tf32") == estimate_model_states(spec, "ddp", precision="fp32")
    assert estimate_model_states(spec, "zero2", precision="bf16-mixed") == estimate_model_states(spec, "zero2",
                                                                                                   precision="bf16")
    with pytest.raises(ValueError, match="'zero4' has no memory estimate; did you mean 'zero3'"):
        estimate_model_states(spec, "zero4")
    # every registered strategy is estimated by what it declares: SingleDevice holds everything, as DDP does per
    # device; it is left out of the rows of N devices (--strategy all, recommend)
    single, ddp = estimate_model_states(spec, "single"), estimate_model_states(spec, "ddp")
    assert single.strategy == "single" and (single.params, single.grads, single.optimizer) == (
        ddp.params, ddp.grads, ddp.optimizer) and single.device_total > 0
    assert "single" not in [layout.name for layout in listed_layouts()]
    assert [layout.name for layout in listed_layouts()] == [layout.name for layout in LAYOUTS]
    with pytest.raises(ValueError, match="unknown precision 'bf61'"):
        estimate_model_states(spec, "ddp", precision="bf61")
    assert cli_main(["estimate-memory", "--params", "1M", "--strategy", "tensor_parallel", "--precision",
                     "bf16-mixed"]) == 0
    assert "\ntp " in capsys.readouterr().out


def test_the_recommendation_names_the_constraint_that_decided_it(capsys):
    """Asked about zero3, recommended another: the output says which strategies do not fit the per-device budget,
    which is the first that does, and why it wins over the one asked about."""
    assert cli_main(["estimate-memory", "--params", "7B", "--largest-layer-params", "131M", "--num-gpus", "8",
                     "--device-memory", "80GB", "--strategy", "zero3"]) == 0
    out = capsys.readouterr().out
    assert "Recommended for 80GB per device: zero1" in out
    assert "must fit 80GB less a 10% reserve = 67.06 GiB" in out and "does not fit: ddp (" in out
    assert "zero1 is the first that fits" in out
    assert "zero3, which you asked about, fits too" in out and "zero1 shards less" in out
    assert cli_main(["estimate-memory", "--params", "70B", "--largest-layer-params", "1B", "--num-gpus", "8",
                     "--device-memory", "80GB", "--strategy", "ddp"]) == 0
    assert "ddp, which you asked about, does not fit: 1043.08 GiB per device" in capsys.readouterr().out


def test_all_to_all_buffers_under_ep_equal_a_hand_computation(tmp_path, capsys):
    from shardkit.memory import all_to_all_bytes

    # Qwen3-30B-A3B's shape: hidden 2048, top-8 of 128 experts
    config = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                  num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                  num_experts_per_tok=8, moe_intermediate_size=768, tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = spec_from_hf_config(config)
    # dispatch + combine, each batch 4 x seq 4096 tokens x top_k 8 rows of 2048 bf16 values: exactly 1 GiB
    hand = 2 * (4 * 4096) * 8 * 2048 * 2
    assert all_to_all_bytes(spec, 4, 4096, ep_size=8) == hand == 2**30
    assert all_to_all_bytes(spec, 4, 4096, ep_size=8, layers_in_flight=3) == 3 * hand
    assert all_to_all_bytes(spec, 4, 4096, ep_size=1) == 0  # no expert parallelism, no exchange
    dense = spec_from_hf_config({k: v for k, v in config.items() if "expert" not in k})
    assert all_to_all_bytes(dense, 4, 4096, ep_size=8) == 0
    assert cli_main(["estimate-memory", "--config", str(tmp_path / "config.json"), "--num-gpus", "8",
                     "--strategy", "ep", "--batch-size", "4", "--seq-len", "3072"]) == 0
    out = capsys.readouterr().out
    assert "(3353M active per token)" in out  # next to the total and active parameters
    # 2 x 12288 x 8 x 2048 x 2 bytes = 0.75 GiB
    assert ("All-to-all buffers per rank under ep 8 (dispatch + combine, one MoE layer in flight, balanced routing): "
            "0.75 GiB = 2 x 12288 tokens x top_k 8 x hidden 2048 x 2 bytes") in out, out
    assert cli_main(["estimate-memory", "--config", str(tmp_path / "config.json"), "--num-gpus", "8",
                     "--strategy", "fsdp", "--batch-size", "4", "--seq-len", "3072", "--ep-size", "4"]) == 0
    assert "under ep 4" in capsys.readouterr().out  # an explicit --ep-size shows the row whatever the strategy
    # ep x cp (ExpertParallel(cp_size=2)): each rank dispatches its half of every sequence
    assert cli_main(["estimate-memory", "--config", str(tmp_path / "config.json"), "--num-gpus", "8",
                     "--strategy", "ep", "--batch-size", "4", "--seq-len", "3072", "--ep-size", "4",
                     "--cp-size", "2"]) == 0
    assert "under ep 4 x cp 2 (dispatch + combine, one MoE layer in flight, balanced routing): 0.38 GiB = 2 x 6144 " \
           "tokens" in capsys.readouterr().out
    assert cli_main(["estimate-memory", "--config", str(tmp_path / "config.json"), "--num-gpus", "8",
                     "--ep-size", "2", "--cp-size", "4"]) == 2
    assert "ep(2) with cp(4)" in capsys.readouterr().err
    assert cli_main(["estimate-memory", "--config", str(tmp_path / "config.json"), "--num-gpus", "8",
                     "--ep-size", "3"]) == 2
    assert "--ep-size 3 does not divide the 8 device(s)" in capsys.readouterr().err
