"""FSDP (torch FSDP2) on real processes with gloo: sharding modes, precisions, init, clipping, failures.

The helpers at the top (tiny Llama, fixed data, a train loop through the Runner) are shared with
test_tensor_parallel.py and test_sharded_checkpoint.py.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed
from torch.distributed.tensor import DTensor

from shardkit import BF16, FP16, FP32, Runner
from shardkit.distributed import LaunchError, launch
from shardkit.models.llama import Llama, LlamaBlock, LlamaConfig
from shardkit.strategies import strategy_from_name

TINY = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, max_position=16)
GLOBAL_BATCH, SEQ, STEPS = 4, 12, 5
PRECISIONS = {"fp32": FP32, "bf16": lambda: BF16("mixed"), "bf16-true": lambda: BF16("true"), "fp16": FP16}


def batches(steps: int = STEPS) -> torch.Tensor:
    """(steps, GLOBAL_BATCH, SEQ) tokens; the same on every rank and every run. Each row counts up from a
    random start, so the next token is learnable and the loss falls within a few steps."""
    starts = torch.randint(0, TINY.vocab_size, (steps, GLOBAL_BATCH, 1), generator=torch.Generator().manual_seed(1))
    return (starts + torch.arange(SEQ)) % TINY.vocab_size


def make_runner(strategy: str, kwargs: dict, precision: str, seed: int = 0, **runner_kwargs) -> Runner:
    return Runner(strategy=strategy_from_name(strategy, **kwargs), precision=PRECISIONS[precision](), seed=seed,
                  **runner_kwargs)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered to full size (a collective under FSDP/TP), as fp32 on CPU."""
    out = {}
    for name, t in model.state_dict().items():
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().clone()
    return out


