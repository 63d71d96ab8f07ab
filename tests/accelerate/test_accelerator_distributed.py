"""shardkit.Accelerator on real processes (gloo on CPU): the Accelerate page's program as written, on 1 and 2
ranks, under DDP, FSDP, ZeRO-2 and ZeRO-3, and the front's behaviour under each:

- the page's program runs with only its import changed, every rank ends with the same weights, and FSDP's and
  ZeRO's weights equal DDP's;
- ``accumulate(model)`` with 2 micro-batches per step gives the weights the Runner's own accumulation gives,
  ``sync_gradients`` is True exactly on the micro-batches that end a window, and ``save_model`` writes the whole
  model (however it is sharded) as safetensors;
- ``save_state`` then ``load_state`` in a fresh Accelerator resumes exactly (losses, weights, learning rate);
- ``gather_for_metrics`` counts every sample of an uneven eval set once;
- on 2 ranks, the data loaders of tests/accelerate/test_accelerator_data.py: a loader with its own batch sampler,
  ``even_batches=False`` under ``join_uneven_inputs``, an iterable dataset resumed exactly, ``prepare_data_loader``;
- the TPU page's ``notebook_launcher(training_function, (model,))`` on 1 (as written) and 2 forked processes.

One launch per world size runs every check under every strategy in one process group.
"""

from __future__ import annotations

import pytest
import torch
from accel_workers import KINDS, tiny_checkpoint, training_function, worker
from harness import run_distributed

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

