"""The strategy contract: every registered strategy, and every one registered later with no edit here, on 2 CPU
ranks (gloo) in ONE process group per strategy (plus one 1-rank launch for the reload):

- ``init_module()`` builds SingleDevice's initial weights bitwise (same seed);
- ``gathered_parameters`` yields plain whole tensors equal to SingleDevice's, rank 0's writes under
  ``modifier_rank=0`` are kept (or, for a strategy in ``REFUSALS``, it refuses by name, naming the
  alternative), and ``iter_full_state_dict`` streams the full state dict to rank 0 one module at a time;
- FP32 losses and weights equal DDP's; gradient accumulation and clipping (norms, losses, weights) equal DDP's;
- an FP16 overflow on one rank skips the step on every rank and halves the loss scale (where the engine
  has FP16 on this device; else a skip quoting the engine's own error);
- save then exact resume: losses, weights and the whole next checkpoint equal the uninterrupted run's;
- a 2-rank save loads on 1 rank (the same strategy), saves the same state again and steps;
- greedy generation gives SingleDevice's tokens, with different requests per data-parallel rank (or, for a
  strategy in ``REFUSALS``, refuses by name);
- it declares the facts fronts and tools ask (no launch): its ``family``, its ``dims`` (a ParallelDims or None) and
  its memory (``model_state_memory`` answers the estimator); on the 2 ranks the family and dims stay declared after
  setup (dims resolved to the world) and Accelerate's front reports the family (``FRONTS`` for the built-in ones).

A strategy registered in this process, by a test, runs here too: its entry reaches the spawned ranks
(``contract_workers.registrations``), as test_added_strategy.py shows.

Weights are compared whole: on every rank where the strategy gathers parameters, else (it refuses
``gathered_parameters``: Pipeline, whose ranks hold only their stages) on the main rank, from the state dict
``iter_full_state_dict`` streams there, and every other rank must hold none.

Tolerances are those of each engine's own parity tests (bitwise where those assert bitwise); a strategy with
no entry in the tables gets the common one. ``KNOWN_FAILURES`` marks a real, reported bug as a strict xfail of
that one case (none today). ``RESUME_TO_ROUNDING`` holds ZeROInfinity's resume to rounding, with its reason.
The engines' own specifics (HF models, peak memory during init, offload, sharding modes, bf16) stay in
tests/distributed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from contract_workers import (
    ACCUM,
    ACCUM_MICRO_STEPS,
    CLIP,
    RESUME_STEPS,
    build_strategy,
    checkpoint_contents,
    contract_worker,
    registrations,
    reload_worker,
    strategy_names,
)
from harness import run_distributed

pytest.importorskip("deepspeed")  # four of the registered strategies are DeepSpeed's engine

# (rtol, atol) against DDP, as each engine's own parity test compares (test_fsdp.py, test_zero.py,
# test_tensor_parallel.py); None: bitwise (DDP against itself). Losses and clip norms: test_zero.py's and
# test_fsdp.py's 1e-5/1e-6. Weights after AdamW on the Llama: test_fsdp.py's 1e-4/1e-5, as Adam turns a 1-ulp
# difference in the clip norm into ~3e-6 in a weight (measured under ZeRO-3). ZeROInfinity steps
# DeepSpeedCPUAdam, torch AdamW's math in another rounding order (test_zero.py's offload tolerance).
COMMON = {"losses": (1e-5, 1e-6), "norms": (1e-5, 1e-6), "weights": (1e-4, 1e-5)}
TOLERANCE = {
    "ddp": {"losses": None, "norms": None, "weights": None},
    "zero_infinity": {"losses": (1e-4, 1e-5), "norms": (1e-4, 1e-5), "weights": (1e-4, 1e-5)},
    # TP sums its matmuls in another order (test_tensor_parallel.py's tolerances).
    "tp": {"losses": (1e-5, 1e-5), "norms": (1e-5, 1e-5), "weights": (1e-4, 5e-5)},
    # CP sums attention over key blocks in another order (ring: an online softmax; Ulysses: all-to-all), as TP
    # sums its matmuls: gradients agree to ~1e-7 (test_context_parallel.py), AdamW's 5 steps amplify it.
    "cp": {"losses": (1e-5, 1e-5), "norms": (1e-5, 1e-5), "weights": (1e-4, 5e-5)},
}
# (strategy, test) -> why that contract point does not apply to the strategy: skipped with the reason. Empty
# today: every check applies to every registered strategy (a refusal by name is asserted, see REFUSALS).
NOT_APPLICABLE: dict[tuple[str, str], str] = {}
# (strategy, check of contract_workers.CHECKS) -> (error type, texts its message must contain) where the strategy
# refuses that contract point by design: every rank must raise it, naming the strategy and the alternative (the
# test fails once the point works, so that the entry goes and the full check runs).
REFUSALS: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {
    # Each pipeline rank holds only its stages' parameters, so no parameter list means the same on every rank.
    ("pp", "gathered"): ("NotImplementedError", ("Pipeline", "runner.iter_full_state_dict(model)")),
    # A pipeline-split model runs only model(input_ids, labels=...) (the schedule's forward and backward).
    ("pp", "generation"): ("NotImplementedError", ("Pipeline", "generation", "single-device or FSDP strategy")),
    # Per-token log-probs for a preference loss are not a loss the pipeline schedule runs.
    ("pp", "preference"): ("NotImplementedError", ("Pipeline", "return_log_probs")),
}
# (strategy, test: a check of contract_workers.CHECKS or "reload") -> reason: a real bug (or engine limitation)
# reported to the lead, marked as a strict xfail of that one case so that its fix shows up as an XPASS failure.
KNOWN_FAILURES: dict[tuple[str, str], str] = {}
# strategy -> ((rtol, atol), reason) where resume is exact only to rounding, by an engine's design: its losses,
# weights and next checkpoint are held to that tolerance (tensors) and bitwise (everything else) instead.
RESUME_TO_ROUNDING: dict[str, tuple[tuple[float, float], str]] = {
    "zero_infinity": ((1e-5, 1e-6), (
        "its offloaded optimizer is DeepSpeedCPUAdam, whose C++ state keeps Adam's bias corrections beta**t as "
        "running products while a resumed optimizer recomputes them with pow(beta, t) "
        "(deepspeed/ops/csrc/includes/cpu_adam.h IncrementStep): the first step after a load differs by ~1 ulp "
        "(measured: loss 4e-6, weights 2e-7, moments 1e-8)")),
}
# strategy -> (error type name, text the message contains) where loading on another world size is a
# documented limitation. Empty today: every registered strategy reshards.
NO_RESHARD: dict[str, tuple[str, str]] = {}

# What Accelerate's front reports on 2 CPU ranks for each built-in strategy, as Accelerate itself would: NO for one
# process, MULTI_CPU for torch collectives without FSDP2 sharding over the data-parallel ranks (DDP, TP's and
# Pipeline's defaults), FSDP where FSDP2 shards them (CP: FSDP over dp_shard x cp, as Accelerate's cp_size runs
# under its FSDP), DEEPSPEED for the ZeRO engines. A strategy not listed is held to its declared family.
FRONTS = {"single": "NO", "ddp": "MULTI_CPU", "fsdp": "FSDP", "tp": "MULTI_CPU", "cp": "FSDP", "pp": "MULTI_CPU",
          "zero1": "DEEPSPEED", "zero2": "DEEPSPEED", "zero3": "DEEPSPEED", "zero_infinity": "DEEPSPEED"}
_BY_FAMILY = {"single": "NO", "data_parallel": "MULTI_CPU", "fsdp": "FSDP", "deepspeed": "DEEPSPEED"}

NAMES = strategy_names()


@pytest.fixture(scope="module", params=NAMES)
def strategy_name(request):
    """The registered strategy under test (test_added_strategy.py overrides it with one it registers)."""
    return request.param


@pytest.fixture(scope="module")
def contract(strategy_name, tmp_path_factory):
    """One 2-rank launch running every check for the strategy, and one 1-rank launch loading its save."""
    name, entries = strategy_name, registrations()
    root = tmp_path_factory.mktemp(f"contract-{name}")
    env = {"SHARDKIT_NVME_PATH": str(root / "nvme")}
    results = run_distributed(contract_worker, world_size=2, args=(name, str(root), entries), timeout=900, env=env)
    resume = results[0]["resume"]
    reload = None
    if "error" not in resume and resume["saved_world_size"] > 1:
        reload = run_distributed(reload_worker, world_size=1, args=(name, f"{resume['dir']}/mid", entries),
                                 timeout=600, env=env)[0]
    return {"name": name, "ranks": results, "reload": reload}


def _check(contract, request, check: str, test: str | None = None) -> list | None:
    """Each rank's result of ``check``; a check that raised fails here with its traceback. ``test`` (default:
    ``check``) names this test in KNOWN_FAILURES, for a test that reads another check's results. None where the
    strategy refuses the check by design (REFUSALS), once every rank is seen to raise that refusal."""
    name = contract["name"]
    if (name, test or check) in NOT_APPLICABLE:
        pytest.skip(f"{name}: {NOT_APPLICABLE[(name, test or check)]}")
    if (name, test or check) in KNOWN_FAILURES:
        request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[(name, test or check)]))
    results = [r[check] for r in contract["ranks"]]
    if (name, check) in REFUSALS:  # the check's own refusal, whichever test reads it
        _assert_refused(name, check, results, *REFUSALS[(name, check)])
        return None
    for rank, r in enumerate(results):
        if isinstance(r, dict) and "error" in r:
            pytest.fail(f"{name}: {check} raised on rank {rank}:\n{r['error']}", pytrace=False)
    return results


def _assert_refused(name: str, check: str, results: list, error_type: str, texts: tuple[str, ...]) -> None:
    for rank, r in enumerate(results):
        assert isinstance(r, dict) and "error_type" in r, f"{name} rank {rank}: {check} no longer refuses; drop it " \
                                                          "from REFUSALS so that the contract checks it"
        assert r["error_type"] == error_type, f"{name} rank {rank}: {check} raised, not the refusal:\n{r['error']}"
        missing = [t for t in texts if t not in r["message"]]
        assert not missing, f"{name} rank {rank}: {check}'s refusal does not name {missing}: {r['message']!r}"


def _holders(contract) -> list[int]:
    """The ranks that hold whole weights: every rank, or only the main one (global rank 0, where
    iter_full_state_dict streams) for a strategy that refuses gathered_parameters."""
    return [0] if (contract["name"], "gathered") in REFUSALS else list(range(len(contract["ranks"])))


def _assert_held(contract, rank: int, weights: dict, what: str) -> None:
    """``weights`` (one rank's result) hold the whole model on a holder rank, nothing on the others."""
    want = list(contract["ranks"][0]["reference"]) if rank in _holders(contract) else []
    assert sorted(weights) == sorted(want), f"{contract['name']} rank {rank}: {what} hold {sorted(weights)[:5]}"


def _close(got, want, tol, what: str) -> None:
    if tol is None:
        assert got == want if not isinstance(got, torch.Tensor) else torch.equal(got, want), f"{what}: not bitwise"
    else:
        torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), rtol=tol[0], atol=tol[1], msg=what)


