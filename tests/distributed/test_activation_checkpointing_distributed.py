"""Activation checkpointing under every strategy on 2 CPU ranks, in ONE launch (tests/distributed/ac_workers.py).

For shardkit's Llama (the Runner's switch, use_reentrant both ways) and a tiny Hugging Face Llama (its own
checkpointing both ways, as the Trainer enables it, and a DeepSpeed config's ``activation_checkpointing``
section, which goes through the Runner's switch), against the same run without checkpointing:

- the loss, the gradient norm and every weight after an SGD step are equal BITWISE: the recompute replays the
  same ops on the same inputs with the forward's RNG state (dropout 0.1 in shardkit's Llama), on CPU kernels that
  are deterministic, and the gradients reach the engines' reductions as the same values;
- checkpointing really happened: a block's MLP runs twice per step (forward, then the recompute in backward)
  instead of once, and autograd saves far fewer bytes in the forward (measured: 17% of them for the Llama,
  31% for the HF model under DDP);
- the DeepSpeed section's ``cpu_checkpointing`` moves exactly the block inputs to ``save_on_cpu``'s hooks (the
  bytes the outer counter sees drop by layers x rows x seq x hidden x 4), and ``deepspeed.checkpointing`` is
  configured with the section where a process group exists (every strategy but SingleDevice).
"""

from __future__ import annotations

import pytest
import torch
from ac_workers import CONFIG, HF_SKIP, SEQ, STRATEGIES, ac_worker
from harness import run_distributed

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("ac")
    ranks = run_distributed(ac_worker, world_size=2, args=(STRATEGIES,), timeout=900,
                            env={"SHARDKIT_NVME_PATH": str(root / "nvme")})
    return ranks


def _runs(results, name: str, model: str) -> list[dict]:
    per_rank = []
    for rank, r in enumerate(results):
        for variant, out in r[name][model].items():
            if "error" in out:
                pytest.fail(f"{name} {model} {variant} raised on rank {rank}:\n{out['error']}", pytrace=False)
        per_rank.append(r[name][model])
    return per_rank


def _assert_same_training(runs: dict, variant: str) -> None:
    base, out = runs["off"], runs[variant]
    assert out["losses"] == base["losses"], (variant, out["losses"], base["losses"])
    assert out["norms"] == base["norms"], (variant, out["norms"], base["norms"])
    differ = [k for k in base["weights"] if not torch.equal(out["weights"][k], base["weights"][k])]
    assert not differ, f"{variant}: weights not bitwise equal: {differ[:5]}"


def _assert_recomputed(runs: dict, variant: str, max_saved_ratio: float) -> None:
    assert runs["off"]["calls"] == [1], runs["off"]["calls"]
    assert runs[variant]["calls"] == [2], (variant, runs[variant]["calls"])
    assert runs[variant]["saved"] < max_saved_ratio * runs["off"]["saved"], (variant, runs[variant]["saved"],
                                                                              runs["off"]["saved"])


@pytest.mark.parametrize("name", STRATEGIES)
def test_llama_runner_switch_is_exact_and_recomputes(results, name):
    for runs in _runs(results, name, "llama"):
        for variant in ("plain", "reentrant"):
            _assert_same_training(runs, variant)
            _assert_recomputed(runs, variant, 0.25)


@pytest.mark.parametrize("name", [n for n in STRATEGIES if n not in HF_SKIP])
def test_hf_llama_own_checkpointing_and_deepspeed_section(results, name):
    for runs in _runs(results, name, "hf"):
        for variant in ("hf", "hf_reentrant", "ds_section"):
            _assert_same_training(runs, variant)
            _assert_recomputed(runs, variant, 0.4)
        block_inputs = CONFIG.num_layers * runs["off"]["rows"] * SEQ * CONFIG.hidden_size * 4
        assert runs["hf"]["saved"] - runs["ds_section"]["saved"] == block_inputs  # cpu_checkpointing took them
        ds = runs["ds_section"]["deepspeed"]
        assert "offload_to_cpu=True, synchronize=True" in ds["settings"]
        configured = name != "single"  # SingleDevice has no process group for DeepSpeed's comm layer
        assert (ds["configured"], ds["cpu"], ds["sync"], ds["profile"]) == (configured,) * 4, ds