WORLDS = {1: ("single", *KINDS), 2: KINDS}
CASES = [pytest.param(world, kind, id=f"{kind}-{world}rank") for world, kinds in WORLDS.items() for kind in kinds]
# (rtol, atol) against DDP: the tolerances of tests/contract for losses and weights (FSDP and ZeRO reduce in
# another order); DDP against the Runner is bitwise.
CLOSE = (1e-5, 1e-6)
_TYPES = {"single": "NO", "ddp": "MULTI_CPU", "fsdp": "FSDP", "zero2": "DEEPSPEED", "zero3": "DEEPSPEED"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-bert")))


@pytest.fixture(scope="module")
def jobs(checkpoint, tmp_path_factory):
    """One launch per world size, run on first use: every check under every strategy of WORLDS."""
    done: dict[int, list] = {}

    def get(world: int) -> list:
        if world not in done:
            root = str(tmp_path_factory.mktemp(f"accelerate-{world}"))
            done[world] = run_distributed(worker, world_size=world, args=(checkpoint, root, WORLDS[world]),
                                          timeout=900, env={"SHARDKIT_NVME_PATH": f"{root}/nvme"})
        return done[world]

    return get


def _result(jobs, world: int, check: str, kind: str) -> list:
    out = [r[f"{check}/{kind}"] for r in jobs(world)]
    for rank, r in enumerate(out):
        if isinstance(r, dict) and "error" in r:
            pytest.fail(f"{check} under {kind} raised on rank {rank}:\n{r['error']}", pytrace=False)
    return out


@pytest.mark.parametrize("world,kind", CASES)
def test_the_pages_program_runs_as_written(jobs, world, kind):
    results = _result(jobs, world, "seed", kind)
    for r in results:
        assert r["steps"] == r["expected_steps"] == 3 * -(-20 // (4 * world))  # 3 epochs of ceil(20 / 4W) batches
        assert r["optimizer_steps"] == r["steps"]
        assert r["last_lr"] == 0.0  # the linear schedule ran to its end: stepped once per batch
        assert r["moved"] > 0 and r["ranks_equal"]
        assert r["distributed_type"] == ("NO" if world == 1 and kind == "ddp" else _TYPES[kind])
    if kind not in ("ddp", "single"):
        reference = _result(jobs, world, "seed", "ddp")[0]["weights"]
        torch.testing.assert_close(results[0]["weights"], reference, rtol=CLOSE[0], atol=CLOSE[1])


@pytest.mark.parametrize("world,kind", CASES)
def test_accumulate_gives_the_runners_weights(jobs, world, kind):
    for rank, r in enumerate(_result(jobs, world, "accumulation", kind)):
        assert r["pattern"] == [False, True, False, True]  # sync_gradients after optimizer.step(), each micro-batch
        if rank == 0:  # save_model wrote the whole model as safetensors, equal to the gathered state dict
            assert r["export"] == {"files": ["model.safetensors"], "equal": True}
        if kind == "ddp" and world == 2:  # DistributedDataParallelKwargs(bucket_cap_mb=1) reached shardkit's DDP
            assert r["settings"] == {"bucket_cap_mb": 1}
        assert r["steps"] == r["runner_steps"] == 2
        if kind in ("ddp", "single"):
            assert torch.equal(r["front"], r["runner"])
        else:
            torch.testing.assert_close(r["front"], r["runner"], rtol=CLOSE[0], atol=CLOSE[1])


@pytest.mark.parametrize("world,kind", CASES)
def test_save_state_load_state_resumes_exactly(jobs, world, kind):
    for r in _result(jobs, world, "resume", kind):
        assert r["resumed"] == r["straight"]  # the losses of the micro-batches after the save, bitwise
        assert torch.equal(r["resumed_weights"], r["straight_weights"])
        assert r["lr"] == r["straight_lr"]


@pytest.mark.parametrize("world,kind", CASES)
def test_gather_for_metrics_counts_every_sample_once(jobs, world, kind):
    for r in _result(jobs, world, "metrics", kind):
        assert sorted(r["seen"]) == list(range(7))
        assert r["plain"] == (8 if world == 2 else 7)  # gather keeps the padding repeat, gather_for_metrics drops it
        assert sorted(r["objects_last"]) == (["s4", "s5", "s6"] if world == 2 else ["s6"])


def test_data_loaders_accelerate_users_rely_on(jobs):
    out = jobs(2)
    for rank, r in enumerate(out):
        if "error" in r["loaders"]:
            pytest.fail(f"loaders raised on rank {rank}:\n{r['loaders']['error']}", pytrace=False)
    first, second = (r["loaders"] for r in out)
    # A loader with its own batch sampler: whole batches dealt in turn, the same draw on both processes although
    # their generators differ; every sample once over the epoch's batches and through gather_for_metrics.
    own = first["own_batches"] + second["own_batches"]
    assert all(len(b) == 4 for b in own) and len(first["own_batches"]) == len(second["own_batches"]) == 3
    assert sorted(i for b in own for i in b) == sorted([*range(22), *own[-1][2:]])  # the completed last batch
    assert first["own_metrics"] == second["own_metrics"] == list(range(22))
    # even_batches=False: 2 batches and 1, no sample twice; join_uneven_inputs lets the uneven backward finish
    # (without it, rank 0's second backward waits for a reduction rank 1 never joins).
    assert (first["uneven"], second["uneven"]) == ([0.0, 2.0], [1.0])
    # An iterable dataset: dealt item by item over the ranks, resumed exactly from a saved position.
    for r in (first, second):
        assert r["stream"]["resumed"] == r["stream"]["rest"]
    assert sorted(first["stream"]["seen"] + second["stream"]["seen"]) == list(range(16))
    # A DataLoader's own generator draws the order (Accelerate's meaning), the same on every process.
    assert sorted(i for r in (first, second) for b in r["generator_order"] for i in b) == list(range(10))
    assert first["prepare_data_loader"] == list(range(16))  # batches gathered in order: the single-process order
    assert all("different directories" in r["different_dirs"] for r in (first, second))


def test_notebook_launcher_runs_the_tpu_pages_function(checkpoint):
    from transformers import AutoModelForSequenceClassification

    from shardkit import notebook_launcher

    # In another Jupyter cell
    model = AutoModelForSequenceClassification.from_pretrained(checkpoint, num_labels=2)
    initial = [p.detach().clone() for p in model.parameters()]

    two = notebook_launcher(training_function, (model,), num_processes=2)  # forked: the children share `model`
    one = notebook_launcher(training_function, (model,))  # as the page writes it: one process on a CPU machine
    assert [r["num_processes"] for r in two] == [2, 2] and one[0]["num_processes"] == 1
    assert len(two[0]["losses"]) == 2 * 3 and len(one[0]["losses"]) == 2 * 5  # 2 epochs of ceil(20 / 4W) batches
    assert torch.equal(two[0]["weights"], two[1]["weights"])
    assert any(not torch.equal(a, b) for a, b in zip(initial, model.parameters()))  # trained here, in place
    for r in (two[0], one[0]):
        assert sum(r["losses"][-3:]) < sum(r["losses"][:3])  # lr 1e-3 on a learnable task: the loss falls