def _tol(name: str, kind: str):
    return TOLERANCE.get(name, COMMON)[kind]


def _same(a, b) -> bool:
    """Bitwise equality through nested dicts, lists and tuples of tensors and plain values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):  # numpy's RNG state
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    return a == b or (isinstance(a, float) and math.isnan(a) and isinstance(b, float) and math.isnan(b))


def _near(a, b, tol: tuple[float, float]) -> bool:
    """Like _same, but tensors and floats need only be within ``tol`` (rtol, atol)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.allclose(a, b, rtol=tol[0], atol=tol[1])
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=tol[0], abs_tol=tol[1])
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_near(a[k], b[k], tol) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_near(x, y, tol) for x, y in zip(a, b))
    return _same(a, b)


def _differing(a: dict, b: dict, tol: tuple[float, float] | None = None) -> list[str]:
    equal = _same if tol is None else (lambda x, y: _near(x, y, tol))
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not equal(a[k], b[k]))


def test_init_module_gives_single_device_weights_bitwise(contract, request):
    name, results = contract["name"], _check(contract, request, "init")
    reference = contract["ranks"][0]["reference"]
    main = [r for r in results if r["main"]]
    for r in results:
        if r["main"]:
            assert list(r["state"]) == list(reference), f"{name}: state dict keys or order differ from SingleDevice's"
            differ = [k for k in reference if not torch.equal(r["state"][k], reference[k])]
            assert not differ, f"{name}: initial weights differ from SingleDevice's: {differ[:5]}"
        else:
            assert r["state"] == {}, f"{name}: a non-main rank received state dict entries"
    assert main, f"{name}: no rank is the main process"


