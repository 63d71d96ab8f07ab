"""TensorParallel (DTensor parallelize_module) on real processes with gloo: tp=2 on the Llama model, 2-D with
FSDP on 4 ranks, a user plan, a non-Llama model with its own plan, the settings errors, and its mesh cut from the
one ParallelDims mesh (head counts tp does not divide refused by name)."""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from test_fsdp import TINY, abandoned_window_weights, build_and_train
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from shardkit.distributed import LaunchError, launch
from shardkit.models.llama import Llama, LlamaConfig, llama_plan


def _tp_vs_ddp(precision: str, kwargs: dict) -> dict:
    ddp = build_and_train("ddp", {}, precision, clip=1.0)
    return {"ddp": ddp, "tp": build_and_train("tp", kwargs, precision, clip=1.0)}


# Plain tp=2 (the strategy's defaults) against DDP: tests/contract/test_strategy_contract.py, every strategy.
@pytest.mark.parametrize("sequence_parallel", [True], ids=["tp+sp"])
def test_tp2_on_llama_matches_ddp(sequence_parallel):
    r0, r1 = run_distributed(_tp_vs_ddp, world_size=2, args=("fp32", {"tp_size": 2,
                                                                    "sequence_parallel": sequence_parallel}),
                             timeout=180)

    tp, ddp = r0["tp"], r0["ddp"]
    assert tp["losses"][-1] < tp["losses"][0] - 0.05
    # DDP averages two half-batches; TP computes the whole batch on both ranks: the same mean loss.
    torch.testing.assert_close(torch.tensor(tp["losses"]), torch.tensor(ddp["losses"]), rtol=1e-5, atol=1e-5)
    for key, w in tp["weights"].items():
        # Adam amplifies ulp noise where a gradient is near zero (seen: 6.8e-5 on one element of 2048 on another
        # CPU). One wrong update moves a weight by lr = 1e-2, so 2e-4 still catches any real divergence.
        torch.testing.assert_close(w, ddp["weights"][key], rtol=1e-4, atol=2e-4)
        assert torch.equal(w, r1["tp"]["weights"][key])


def _tp_bf16() -> dict:
    return build_and_train("tp", {"tp_size": 2}, "bf16", clip=1.0)


def test_tp2_bf16_trains_and_ranks_agree():
    r0, r1 = run_distributed(_tp_bf16, world_size=2, timeout=120)

    assert r0["losses"][-1] < r0["losses"][0] - 0.05
    assert r0["losses"] == r1["losses"]
    assert all(torch.equal(w, r1["weights"][k]) for k, w in r0["weights"].items())


def _two_d(dp: str) -> dict:
    out = build_and_train("tp", {"tp_size": 2, "dp": dp}, "fp32", clip=1.0)
    if dp == "fsdp":  # FSDP2 holds an abandoned window's gradients unsharded, out of optimizer.zero_grad's reach
        kwargs = {"tp_size": 2, "dp": dp}
        out["abandoned"] = [abandoned_window_weights("tp", kwargs, abandon) for abandon in (True, False)]
    return out


@pytest.mark.parametrize("dp", ["fsdp", "replicate"])
def test_2d_data_x_tensor_on_4_ranks_trains(dp):
    results = run_distributed(_two_d, world_size=4, args=(dp,), timeout=300)

    losses = results[0]["losses"]
    assert losses[-1] < losses[0] - 0.05, losses
    for r in results[1:]:
        assert r["losses"] == losses
        assert all(torch.equal(w, r["weights"][k]) for k, w in results[0]["weights"].items())
    if dp == "fsdp":  # abandon_window drops what the abandoned micro-batch left: training goes on as without it
        abandoned, clean = results[0]["abandoned"]
        for key, w in abandoned.items():
            torch.testing.assert_close(w, clean[key], rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


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
    from shardkit.strategies.tensor_parallel import TensorParallel, TensorParallelSettings

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


class PlannedMLP(torch.nn.Module):
    """A model that is not a Llama and keeps its own tensor-parallel plan beside it."""

    def __init__(self, width: int = 8, hidden: int = 32):
        super().__init__()
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))

    def parallel_plan(self, tp_size: int, sequence_parallel: bool = False) -> dict:
        return {"up": ColwiseParallel(), "down": RowwiseParallel()}


class UnplannedMLP(PlannedMLP):
    parallel_plan = None  # nothing to find: TensorParallel must be given plan=...


