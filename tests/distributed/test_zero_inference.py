"""ZeRO inference (2 CPU ranks, gloo): ``runner.setup(model)`` with no optimizer under ZeRO-3 (parameters on the
device or offloaded to CPU) and ZeROInfinity (parameters on NVMe, at the default path) gives an engine that
allocates no gradients, no fp32 master copy and no optimizer state, and whose logits equal SingleDevice's."""

from __future__ import annotations

import os

import pytest
import torch
from harness import run_distributed

from shardkit.strategies.zero.config import libaio_available

CASES = {
    "zero3": {},
    "zero3_offload_cpu": {"offload_params": "cpu"},
    # Swap buffers sized to this model (the default, 5 x 1e8 elements, is 2 GB per rank); nvme_path defaults.
    "zero_infinity": {"offload_optimizer": None, "buffer_size": 600_000},
}


def _model(case: str):
    from shardkit.models import Llama, LlamaConfig

    if case == "zero_infinity":
        # DeepSpeed swaps only partitions of at least 1 MiB (MIN_AIO_BYTES): the MLP weights here are
        # 512 x 1024 fp32, 1 MiB per rank; the smaller ones stay in host memory.
        return Llama(LlamaConfig(hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=4, max_position=16))
    return Llama(LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=4, num_heads=2, max_position=16))


def inference_worker(case: str) -> dict:
    from shardkit import Runner
    from shardkit.strategies import SingleDevice, strategy_from_name

    tokens = (torch.arange(24).reshape(2, 12) * 5 + 3 * torch.arange(2).reshape(2, 1)) % 256
    reference = Runner(SingleDevice("cpu"), seed=0)
    with reference.init_module():
        ref_model = _model(case)
    with torch.no_grad():
        ref_logits = ref_model.eval()(tokens)

    name = "zero_infinity" if case == "zero_infinity" else "zero3"
    runner = Runner(strategy_from_name(name, **CASES[case]), seed=0)
    with runner.init_module():
        model = _model(case)
    engine = runner.setup(model)
    with torch.no_grad():
        engine.eval()  # NOTE: DeepSpeed's engine.eval() returns None, not the engine
        logits = engine(tokens)
    inner = runner.unwrap_model(engine)
    ds_optimizer = engine.optimizer
    nvme_path = runner.strategy.settings.nvme_path
    swap_files = [f for _, _, files in os.walk(nvme_path) for f in files] if nvme_path else []
    return {
        "single_module": isinstance(engine, torch.nn.Module),
        # NOTE: same weights bitwise (test_init_parity), but DeepSpeed's zero.Init swaps F.linear for its own
        # matmul, which can round the last bit differently (6e-8 seen): equal to fp32 rounding, not bitwise.
        "logits_equal": torch.allclose(logits, ref_logits, rtol=1e-6, atol=1e-6),
        "max_diff": (logits - ref_logits).abs().max().item(),
        "grads": [n for n, p in inner.named_parameters() if p.grad is not None],
        "engine_optimizer": type(ds_optimizer).__name__,
        "fp32_master": any(hasattr(ds_optimizer, a) for a in ("fp32_partitioned_groups_flat", "optimizer")),
        "bytes": runner.strategy.model_state_bytes(engine, None),
        "model_bytes": sum(p.numel() * p.element_size() for p in ref_model.parameters()),
        "param_devices": sorted({str(getattr(p.ds_tensor, "final_location", None) or p.ds_tensor.device)
                                 for p in inner.parameters()}),
        "on_nvme": sum(p.ds_tensor.ds_numel for p in inner.parameters()
                       if str(getattr(p.ds_tensor, "final_location", None)).endswith("nvme")),
        "numel": sum(p.ds_tensor.ds_numel for p in inner.parameters()),
        "resident": sum(p.ds_tensor.numel() for p in inner.parameters()),
        "swap_files": len(swap_files),
        "engine_offload": str(getattr(engine.zero_offload_param(), "device", None)),
    }


@pytest.mark.parametrize("case", list(CASES))
def test_zero_inference_holds_no_training_state_and_matches_single_device(case, tmp_path):
    if case == "zero_infinity" and not libaio_available():
        pytest.skip("NVMe offload needs libaio (apt-get install libaio-dev)")
    results = run_distributed(inference_worker, world_size=2, args=(case,), timeout=900,
                              env={"SHARDKIT_NVME_PATH": str(tmp_path / "nvme")})

    for rank, r in enumerate(results):
        assert r["single_module"]  # runner.setup(model) returns the model alone, no optimizer
        assert r["logits_equal"], f"{case} rank {rank}: logits differ from SingleDevice's by {r['max_diff']}"
        assert r["grads"] == [] and r["bytes"]["grads"] == 0 and r["bytes"]["optimizer"] == 0, r["bytes"]
        assert r["engine_optimizer"] == "DeepSpeedZeRoOffload" and not r["fp32_master"]
        print(f"{case} rank {rank}: model-state bytes {r['bytes']} of a {r['model_bytes']}-byte model; "
              f"offload {r['engine_offload']}; "
              f"partitions on {r['param_devices']}; swap files {r['swap_files']}")
    if case == "zero_infinity":
        for r in results:
            assert r["engine_offload"] == "nvme" and r["swap_files"] > 0
            # Most of each rank's partition (all its MLP weights) lives in swap files, not in memory.
            assert r["on_nvme"] > 0.5 * r["numel"] and r["resident"] < 0.5 * r["numel"], r
            print(f"zero_infinity: {r['on_nvme']} of {r['numel']} partition elements on NVMe, {r['resident']} "
                  "resident")
    elif case == "zero3_offload_cpu":
        # The engine runs with its partitions offloaded to host memory (on this CPU-only machine that is
        # where they live anyway; with a GPU they leave the device).
        assert all(r["engine_offload"] == "cpu" and r["param_devices"] == ["cpu"] for r in results)
    else:
        assert all(r["engine_offload"] == "None" for r in results)
