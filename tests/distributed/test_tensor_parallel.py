"""TensorParallel (DTensor parallelize_module) on real processes with gloo: tp=2 on the Llama model, 2-D with
FSDP on 4 ranks, a user plan, and the settings errors."""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from test_fsdp import TINY, build_and_train
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from shardkit.distributed import LaunchError, launch
from shardkit.models.llama import Llama, LlamaConfig


def _tp_vs_ddp(precision: str, kwargs: dict) -> dict:
    ddp = build_and_train("ddp", {}, precision, clip=1.0)
    return {"ddp": ddp, "tp": build_and_train("tp", kwargs, precision, clip=1.0)}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_tp2_on_llama_matches_ddp(sequence_parallel):
    r0, r1 = run_distributed(_tp_vs_ddp, world_size=2, args=("fp32", {"tp_size": 2,
                                                                    "sequence_parallel": sequence_parallel}),
                             timeout=180)

    tp, ddp = r0["tp"], r0["ddp"]
    assert tp["losses"][-1] < tp["losses"][0] - 0.05
    # DDP averages two half-batches; TP computes the whole batch on both ranks: the same mean loss.
    torch.testing.assert_close(torch.tensor(tp["losses"]), torch.tensor(ddp["losses"]), rtol=1e-5, atol=1e-5)
    for key, w in tp["weights"].items():
        torch.testing.assert_close(w, ddp["weights"][key], rtol=1e-4, atol=5e-5)  # Adam amplifies ulp noise
        assert torch.equal(w, r1["tp"]["weights"][key])


def _tp_bf16() -> dict:
    return build_and_train("tp", {"tp_size": 2}, "bf16", clip=1.0)


def test_tp2_bf16_trains_and_ranks_agree():
    r0, r1 = run_distributed(_tp_bf16, world_size=2, timeout=120)

    assert r0["losses"][-1] < r0["losses"][0] - 0.05
    assert r0["losses"] == r1["losses"]
    assert all(torch.equal(w, r1["weights"][k]) for k, w in r0["weights"].items())


def _two_d(dp: str) -> dict:
    return build_and_train("tp", {"tp_size": 2, "dp": dp}, "fp32", clip=1.0)


@pytest.mark.parametrize("dp", ["fsdp", "replicate"])
def test_2d_data_x_tensor_on_4_ranks_trains(dp):
    results = run_distributed(_two_d, world_size=4, args=(dp,), timeout=300)

    losses = results[0]["losses"]
    assert losses[-1] < losses[0] - 0.05, losses
    for r in results[1:]:
        assert r["losses"] == losses
        assert all(torch.equal(w, r["weights"][k]) for k, w in results[0]["weights"].items())


def _user_plan() -> dict:
    plan = {"layers.*.mlp.gate_proj": ColwiseParallel(), "layers.*.mlp.up_proj": ColwiseParallel(),
            "layers.*.mlp.down_proj": RowwiseParallel()}
    tp = build_and_train("tp", {"tp_size": 2, "plan": plan}, "fp32")
    return {"tp": tp, "ddp": build_and_train("ddp", {}, "fp32")}


def test_a_user_plan_with_patterns_parallelises_any_model():
    r0, _ = run_distributed(_user_plan, world_size=2, timeout=180)

    torch.testing.assert_close(torch.tensor(r0["tp"]["losses"]), torch.tensor(r0["ddp"]["losses"]), rtol=1e-5,
                               atol=1e-5)


def test_settings_errors_name_the_values():
    from shardkit.strategies.tensor_parallel import TensorParallel, TensorParallelSettings, llama_plan

    with pytest.raises(ValueError, match=r"world_size\(4\) % tp_size\(3\) != 0"):
        TensorParallelSettings(tp_size=3).mesh_shape(4)
    with pytest.raises(ValueError, match=r"num_heads\(4\) % tp_size\(3\) != 0"):
        llama_plan(Llama(TINY), 3)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=1)
    with pytest.raises(ValueError, match=r"num_kv_heads\(1\) % tp_size\(2\) != 0"):
        llama_plan(Llama(cfg), 2)
    with pytest.raises(ValueError, match="dp='fdsp'.*did you mean 'fsdp'"):
        TensorParallel(2, dp="fdsp")
    with pytest.raises(ValueError, match="matches no module.*did you mean"):
        from shardkit.strategies.tensor_parallel import _expand

        _expand({"layers.0.mlp.up_prj": ColwiseParallel()}, Llama(TINY))
    with pytest.raises(ValueError, match="no built-in plan for Linear"):
        llama_plan(torch.nn.Linear(4, 4), 2)


def _tp_not_dividing() -> None:
    build_and_train("tp", {"tp_size": 3}, "fp32")


def test_tp_not_dividing_world_size_fails_before_anything_is_built():
    with pytest.raises(LaunchError, match=r"world_size\(2\) % tp_size\(3\) != 0"):
        launch(_tp_not_dividing, num_processes=2, timeout=60, env={"SHARDKIT_COLLECTIVE_TIMEOUT": "20"})