def test_gathered_parameters_and_streamed_state_dict(contract, request):
    name, results = contract["name"], _check(contract, request, "gathered")
    for rank, r in enumerate(results or ()):  # None: refused by name (REFUSALS), which _check asserted
        assert set(r["types"]) <= {"Parameter", "Tensor"}, f"{name}: yielded {r['types']}, not plain tensors"
        assert not r["differ"], f"{name} rank {rank}: gathered tensors differ from SingleDevice's: {r['differ'][:5]}"
        assert r["flat_numel"] == r["model_numel"] == r["module_flat_numel"], (name, rank, r)
        assert r["kept"], f"{name} rank {rank}: rank 0's write under modifier_rank=0 was not kept"
    for rank, init in enumerate(_check(contract, request, "init", test="gathered")):
        for key, tensor in init["state"].items():
            assert tensor.device.type == "cpu" and type(tensor) is torch.Tensor, f"{name}: streamed {key}"
        if not init["main"]:
            # One module gathered at a time and nothing kept: far below the whole model on non-main ranks. A
            # rank that holds whole parameters of its own (its stages: REFUSALS) counts only new storages.
            peak = init["stream_new_peak" if (name, "gathered") in REFUSALS else "stream_peak"]
            assert peak < 0.5 * init["model_bytes"], (name, rank, peak)


