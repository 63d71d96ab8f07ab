"""Pipeline parallelism on 2 and 4 CPU ranks: each schedule's losses and weights equal DDP's (a short accumulation
window included); HF LlamaForCausalLM stages (tied head, a user's split) on 2; pp x dp on 4, with the stages
replicated (DDP) or sharded with FSDP2 over dp_shard (zero-bubble included), whose units reduce-scatter once per
accumulation window.

One launch per world size runs DDP and every case in one process group.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from pp_workers import STEPS, pp_worker

SCHEDULES = [{"schedule": "gpipe"}, {"schedule": "1f1b", "microbatches": 4},
             {"schedule": "interleaved_1f1b", "microbatches": 4}, {"schedule": "zero_bubble", "microbatches": 4},
             # V placement: rank 0 runs the first and the last stage, so the tied head's two uses share one weight.
             {"model": "hf_tied", "schedule": "zbv", "microbatches": 4}]
CASES = {
    # The window case: gradient_accumulation_steps=4 but every window 2 micro-batches long (begin_window), as
    # DDP's 2-micro-batch windows: the pipeline's loss must be scaled by the window, not by 4.
    2: [*SCHEDULES, {"schedule": "1f1b", "accumulation": 2}, {"schedule": "gpipe", "layer_split": (1, 3)},
        {"schedule": "1f1b", "accumulation": 4, "window": 2},
        {"model": "hf", "schedule": "1f1b", "microbatches": 4},
        {"model": "hf_tied", "schedule": "gpipe", "layer_split": "1,3"}],
    4: [{"schedule": "gpipe", "microbatches": 4}, {"schedule": "1f1b", "microbatches": 4},
        {"schedule": "1f1b", "pp_size": 2, "microbatches": 2}, {"schedule": "interleaved_1f1b", "pp_size": 2,
                                                                  "microbatches": 2, "accumulation": 2},
        # Windows of 2 calls under FSDP: the tied head's gradient summed across stages once per window.
        {"model": "hf_tied", "schedule": "1f1b", "pp_size": 2, "dp": "fsdp", "accumulation": 2},
        # An abandoned first window's unreduced FSDP gradients are dropped (the run equals DDP's without them).
        {"schedule": "interleaved_1f1b", "pp_size": 2, "dp": "fsdp", "accumulation": 2, "abandon": True},
        # Zero-bubble's weight passes (W) under FSDP, windows of 2 calls, tied head: every unit's weight gradient
        # counted (the stages stay whole from forward to reduction) and reduced once per window.
        {"model": "hf_tied", "schedule": "zero_bubble", "pp_size": 2, "dp": "fsdp", "accumulation": 2},
        {"schedule": "zbv", "pp_size": 2, "dp": "fsdp", "accumulation": 2},
        # Units that reshard after each forward (FSDP2's default): torch's I pass alone misses their weights
        # (losses off DDP's by 7e-3), WindowStage gathers them before each I and W pass.
        {"schedule": "zero_bubble", "pp_size": 2, "dp": "fsdp", "microbatches": 4, "reshard_after_forward": True},
        {"schedule": "dualpipev", "pp_size": 2, "dp": "fsdp"}],
}
# Micro-batches each case's schedules ran with no microbatches given: the accumulation window's length when it is
# over 1 (the short window's 2, not gradient_accumulation_steps' 4), else pp_size (dualpipev: one per stage).
WINDOW_MICROBATCHES = {"'1f1b')] accumulation=2": [2], "short window of ga=4, accumulation=2": [2],
                       "('layer_split', '1,3'), ('schedule', 'gpipe')] accumulation=1": [2],
                       "('schedule', 'interleaved_1f1b')] abandoned first window, accumulation=2": [2],
                       "('schedule', 'dualpipev')] accumulation=1": [4]}
TOL = dict(rtol=1e-5, atol=1e-5)
# Layouts refused at setup (name: Pipeline arguments, model), each with the words its error must hold.
REFUSALS = {4: {"zbv x fsdp, tied head": ({"schedule": "zbv", "pp_size": 2, "dp": "fsdp"}, "hf_tied",
                                          "cannot shard one weight in two stages; use schedule='zero_bubble'")}}


# Checkpoints of sharded stages: saved under pp 2 x FSDP 2, resumed under pp 2 x DDP 2, and from pp 1 into it.
RESUMES = {4: {"pp2 x fsdp2 -> pp2 x ddp2": ({"pp_size": 2, "dp": "fsdp"}, {"pp_size": 2, "schedule": "gpipe"}),
               "pp1 -> pp2 x fsdp2": ({"pp_size": 1}, {"pp_size": 2, "dp": "fsdp", "schedule": "gpipe"})}}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pp_layouts"))
    return {world: run_distributed(pp_worker, world_size=world, timeout=600,
                                   args=(cases, RESUMES.get(world, {}), root, REFUSALS.get(world, {})))
            for world, cases in CASES.items()}


@pytest.fixture(scope="module")
def results(launches):
    return {world: [per_rank["cases"] for per_rank in ranks] for world, ranks in launches.items()}


def _window_means(losses: list[float], accumulation: int) -> torch.Tensor:
    return torch.tensor(losses).reshape(-1, accumulation).mean(1)


@pytest.mark.parametrize("world", sorted(CASES))
def test_pipeline_losses_and_weights_equal_ddp(results, world):
    for rank, per_rank in enumerate(results[world]):
        for case, got in per_rank.items():
            if case.startswith("ddp"):
                continue
            accumulation = int(case.rsplit("=", 1)[1])
            model = case.split(" ", 1)[0]
            ddp = per_rank[f"ddp {model}" if model != "llama" else "ddp" if accumulation == 1 else "ddp_accumulation"]
            # Micro-batches of an accumulation window group rows differently under DDP (per rank) and a
            # pipeline (dp 1): each window's mean is the batch's mean in both.
            torch.testing.assert_close(_window_means(got["losses"], accumulation),
                                       _window_means(ddp["losses"], len(ddp["losses"]) // STEPS), **TOL,
                                       msg=lambda m, c=case, r=rank: f"rank {r} {c}: losses differ from DDP's: {m}")
            assert got["weights"], f"rank {rank} {case}: holds no stage"
            fsdp = "('dp', 'fsdp')" in case
            assert got["sharded"] == (sorted(got["weights"]) if fsdp else []), f"rank {rank} {case}: FSDP shards"
            assert len(got["weights"]) < len(ddp["weights"]), f"rank {rank} {case}: holds the whole model"
            for key, value in got["weights"].items():
                torch.testing.assert_close(value, ddp["weights"][key], **TOL,
                                           msg=lambda m, k=key, c=case: f"{c}: {k} differs from DDP's: {m}")


def test_sharded_stages_reduce_once_per_window(results):
    """Each FSDP unit reduce-scatters at the end of each accumulation window only (torch's stage alone does it at
    the end of every model(...) call: twice per window of 2)."""
    cases = [case for case in results[4][0] if "('dp', 'fsdp')" in case]
    assert any(case.endswith("accumulation=2") for case in cases), f"no FSDP case with a window of 2: {cases}"
    for rank, per_rank in enumerate(results[4]):
        for case in cases:
            counts = per_rank[case]["reduce_scatters"]
            assert counts and counts == dict.fromkeys(counts, STEPS), \
                f"rank {rank} {case}: reduce-scatters per FSDP unit over {STEPS} windows: {counts}"


def test_sharded_stages_gather_once_per_call(results):
    """Each FSDP unit all-gathers once per model(...) call (and once more for the schedule's shape inference on the
    first), kept whole through the call's micro-batches: resharded after each forward (FSDP2's default), it gathered
    again for each micro-batch's forward and backward (1f1b on pp 2 x dp 2: 1.15x the step time of torch's stages
    driven as torchtitan does, benchmarks/RESULTS.md)."""
    cases = [case for case in results[4][0] if "('dp', 'fsdp')" in case and "resharded" not in case
             and "abandon" not in case]
    assert any("'1f1b'" in case for case in cases), f"no 1f1b x fsdp case: {cases}"
    for rank, per_rank in enumerate(results[4]):
        for case in cases:
            calls = STEPS * int(case.rsplit("=", 1)[1])
            counts = per_rank[case]["all_gathers"]
            assert counts and counts == dict.fromkeys(counts, calls + 1), \
                f"rank {rank} {case}: all-gathers per FSDP unit over {calls} calls: {counts}"


def test_microbatches_come_from_the_accumulation_window(results):
    seen = {}
    for world in CASES:
        for case, got in results[world][0].items():
            for suffix, expected in WINDOW_MICROBATCHES.items():
                if case.endswith(suffix):
                    seen[suffix] = True
                    assert got["microbatches"] == expected, f"{case}: schedules ran {got['microbatches']}"
    assert sorted(seen) == sorted(WINDOW_MICROBATCHES), f"cases not run: {set(WINDOW_MICROBATCHES) - set(seen)}"


@pytest.mark.parametrize("case", sorted(RESUMES[4]))
def test_sharded_stages_resume_under_another_layout(launches, case):
    for rank, per_rank in enumerate(launches[4]):
        got = per_rank["resumed"][case]
        torch.testing.assert_close(torch.tensor(got["resumed"]), torch.tensor(got["uninterrupted"]), **TOL,
                                   msg=lambda m, r=rank: f"rank {r} {case}: resumed losses differ: {m}")
    assert launches[4][0]["resumed"][case]["consolidated"], f"{case}: zero-to-fp32's reader differs from the model"


@pytest.mark.parametrize("case", sorted(REFUSALS[4]))
def test_unsupported_layouts_are_refused_by_name(launches, case):
    words = REFUSALS[4][case][2]
    for rank, per_rank in enumerate(launches[4]):
        assert words in per_rank["refused"][case], f"rank {rank} {case}: {per_rank['refused'][case]}"