def train(runner: Runner, model, optimizer, data: torch.Tensor, dp_rank: int, dp_size: int, clip: float | None = None,
          ) -> list[float]:
    """Each step: this data-parallel rank's slice of the global batch; returns the mean loss over ranks."""
    per = GLOBAL_BATCH // dp_size
    losses = []
    for step in range(data.shape[0]):
        x = data[step, dp_rank * per:(dp_rank + 1) * per].to(runner.device)
        loss = model(x, labels=x)
        runner.backward(loss)
        if clip is not None:
            runner.clip_gradients(clip)
        runner.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def build_and_train(strategy: str, kwargs: dict, precision: str, steps: int = STEPS, clip: float | None = None,
                    seed: int = 0) -> dict:
    runner = make_runner(strategy, kwargs, precision, seed=seed)
    model = Llama(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = runner.setup(model, optimizer)
    strat = runner.strategy
    dp_rank = getattr(strat, "data_parallel_rank", runner.rank)
    dp_size = getattr(strat, "data_parallel_size", runner.world_size)
    losses = train(runner, model, optimizer, batches(steps), dp_rank, dp_size, clip)
    return {"losses": losses, "weights": full_weights(runner.unwrap_model(model)), "mesh": mesh_layout(strat)}


def mesh_layout(strategy) -> dict | None:
    """The ParallelDims sizes, the whole mesh's dimension names and the part FSDP2 shards over (names, shape, this
    rank's shard group), of a strategy with a ParallelDims mesh; None for others."""
    if getattr(strategy, "world_mesh", None) is None:
        return None
    mesh = strategy.mesh
    shard = mesh.get_group("shard") if "shard" in (mesh.mesh_dim_names or ()) else None
    return {"dims": strategy.dims.sizes, "world": strategy.world_mesh.mesh_dim_names, "names": mesh.mesh_dim_names,
            "shape": tuple(mesh.shape), "shard_group": dist.get_process_group_ranks(shard) if shard else None}


# ---- every sharding mode x precision, against DDP -------------------------------------------------------

MODES = {
    "full": {"sharding": "full"},
    "grad_op": {"sharding": "grad_op"},
    "hybrid-2x1": {"sharding": "hybrid", "hybrid_shard_size": 1},
    "hybrid-1x2": {"sharding": "hybrid", "hybrid_shard_size": 2},
    "none": {"sharding": "none"},
    "full-offload-ac": {"sharding": "full", "cpu_offload": True, "activation_checkpointing": True},
    "full-wrap-by-size": {"sharding": "full", "auto_wrap": 2000},
}


# Each mode's (dp_replicate, dp_shard) on 2 ranks: its mesh is ParallelDims' under FSDP's names.
MODE_DIMS = {"full": (1, 2), "grad_op": (1, 2), "hybrid-2x1": (2, 1), "hybrid-1x2": (1, 2), "none": (2, 1),
             "full-offload-ac": (1, 2), "full-wrap-by-size": (1, 2)}


def _assert_meshes(results: list[dict]) -> None:
    for rank, per_rank in enumerate(results):
        for mode, (replicate, shard) in MODE_DIMS.items():
            got = per_rank[mode]["mesh"]
            names = ("shard",) if MODES[mode]["sharding"] in ("full", "grad_op") else ("replicate", "shard")
            group = [0, 1] if shard == 2 else [rank]
            assert got == {"dims": {"pp": 1, "dp_replicate": replicate, "dp_shard": shard, "cp": 1, "tp": 1},
                           "world": ("pp", "replicate", "shard", "cp", "tp"), "names": names,
                           "shape": (shard,) if names == ("shard",) else (replicate, shard),
                           "shard_group": group}, f"rank {rank} {mode}: mesh {got}"


def _all_modes(precision: str, clip: float | None) -> dict:
    results = {"ddp": build_and_train("ddp", {}, precision, clip=clip)}
    for mode, kwargs in MODES.items():
        results[mode] = build_and_train("fsdp", kwargs, precision, clip=clip)
    return results


def _assert_modes(results: list[dict], precision: str) -> None:
    rank0, rank1 = results
    ddp = rank0["ddp"]["losses"]
    for mode in ["ddp", *MODES]:
        losses = rank0[mode]["losses"]
        assert losses[-1] < losses[0] - 0.05, f"{mode}/{precision}: loss did not fall: {losses}"
        for key, w in rank0[mode]["weights"].items():  # replicas agree on the full weights
            assert torch.equal(w, rank1[mode]["weights"][key]), f"{mode}/{precision}: ranks differ on {key}"
        if precision == "fp32":
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp), rtol=1e-5, atol=1e-6,
                                       msg=f"{mode}: FSDP losses differ from DDP's")
            for key, w in rank0[mode]["weights"].items():
                torch.testing.assert_close(w, rank0["ddp"]["weights"][key], rtol=1e-4, atol=1e-5)
        else:  # bf16 compute: same trajectory as DDP within bf16 rounding
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-true"])
def test_every_sharding_mode_trains_like_ddp(precision):
    results = run_distributed(_all_modes, world_size=2, args=(precision, 1.0), timeout=300)
    _assert_modes(results, precision)
    _assert_meshes(results)


# Gradient accumulation and clipping against DDP, and an FP16 overflow on one rank's shard skipping the step on
# every rank, are checked for every strategy by tests/contract/test_strategy_contract.py.


def abandoned_window_weights(name: str, kwargs: dict, abandon: bool) -> dict:
    """Windows of 2 micro-batches through the Runner, the first window's first micro-batch abandoned
    (runner.abandon_window) when ``abandon``: the weights after 2 steps."""
    runner = make_runner(name, kwargs, "fp32", gradient_accumulation_steps=2)
    model = Llama(TINY)
    model, _ = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    strat = runner.strategy
    dp_rank, dp_size = strat.data_parallel_rank, strat.data_parallel_size
    per = GLOBAL_BATCH // dp_size
    for step, rows in enumerate(batches(2)):
        x = rows[dp_rank * per:(dp_rank + 1) * per]
        if step == 0 and abandon:
            runner.backward(model(x[:1], labels=x[:1]))
            runner.abandon_window()
        for part in x.chunk(2):
            runner.backward(model(part, labels=part))
        runner.step()
    return full_weights(runner.unwrap_model(model))