def test_fp32_losses_equal_ddp(contract, request):
    name, results = contract["name"], _check(contract, request, "fp32_losses")
    for rank, r in enumerate(results):
        ddp = contract["ranks"][rank]["ddp"]["fp32_losses"]
        assert r["losses"][-1] < r["losses"][0] - 0.05, f"{name}: loss did not fall: {r['losses']}"
        _close(r["losses"], ddp["losses"], _tol(name, "losses"), f"{name} rank {rank}: losses vs DDP's")
        _assert_held(contract, rank, r["weights"], "weights after training")
        for key, w in r["weights"].items():
            _close(w, ddp["weights"][key], _tol(name, "weights"), f"{name} rank {rank}: {key} vs DDP's")
            assert torch.equal(w, results[0]["weights"][key]), f"{name}: ranks disagree on {key}"


def test_accumulation_and_clipping_equal_ddp(contract, request):
    name, results = contract["name"], _check(contract, request, "accumulation_clipping")
    for rank, r in enumerate(results):
        ddp = contract["ranks"][rank]["ddp"]["accumulation_clipping"]
        assert r["steps"] == ACCUM_MICRO_STEPS // ACCUM and len(r["norms"]) == r["steps"], (name, r["norms"])
        assert r["norm_types"] == [("Tensor", 0)], f"{name}: clip_gradients returned {r['norm_types']}"
        assert all(n > CLIP for n in r["norms"]), f"{name}: norms {r['norms']} were not clipped"
        assert r["norms"] == results[0]["norms"], f"{name}: ranks disagree on the norm"
        _close(r["norms"], ddp["norms"], _tol(name, "norms"), f"{name} rank {rank}: clip norms vs DDP's")
        _close(r["losses"], ddp["losses"], _tol(name, "losses"), f"{name} rank {rank}: losses vs DDP's")
        _assert_held(contract, rank, r["weights"], "weights after accumulation")
        for key, w in r["weights"].items():
            _close(w, ddp["weights"][key], _tol(name, "weights"), f"{name} rank {rank}: {key} vs DDP's")
            assert torch.equal(w, results[0]["weights"][key]), f"{name}: ranks disagree on {key}"