def _mlp_losses(model: torch.nn.Module, runner=None, steps: int = 6) -> tuple[list[float], torch.nn.Module]:
    """Fit ``2 * x`` on one fixed batch with Adam; every rank sees the whole batch (one TP group)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    if runner is not None:
        model, optimizer = runner.setup(model, optimizer)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), 2 * x)
        if runner is not None:
            runner.backward(loss)
            runner.step()
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def _non_llama_plans() -> dict:
    from torch.distributed.tensor import DTensor

    from shardkit import Runner
    from shardkit.strategies.tensor_parallel import TensorParallel

    torch.manual_seed(0)
    reference, _ = _mlp_losses(PlannedMLP())
    out = {"reference": reference}
    for case, cls, plan in (("own", PlannedMLP, None), ("given", UnplannedMLP, {"up": ColwiseParallel(),
                                                                                 "down": RowwiseParallel()})):
        torch.manual_seed(0)
        model = cls()
        losses, model = _mlp_losses(model, Runner(strategy=TensorParallel(2, plan=plan)))
        up = model.up.weight
        out[case] = {"losses": losses, "dtensor": isinstance(up, DTensor), "local_rows": up.to_local().shape[0],
                     "up": up.full_tensor().detach().clone()}
    return out


def test_tp_on_a_non_llama_model_with_its_own_plan_or_a_given_one():
    r0, r1 = run_distributed(_non_llama_plans, world_size=2, timeout=180)

    for case in ("own", "given"):
        got = r0[case]
        assert got["dtensor"] and got["local_rows"] == 16, f"{case}: up_proj was not split over 2 ranks: {got}"
        assert got["losses"][-1] < got["losses"][0], got["losses"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(r0["reference"]), rtol=1e-5, atol=1e-6)
        assert got["losses"] == r1[case]["losses"] and torch.equal(got["up"], r1[case]["up"])


def test_a_model_without_a_plan_gets_an_error_naming_both_fixes():
    from shardkit.strategies.tensor_parallel import resolve_plan

    with pytest.raises(ValueError, match=r"no plan for UnplannedMLP: pass TensorParallel\(plan=.*define "
                                         r"UnplannedMLP\.parallel_plan\(self, tp_size, sequence_parallel\)"):
        resolve_plan(UnplannedMLP(), None, 2)
    assert set(resolve_plan(PlannedMLP(), None, 2)) == {"up", "down"}
    assert list(resolve_plan(Llama(TINY), None, 2)) == list(llama_plan(Llama(TINY), 2))


def _tp_not_dividing() -> None:
    build_and_train("tp", {"tp_size": 3}, "fp32")


def test_tp_not_dividing_world_size_fails_before_anything_is_built():
    with pytest.raises(LaunchError, match=r"world_size\(2\) % tp_size\(3\) != 0"):
        launch(_tp_not_dividing, num_processes=2, timeout=60, env={"SHARDKIT_COLLECTIVE_TIMEOUT": "20"})


def _one_mesh_and_heads() -> tuple:
    from shardkit import Runner
    from shardkit.strategies import TensorParallel

    runner = Runner(TensorParallel(tp_size=2), seed=0)
    s = runner.strategy
    try:
        runner.setup(Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                                       num_kv_heads=1, max_position=32)))
        error = None
    except ValueError as e:
        error = str(e)
    return s.world_mesh.mesh_dim_names, s.mesh.mesh_dim_names, s.dims.sizes, error


def test_the_mesh_is_cut_from_parallel_dims_and_heads_are_checked():
    from shardkit.strategies.parallel_dims import DIM_NAMES

    for world_names, names, sizes, error in run_distributed(_one_mesh_and_heads, world_size=2, timeout=120):
        assert world_names == DIM_NAMES and names == ("dp_replicate", "dp_shard", "tp")
        assert sizes == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2}
        assert error is not None and "num_kv_heads(1) % tp(2) != 0: each tensor-parallel rank needs whole" in error


def _sp_generation() -> tuple[bool, bool]:
    from shardkit import Runner
    from shardkit.strategies import strategy_from_name

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         max_position=40)
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    want = Llama(config).eval().generate(ids, 20, synced=False)
    runner = Runner(strategy_from_name("tp", tp_size=2, sequence_parallel=True), seed=0)
    torch.manual_seed(0)
    model = runner.setup(Llama(config))
    cached = runner.generate(model, ids, max_new_tokens=20)
    return torch.equal(cached, want), torch.equal(runner.generate(model, ids, max_new_tokens=20, use_cache=False), want)


def test_sequence_parallel_generation_equals_single_device_with_and_without_the_kv_cache():
    # One new token a step is sharded over 2 ranks on the sequence dim (1 and 0 rows): still SingleDevice's tokens.
    for cached, recomputed in run_distributed(_sp_generation, world_size=2, timeout=180):
        assert cached and recomputed
