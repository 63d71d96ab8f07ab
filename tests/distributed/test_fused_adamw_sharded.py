"""FusedAdamW (``adamw_shardkit``) on DTensor parameters: FSDP2 shards and tensor-parallel weights, 2 CPU ranks.

Its states are DTensors laid out like their parameters and the fused step runs on the local shards, so it must
follow torch's AdamW step for step, keep the replicas equal, and resume exactly from a sharded checkpoint
(master weights included, under true bf16).
"""

from __future__ import annotations

import torch
from harness import run_distributed
from test_fsdp import TINY, batches, full_weights, make_runner, train
from torch.distributed.tensor import DTensor

from shardkit.models.llama import Llama
from shardkit.optim import FusedAdamW

# label -> (strategy, options); "tp2d" runs on 4 ranks (FSDP's dp_shard x TP), the others on 2
SETUPS = {"fsdp": ("fsdp", {"sharding": "full"}), "tp": ("tp", {"tp_size": 2, "sequence_parallel": True}),
          "tp2d": ("tp", {"tp_size": 2, "dp": "fsdp"})}
OPTIMIZERS = {"torch": torch.optim.AdamW, "fused": FusedAdamW}
STEPS, SAVED_AT = 5, 3


def _run(strategy: str, precision: str, optimizer: str, data: torch.Tensor, ckpt: str | None = None,
         load: bool = False) -> dict:
    runner = make_runner(*SETUPS[strategy], precision)
    model = Llama(TINY)
    model, opt = runner.setup(model, OPTIMIZERS[optimizer](model.parameters(), lr=1e-2, weight_decay=0.1))
    if load:
        runner.load(ckpt, {"model": model, "optimizer": opt})
    dp_rank = runner.strategy.data_parallel_rank
    losses = train(runner, model, opt, data, dp_rank, runner.strategy.data_parallel_size, clip=1.0)
    if ckpt and not load:
        runner.save(ckpt, {"model": model, "optimizer": opt})
    # a state is a DTensor exactly where its parameter is one (TP leaves some parameters plain)
    kinds = {(isinstance(p, DTensor), isinstance(s["exp_avg"], DTensor)) for p, s in opt.state.items()}
    return {"losses": losses, "weights": full_weights(runner.unwrap_model(model)),
            "dtensor_states": kinds <= {(True, True), (False, False)} and (True, True) in kinds}


def _worker(tmp: str) -> dict:
    data = batches(STEPS)
    out = {}
    for strategy in ("fsdp", "tp"):
        out[strategy] = {name: _run(strategy, "fp32", name, data) for name in OPTIMIZERS}
        ckpt = f"{tmp}/{strategy}"
        out[strategy]["full"] = _run(strategy, "bf16-true", "fused", data)
        _run(strategy, "bf16-true", "fused", data[:SAVED_AT], ckpt=ckpt)
        out[strategy]["resumed"] = _run(strategy, "bf16-true", "fused", data[SAVED_AT:], ckpt=ckpt, load=True)
    return out


def test_fused_adamw_steps_dtensor_shards_like_torch_adamw_and_resumes_exactly(tmp_path):
    r0, r1 = run_distributed(_worker, world_size=2, args=(str(tmp_path),), timeout=300)

    for strategy, runs in r0.items():
        fused, ref = runs["fused"], runs["torch"]
        assert fused["dtensor_states"], f"{strategy}: FusedAdamW states are not DTensors like their parameters"
        assert fused["losses"][-1] < fused["losses"][0] - 0.05, (strategy, fused["losses"])
        torch.testing.assert_close(torch.tensor(fused["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
        for key, w in fused["weights"].items():
            torch.testing.assert_close(w, ref["weights"][key], rtol=1e-4, atol=5e-5, msg=f"{strategy}: {key}")
            assert torch.equal(w, r1[strategy]["fused"]["weights"][key]), f"{strategy}: ranks differ on {key}"
        full, resumed = runs["full"], runs["resumed"]
        assert resumed["losses"] == full["losses"][SAVED_AT:], (strategy, full["losses"], resumed["losses"])
        for key, w in full["weights"].items():
            assert torch.equal(w, resumed["weights"][key]), f"{strategy}: resumed weights differ on {key}"


def _two_d() -> dict:
    data = batches(STEPS)
    return {name: _run("tp2d", "fp32", name, data) for name in OPTIMIZERS}


def test_fused_adamw_on_a_2d_fsdp_x_tp_mesh_follows_torch_adamw():
    # 4 ranks: the parameters are DTensors sharded over both mesh dims (FSDP's dp_shard and TP)
    results = run_distributed(_two_d, world_size=4, timeout=300)
    for r in results:
        fused, ref = r["fused"], r["torch"]
        assert fused["dtensor_states"] and fused["losses"][-1] < fused["losses"][0] - 0.05, fused["losses"]
        torch.testing.assert_close(torch.tensor(fused["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
        for key, w in fused["weights"].items():
            torch.testing.assert_close(w, ref["weights"][key], rtol=1e-4, atol=5e-5, msg=key)
            assert torch.equal(w, results[0]["fused"]["weights"][key]), f"ranks differ on {key}"