def test_fp16_overflow_skips_the_step_on_every_rank(contract, request):
    name, results = contract["name"], _check(contract, request, "fp16_overflow")
    unsupported = [r["unsupported"] for r in results if "unsupported" in r]
    if unsupported:
        assert len(unsupported) == len(results), f"{name}: FP16 refused on some ranks only: {unsupported}"
        pytest.skip(f"{name} has no FP16 on this CPU, as its engine says: {unsupported[0].splitlines()[0]}")
    for rank, r in enumerate(results):
        assert r["first"] is True, f"{name} rank {rank}: the first, finite step was skipped"
        assert (r["stepped"], r["unchanged"]) == (False, True), f"{name} rank {rank}: overflowed step applied: {r}"
        _assert_held(contract, rank, dict.fromkeys(r["compared"]), "weights compared across the skipped step")
        assert r["scale"] == 128.0, f"{name} rank {rank}: loss scale {r['scale']} after the overflow, not 256 / 2"
    assert results[-1]["where"] in ("grad", "loss") and results[0]["where"] in ("none", results[-1]["where"])


def test_save_then_exact_resume(contract, request):
    name, results = contract["name"], _check(contract, request, "resume")
    tol = RESUME_TO_ROUNDING.get(name, (None, ""))[0]
    for rank, r in enumerate(results):
        # Bitwise on CPU: weights, optimizer state, dropout RNG, data position and LR schedule all resume.
        assert len(r["resumed"]) == RESUME_STEPS * 2 and len(r["straight"]) == 2 * len(r["resumed"])
        after = r["straight"][len(r["resumed"]):]
        assert r["resumed"] == after if tol is None else _near(r["resumed"], after, tol), \
            f"{name} rank {rank}: losses after resume differ: {r['resumed']} vs {after}"
        for what in ("weights_at_save", "weights", "resumed_weights"):
            _assert_held(contract, rank, r[what], what)
        differ = _differing(r["resumed_weights"], r["weights"], tol)
        assert not differ, f"{name} rank {rank}: weights after resume differ: {differ[:5]}"
        assert r["loaded_step"] == RESUME_STEPS and r["steps"] == [2 * RESUME_STEPS] * 2
        assert r["scales"][0] == r["scales"][1]
    for r in {r["dir"]: r for r in results}.values():
        straight, resumed = (checkpoint_contents(f"{r['dir']}/{which}") for which in ("straight", "resumed"))
        differ = _differing(straight, resumed, tol)
        assert not differ, f"{name}: the checkpoint after resume differs from the uninterrupted run's in {differ}"


def test_load_on_another_world_size(contract, request):
    name = contract["name"]
    resume = _check(contract, request, "resume", test="reload")[0]
    if resume["saved_world_size"] == 1:
        pytest.skip(f"{name} runs as one process: its checkpoint was saved by 1 rank, so there is no 2 -> 1 load")
    loaded = contract["reload"]
    if name in NO_RESHARD:
        error_type, text = NO_RESHARD[name]
        assert loaded.get("error_type") == error_type and text in loaded.get("error", ""), loaded
        return
    assert "error_type" not in loaded, f"{name}: a 2-rank save does not load on 1 rank: {loaded}"
    assert loaded["world_size"] == 1 and loaded["step"] == RESUME_STEPS
    differ = _differing(loaded["weights"], resume["weights_at_save"])
    assert not differ, f"{name}: weights loaded on 1 rank differ from the 2-rank run's at the save: {differ[:5]}"
    kinds = ("module", "optimizer", "stateful")
    saved, again = checkpoint_contents(f"{resume['dir']}/mid", kinds), checkpoint_contents(loaded["again"], kinds)
    assert saved.keys() == again.keys() == {"model", "optimizer", "scheduler"}
    differ = _differing(saved, again)
    assert not differ, f"{name}: state loaded on 1 rank and saved again differs from the 2-rank save in {differ}"
    assert loaded["stepped"] and math.isfinite(loaded["loss"])