def _abandoned_window() -> dict:
    """DDP and FSDP with windows of 2 micro-batches, the first abandoned after one."""
    return {name: abandoned_window_weights(name, {}, abandon=True) for name in ("ddp", "fsdp")}


def test_abandoned_window_gradients_are_dropped():
    """FSDP2 holds a window's unsynced gradients unsharded, out of optimizer.zero_grad's reach: abandon_window drops
    them too, so training goes on as DDP's."""
    for got in run_distributed(_abandoned_window, world_size=2, timeout=300):
        for key, w in got["fsdp"].items():
            torch.testing.assert_close(w, got["ddp"][key], rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


# ---- init on the meta device ---------------------------------------------------------------------------


def _meta_init(sync: bool) -> dict:
    runner = make_runner("fsdp", {"sync_module_states": sync}, "fp32", seed=None)
    torch.manual_seed(100 + runner.rank)  # a different init on every rank
    reference = Llama(TINY) if runner.rank == 0 else None  # what rank 0 builds in plain memory
    torch.manual_seed(100 + runner.rank)
    with runner.init_module(empty_init=True):
        model = Llama(TINY)
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    model = runner.setup(model)
    weights = full_weights(model)
    same_as_rank0 = None
    if reference is not None:
        same_as_rank0 = all(torch.equal(weights[k], v) for k, v in reference.state_dict().items())
    buffers_ok = all(torch.isfinite(b).all() for b in model.buffers())
    return {"meta": meta, "weights": weights, "same_as_rank0": same_as_rank0, "buffers_ok": buffers_ok}


def test_init_module_builds_on_meta_and_starts_every_rank_from_rank0_weights():
    r0, r1 = run_distributed(_meta_init, world_size=2, args=(True,), timeout=120)

    assert r0["meta"] == [] and len(r1["meta"]) > 0  # rank 0 holds the real weights, rank 1 nothing
    assert r0["same_as_rank0"] is True
    assert all(torch.equal(v, r1["weights"][k]) for k, v in r0["weights"].items())
    assert r0["buffers_ok"] and r1["buffers_ok"]


def test_init_module_without_sync_materialises_with_the_model_init():
    r0, r1 = run_distributed(_meta_init, world_size=2, args=(False,), timeout=120)

    assert len(r0["meta"]) > 0 and len(r1["meta"]) > 0
    norm = r0["weights"]["layers.0.input_layernorm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))  # Llama.reset_parameters ran on the shards
    q = r0["weights"]["layers.0.self_attn.q_proj.weight"]
    assert 0.01 < q.std().item() < 0.03  # normal(0, 0.02), not uninitialised memory
    assert all(torch.equal(v, r1["weights"][k]) for k, v in r0["weights"].items())


# ---- memory ----------------------------------------------------------------------------------------------


def _state_bytes(strategy: str, kwargs: dict) -> dict:
    runner = make_runner(strategy, kwargs, "fp32")
    model = Llama(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = runner.setup(model, optimizer)
    train(runner, model, optimizer, batches(1), runner.rank, runner.world_size)
    x = batches(1)[0, :2]
    runner.backward(model(x, labels=x))  # leave gradients in place to be counted
    return runner.strategy.model_state_bytes(model, optimizer)


def test_model_state_bytes_counts_local_shards():
    full = run_distributed(_state_bytes, world_size=2, args=("fsdp", {"sharding": "full"}), timeout=120)
    none = run_distributed(_state_bytes, world_size=2, args=("fsdp", {"sharding": "none"}), timeout=120)
    psi = sum(p.numel() for p in Llama(TINY).parameters())

    assert none[0]["params"] == 4 * psi and none[0]["grads"] == 4 * psi
    assert 8 * psi <= none[0]["optimizer"] <= 8 * psi + 64 * 4  # exp_avg, exp_avg_sq (+ one step scalar each)
    for r in full:  # 16 psi / N, give or take uneven chunks
        assert abs(r["params"] - 2 * psi) <= 4 * 64 and abs(r["grads"] - 2 * psi) <= 4 * 64
    assert sum(r["params"] for r in full) == 4 * psi


# ---- bad settings and failures -------------------------------------------------------------------------


def test_bad_settings_name_the_values():
    from shardkit.strategies.fsdp import FSDP, FSDPSettings

    with pytest.raises(ValueError, match=r"sharding='ful'.*did you mean 'full'"):
        FSDP(sharding="ful")
    with pytest.raises(ValueError, match=r"world_size\(4\) % hybrid_shard_size\(3\) != 0"):
        FSDPSettings(sharding="hybrid", hybrid_shard_size=3).mesh_shape(4, 4)
    with pytest.raises(ValueError, match=r"FSDP sharding='hybrid': world_size\(6\) % hybrid_shard_size\(4\) != 0: "
                                         r".*choose a hybrid_shard_size that divides"):
        FSDPSettings(sharding="hybrid").parallel_dims(6, 4)  # the default: processes per node
    with pytest.raises(ValueError, match="only applies to sharding='hybrid'"):
        FSDP(sharding="full", hybrid_shard_size=2)
    with pytest.raises(ValueError, match="reshard_after_forward=True contradicts"):
        FSDP(sharding="grad_op", reshard_after_forward=True)
    with pytest.raises(ValueError, match="state_dict_type"):
        FSDP(state_dict_type="local")
    with pytest.raises(ValueError, match="auto_wrap"):
        FSDP(auto_wrap=True)


def test_sharding_modes_are_parallel_dims():
    from shardkit.strategies.fsdp import FSDPSettings
    from shardkit.strategies.parallel_dims import ParallelDims

    expected = {("full", None): (1, 8), ("grad_op", None): (1, 8), ("hybrid", None): (2, 4), ("hybrid", 2): (4, 2),
                ("none", None): (8, 1)}
    for (sharding, size), (replicate, shard) in expected.items():
        settings = FSDPSettings(sharding=sharding, hybrid_shard_size=size)
        assert settings.parallel_dims(8, 4) == ParallelDims(dp_replicate=replicate, dp_shard=shard), sharding
        names = ("shard",) if sharding in ("full", "grad_op") else ("replicate", "shard")
        shape = (shard,) if names == ("shard",) else (replicate, shard)
        assert settings.mesh_shape(8, 4) == (shape, names), sharding


def test_auto_wrap_class_names_resolve_against_the_model():
    from shardkit.strategies.fsdp import _resolve_classes

    model = Llama(TINY)
    assert _resolve_classes(("LlamaBlock",), model, "auto_wrap") == (LlamaBlock,)
    with pytest.raises(ValueError, match=r"no module of class 'LlamaBlok'.*did you mean 'LlamaBlock'"):
        _resolve_classes("LlamaBlok", model, "auto_wrap")


def _hybrid_3_on_2() -> None:
    make_runner("fsdp", {"sharding": "hybrid", "hybrid_shard_size": 3}, "fp32")


def test_hybrid_size_not_dividing_world_fails_before_training():
    with pytest.raises(LaunchError, match=r"world_size\(2\) % hybrid_shard_size\(3\) != 0"):
        launch(_hybrid_3_on_2, num_processes=2, timeout=60, env={"SHARDKIT_COLLECTIVE_TIMEOUT": "20"})


def _raise_mid_step() -> None:
    runner = make_runner("fsdp", {}, "fp32")
    model = Llama(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = runner.setup(model, optimizer)
    x = batches(1)[0, :2]
    loss = model(x, labels=x)
    if runner.rank == 1:
        raise RuntimeError("rank 1 fails between forward and backward")
    runner.backward(loss)  # rank 0 waits in the reduce-scatter for a peer that is gone
    runner.step()


def test_rank_raising_mid_step_ends_the_job_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_raise_mid_step, num_processes=2, timeout=90, env={"SHARDKIT_COLLECTIVE_TIMEOUT": "20",
                                                                   "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS",
                                                                                                     "1")})
    assert time.monotonic() - start < 90
    assert info.value.failed_ranks[0] == 1
    assert "rank 1 fails between forward and backward" in str(info.value)