def test_greedy_generation_equals_single_device(contract, request):
    name, results = contract["name"], _check(contract, request, "generation")
    if results is None:  # refused by name (REFUSALS), which _check asserted
        return
    for rank, r in enumerate(results):
        for case in ("plain", "eos"):
            got, want = r[case]
            assert got.shape == want.shape and torch.equal(got, want), (
                f"{name} rank {rank} ({case}): {got.tolist()} != SingleDevice's {want.tolist()}")
        for row, (got, want) in enumerate(zip(*r["padded"])):
            assert torch.equal(got, want), (f"{name} rank {rank} left-padded row {row}: {got.tolist()} != its prompt "
                                            f"alone on SingleDevice: {want.tolist()}")
    first = results[0]
    assert first["plain"][1].shape == (2, 11) and not torch.equal(first["plain"][1], first["eos"][1])
    if first["dp_size"] > 1:  # the requests really differ per data-parallel rank
        assert results[1]["plain"][1].shape == (1, 6)


def test_declares_the_facts_fronts_and_tools_ask(strategy_name):
    """No launch: the built strategy (registry defaults) declares its family, its dims and its memory."""
    from shardkit.strategies.facts import MemoryJob, StateBytes, StrategyFamily
    from shardkit.strategies.parallel_dims import ParallelDims

    strategy = build_strategy(strategy_name)
    assert isinstance(strategy.family, StrategyFamily), f"{strategy_name}: family {strategy.family!r}"
    assert strategy.dims is None or isinstance(strategy.dims, ParallelDims), f"{strategy_name}: dims {strategy.dims!r}"
    job = MemoryJob(params=10_000, largest_layer=1_000, ranks=4, ranks_per_node=4, param_bytes=4, grad_bytes=4,
                    master_bytes=4 if strategy.keeps_master_copy else 0, state_bytes=8)
    held = strategy.model_state_memory(job)
    assert isinstance(held, StateBytes), f"{strategy_name}: model_state_memory returned {held!r}"
    # states are somewhere (device, host or NVMe), and no rank holds more than the whole model's
    total = held.params + held.grads + held.optimizer + held.host + held.nvme
    assert 0 < total <= job.params * (4 + 4 + 4 + 8), (strategy_name, held)
    assert min(held.params, held.grads, held.optimizer, held.working, held.host, held.nvme) >= 0, held


def test_set_up_strategy_keeps_its_facts_and_accelerate_reports_its_family(contract, request):
    name, results = contract["name"], _check(contract, request, "facts")
    for rank, r in enumerate(results):
        assert r["world_size"] == 2 or name == "single", (name, rank, r)
        if r["dims"] is not None:  # resolved against the world: the mesh's sizes multiply to it
            assert r["dims"]["world_size"] == r["world_size"], (name, rank, r["dims"])
        assert r["accelerate"] == FRONTS.get(name, _BY_FAMILY[r["family"]]), (name, rank, r)
        if r["world_size"] > 1:
            assert r["accelerate"] == _BY_FAMILY[r["family"]], (name, rank, r)
    assert len({r["family"] for r in results}) == 1, f"{name}: ranks disagree on the family"


def test_preference_loss_on_chunked_log_probs_equals_one_device(contract, request):
    """A DPO-sigmoid step on sequence log-probs from the chunked op (policy + frozen reference set up under the
    strategy, the reference sharded alike; TP with the head split on the vocabulary, CP with the sequences split):
    the loss and the updated policy weights equal one process's plain computation."""
    name, results = contract["name"], _check(contract, request, "preference")
    if results is None:  # refused by name (REFUSALS), which _check asserted
        return
    one = contract["ranks"][0]["ddp"]["preference"]
    for rank, r in enumerate(results):
        _close(r["loss"], one["loss"], _tol(name, "losses") or COMMON["losses"], f"{name} rank {rank}: DPO loss")
        want = list(one["weights"]) if rank in _holders(contract) else []
        assert sorted(r["weights"]) == sorted(want), f"{name} rank {rank}: weights held {sorted(r['weights'])[:5]}"
        for key, w in r["weights"].items():
            _close(w, one["weights"][key], _tol(name, "weights") or COMMON["weights"], f"{name} rank {rank}: {key}")
    if name == "tp":
        assert all("Shard(dim=0)" in r["head_placements"] for r in results), results[0]["head_placements"]
        for r in results:  # bias, softcap, temperature, entropy and ignored rows on the vocab-parallel path too
            assert max(r["vocab_parallel"].values()) < 1e-5, r["vocab_parallel"]
