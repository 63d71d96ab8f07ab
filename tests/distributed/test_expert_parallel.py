"""Expert parallelism on 4 CPU ranks equals one process for the MoE Llama built under ``runner.init_module()`` (the same
weights, bitwise): loss, whole gradients, clipped norm and weights after 3 AdamW steps, the last with the experts of
ep rank 1 empty, for ep 2 < dp 4 with the experts FSDP2-sharded over their replicas (``--strategy ep --strategy-opt
ep_size=2``) or replicated whole (``expert_sharding="none"``), and under HSDP (``dp_replicate=2``); the checkpoint
resumed in one process continues the one-device run; Hugging Face's Qwen3-MoE (its expert blocks dispatched the same
way, ep 4) equals its own one-process step; ep 2 x cp 2 (``ExpertParallel(ep_size=2, cp_size=2)``: sequences split
over the cp ranks, which split the experts) equals one device too, with the aux-loss-free update's counts and bias,
and its checkpoint continues in one process; the Runner and the Trainer select ExpertParallel from an Accelerate
config's parallelism_config_ep_size; ep 2 x tp 2 (``ExpertParallel(ep_size=2, tp_size=2)``, with and without sequence
parallelism: the tp peers split the experts and the tokens) equals one device, each assignment computed once, and so
does ep 2 x tp 2 with tensor parallelism inside the experts (``expert_tp=True``: each rank holding 1/tp of its
experts' weights and AdamW state), its checkpoint resumed in one process, under ep 4 and under ep 2 x tp 2, and back;
and with cp 2 x tp 2 together (``ExpertParallel(ep_size=4, cp_size=2, tp_size=2)``, ep borrowing cp and tp, and
``ExpertParallel(ep_size=2, cp_size=2, tp_size=2, expert_tp=True)``, ep borrowing cp) each equals one device;
so does Hugging Face's Qwen3-MoE at ep 2 x tp 2 (transformers' plan without its experts), with and without tensor
parallelism inside its expert blocks and with sequence parallelism, resumed in one process, and at ep 4 x cp 2 x tp 2.
An MoE Llama one-device checkpoint resumes under ep 2 (one saved layout whatever the ep size), and the Qwen3-MoE's
exports (save_pretrained, zero-to-fp32) are the Hub's per-expert files that
from_pretrained reads back. Expert parallelism inside a pipeline's stages (``Pipeline(pp_size=2, dp="fsdp",
ep_size=2)``) equals one device accumulating the same micro-batches, under every schedule, and so does Hugging Face's
Qwen3-MoE split by the pipeline with its router aux loss, with and without ep. One launch."""

from __future__ import annotations

import pytest
from ep_workers import STEPS, ep_worker
from harness import run_distributed

TOL = 2e-5
CASES = {"fsdp": (2, 4, 2, ["_StridedShard", "Shard"]),   # ep, dp, replicas, the expert weights' placements
         "replicated": (2, 4, 2, ["Replicate", "Replicate", "Shard"]),
         "hsdp": (2, 4, 2, ["Replicate", "_StridedShard", "Shard"]),
         "cp": (2, 2, 2, ["_StridedShard", "Shard"])}  # ep 2 x cp 2: 2 batches, experts FSDP2 over dp_shard_mod_ep


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(ep_worker, world_size=4, args=(str(tmp_path_factory.mktemp("ep")),), timeout=600)


@pytest.mark.parametrize("case", sorted(CASES))
def test_expert_parallel_equals_one_process(results, case):
    for rank, out in enumerate(results):
        got = out[case]
        assert (got["ep"], got["dp"], got["replicas"], got["placements"]) == CASES[case], (rank, got)
        assert got["init"] == 0, f"rank {rank}: init_module's weights differ from one device's by {got['init']}"
        assert max(got["loss"]) < TOL, f"rank {rank}: loss differs by {got['loss']}"
        assert max(got["grad"]) < TOL, f"rank {rank}: gradients differ by {got['grad']}"
        assert max(got["norm"]) < TOL, f"rank {rank}: gradient norms differ by {got['norm']}"
        assert got["weights"] < TOL and out["moved"] > 1e-3, (rank, got["weights"], out["moved"])
        # the routing statistics are the whole batch's, as on one device
        assert got["load"] == out["ref_load"], (got["load"], out["ref_load"])
        # the last step: ep rank 1's experts (2 and 3) got no token
        assert all(load[2] == 0 and load[3] == 0 for load in got["load"][STEPS - 1]), got["load"]


def test_expert_parallel_with_context_parallel_balances_on_the_whole_batch(results):
    for rank, out in enumerate(results):
        got = out["cp"]  # ep 2 x cp 2 (ring): the equalities above, and the routing statistics of the whole batch
        assert got["cp"] == 2, got
        assert got["counts"] == 0, f"rank {rank}: the bias update's counts differ by {got['counts']}"
        assert got["bias"] == 0 and got["bias_moved"] > 0, (rank, got["bias"], got["bias_moved"])
        # no labels: whole sequences on every cp rank, the load summed over the data-parallel ranks only
        assert got["logits"] < TOL and got["eval_load"], (rank, got["logits"], got["eval_load"])
        # ep 2 x cp 2 -> 1: its checkpoint's next step in one process is the ep 2 x cp 2 run's
        assert got["resumed_loss"] < TOL, (rank, got["resumed_loss"])


def test_expert_parallel_checkpoint_and_hf_model(results):
    for rank, out in enumerate(results):
        hf = out["hf"]  # Hugging Face's Qwen3-MoE, its expert blocks dispatched the same way
        assert hf["sharded"] and max(hf["loss"], hf["grad"], hf["weights"]) < TOL, (rank, hf)
        # EP 2 -> 1: the checkpoint (experts as FSDP2 x ep shards, AdamW state) resumes the one-device run
        assert out["resumed_loss"] < TOL, (rank, out["resumed_loss"])
        # Accelerate's parallelism_config with shardkit's parallelism_config_ep_size, under `shardkit launch`
        assert out["selected"] == {"runner": ("ExpertParallel", 2, 2), "trainer": ("ExpertParallel", 2, 2)}, out


def test_one_device_checkpoint_resumes_under_expert_parallel(results):
    for rank, got in enumerate(results):
        one = got["one_to_ep2"]
        # 1 -> EP 2: the one-device checkpoint's next steps under EP 2 take the uninterrupted run's losses
        assert len(one["loss"]) == STEPS - 1 and max(one["loss"]) < TOL, (rank, one["loss"])
        # one layout whatever the ep size: the same keys at the same global shapes, each expert weight whole and
        # stacked as transformers 5 holds it, (E, 2I, H) and (E, H, I)
        assert one["kinds"] == ["tensors", "sharded"] and one["same_layout"], (rank, one)
        assert one["experts"] == [[4, 32, 32], [4, 32, 16]], (rank, one["experts"])
    zero = results[0]["one_to_ep2"]  # zero-to-fp32 of either checkpoint: the same file
    assert zero["consolidated_keys"] and zero["consolidated"] < TOL, zero
    # the EP-2 checkpoint's experts assembled whole into transformers' Qwen2-MoE (shared expert, softmax top-k)
    assert zero["hf_architecture"] == "Qwen2MoeForCausalLM" and zero["hf_logits"] < 1e-5, zero


def test_hf_moe_trained_under_expert_parallel_exports_in_the_hub_layout(results):
    export = results[0]["hf_export"]  # rank 0 read both exports back
    assert export["zero_to_fp32_rc"] == 0, export
    for name in ("hf-ep", "fp32-ep"):  # save_pretrained, and zero-to-fp32 of the EP-2 Runner.save
        got = export[name]
        assert got["per_expert"] and not got["stacked"], (name, got)
        assert got["logits"] < TOL, (name, got)  # from_pretrained gives the EP model's logits


@pytest.mark.parametrize("case", ["tp", "tp_sp"])
def test_expert_parallel_with_tensor_parallel_equals_one_process(results, case):
    from ep_workers import CONFIG, GLOBAL_BATCH, SEQ

    for rank, out in enumerate(results):
        got = out[case]  # ep 2 x tp 2 (tp_sp: with sequence parallelism): 2 batches, the tp peers split the experts
        assert (got["ep"], got["tp"], got["dp"], got["replicas"]) == (2, 2, 2, 2), (rank, got)
        assert got["placements"] == ["_StridedShard", "Shard"] and got["dense_mesh"] == ["shard", "tp"], (rank, got)
        assert got["ep_group"] == ([0, 1] if rank < 2 else [2, 3]), (rank, got["ep_group"])  # ep borrows tp
        assert got["init"] == 0, f"rank {rank}: init_module's weights differ from one device's by {got['init']}"
        assert max(got["loss"]) < TOL and max(got["grad"]) < TOL and max(got["norm"]) < TOL, (rank, got)
        assert got["weights"] < TOL and out["moved"] > 1e-3, (rank, got["weights"], out["moved"])
        assert got["load"] == out["ref_load"], (got["load"], out["ref_load"])  # counted once, not tp times
        assert all(load[2] == 0 and load[3] == 0 for load in got["load"][STEPS - 1]), got["load"]
        # every assignment computed once over all ranks (the tp peers split them; tp times as many if repeated)
        moe_layers = CONFIG.num_layers - CONFIG.moe.first_dense_layers
        assert got["expert_rows"] == GLOBAL_BATCH * SEQ * CONFIG.moe.top_k * moe_layers, (rank, got["expert_rows"])
        if case == "tp":  # ep 2 x tp 2 -> 1: its checkpoint's next step in one process is the ep 2 x tp 2 run's
            assert got["resumed_loss"] < TOL, (rank, got["resumed_loss"])


# Expert parallelism inside a pipeline's stages (ep_pp_workers.py): pp 2 x ep 2, each stage's 2 ranks splitting its
# experts, against one device accumulating the same micro-batches.
PP_SCHEDULES = ("dualpipev", "gpipe", "interleaved_1f1b", "zbv", "zero_bubble")


def test_expert_parallel_inside_pipeline_stages_equals_one_device(results):
    for rank, out in enumerate(results):
        got, ref = out["ep_pp"]["1f1b"], out["ep_pp"]
        # --strategy pp, --strategy-opt pp_size=2 dp=fsdp ep_size=2: rank r is stage r // 2, its experts split in two
        assert (got["ep"], got["pp_rank"], got["layers"]) == (2, rank // 2, [f"layers.{rank // 2}.mlp"]), got
        assert got["experts"] == ["DTensor(Shard(dim=0),)"], got["experts"]
        assert got["init"] == 0, f"rank {rank}: initial weights differ from one device's by {got['init']}"
        assert max(got["loss"]) < TOL, f"rank {rank}: loss differs by {got['loss']}"
        assert max(got["grad"]) < TOL, f"rank {rank}: gradients differ by {got['grad']}"
        assert max(got["norm"]) < TOL, f"rank {rank}: gradient norms differ by {got['norm']}"
        assert got["weights"] < TOL and ref["moved"] > 1e-3, (rank, got["weights"], ref["moved"])
        # each micro-batch's load summed over the stage's ranks, as one device's; the last step left experts 2 and 3
        # (ep rank 1's) without a token
        assert all(got["load"]) and got["starved"] == [[0.0, 0.0]], (rank, got["load"], got["starved"])
        # the aux-loss-free update after each step: counts and bias of one device, not summed again over other
        # stages' layers
        assert max(got["counts"]) == 0 and max(got["bias"]) == 0 and ref["bias_moved"] > 0, (rank, got)
        # pp 2 x ep 2 -> 1: the checkpoint holds the whole experts and their AdamW moments, by name
        assert got["saved"] == 0, (rank, got["saved"])


@pytest.mark.parametrize("schedule", PP_SCHEDULES)
def test_expert_parallel_inside_pipeline_stages_under_every_schedule(results, schedule):
    for rank, out in enumerate(results):
        got = out["ep_pp"][schedule]  # 4 stages of one layer for the interleaved and V-shaped schedules
        assert got["init"] == 0 and max(got["loss"]) < TOL and max(got["grad"]) < TOL, (rank, schedule, got)
        assert got["weights"] < TOL and all(got["load"]) and max(got["counts"]) == 0 and max(got["bias"]) == 0, (rank,
                                                                                                         got)


def test_activation_checkpointing_under_ep_and_cp_equals_one_device_without_it(results):
    for rank, out in enumerate(results):
        ac = out["more"]["ac"]  # ep 2 x cp 2, every block recomputed in backward (its collectives with it)
        assert ac["checkpointed"] == 2 and ac["init"] == 0, (rank, ac)
        assert max(ac["loss"], ac["grad"], ac["weights"]) < TOL, (rank, ac)
        # the aux-loss-free update's counts: each token once, as without checkpointing
        assert ac["counts"] == 0, (rank, ac["counts"])


def test_hf_moe_under_ep_and_cp_and_its_checkpoint_at_other_sizes(results):
    for rank, out in enumerate(results):
        hf = out["more"]["hf_cp"]  # Qwen3-MoE, ep 2 x cp 2 against one process
        assert (hf["ep"], hf["cp"], hf["sharded"]) == (2, 2, True), (rank, hf)
        assert max(hf["loss"], hf["grad"], hf["weights"]) < TOL, (rank, hf)
        # its checkpoint's next step, in one process and under ep 2 alone (dp 4), is the ep 2 x cp 2 run's
        assert hf["to_ep2_dp"] == 4 and max(hf["to_one"], hf["to_ep2"]) < TOL, (rank, hf)


def test_expert_tensor_parallel_equals_one_process(results):
    from ep_workers import CONFIG, GLOBAL_BATCH, SEQ

    inter = CONFIG.moe.intermediate_size
    for rank, out in enumerate(results):
        got = out["etp"]  # ep 2 x tp 2, expert_tp=True: ep borrowed from dp_shard, each expert split over tp
        assert (got["ep"], got["tp"], got["dp"], got["replicas"], got["expert_tp"]) == (2, 2, 2, 1, True), (rank, got)
        assert got["ep_group"] == [rank % 2, rank % 2 + 2], (rank, got["ep_group"])  # one tp coordinate's dp ranks
        # each rank holds its block of its 2 experts only: gate's and up's rows (strided), down's columns
        assert got["mesh"] == ["ep", "tp"] and got["placements"] == ["Shard", "_StridedShard"], (rank, got)
        assert got["tp_placements"] == ["_StridedShard", "Shard"], (rank, got)
        assert got["local"] == [[2, inter, CONFIG.hidden_size], [2, CONFIG.hidden_size, inter // 2]], (rank, got)
        # the expert weights and AdamW moments a rank really holds: 1/tp of its ep slice, as estimate-memory counts
        assert got["held"] * 2 == got["ep_slice"] and got["held"] == got["estimated"], (rank, got)
        assert got["init"] == 0, f"rank {rank}: init_module's weights differ from one device's by {got['init']}"
        assert max(got["loss"]) < TOL and max(got["grad"]) < TOL and max(got["norm"]) < TOL, (rank, got)
        assert got["weights"] < TOL and out["moved"] > 1e-3, (rank, got["weights"], out["moved"])
        assert got["load"] == out["ref_load"], (got["load"], out["ref_load"])  # counted once, not tp times
        assert all(load[2] == 0 and load[3] == 0 for load in got["load"][STEPS - 1]), got["load"]
        # each tp peer runs its block of the experts on its ep group's every assignment: tp blocks of each row
        moe_layers = CONFIG.num_layers - CONFIG.moe.first_dense_layers
        assert got["expert_rows"] == 2 * GLOBAL_BATCH * SEQ * CONFIG.moe.top_k * moe_layers, (rank, got["expert_rows"])
        # the aux-loss-free update: counts and router bias of one device
        assert got["counts"] == 0 and got["bias"] == 0, (rank, got["counts"], got["bias"])
        # ep 2 x etp 2 -> 1 -> ep 2 x etp 2, and -> ep 4 and -> ep 2 x tp 2 (etp 1): the one layout; each takes the
        # same next step; so does a whole-tensor save (state_dict_type="full") of the strided shards, loaded in one
        # process and under ep 2 x etp 2
        assert max(got["resumed_loss"], got["reloaded_loss"], got["to_ep4"], got["to_ep2tp2"]) < TOL, (rank, got)
        assert max(got["full_to_one"], got["full_to_etp"]) < TOL, (rank, got)


@pytest.mark.parametrize("case", ["etp1", "etp"])
def test_expert_parallel_with_context_and_tensor_parallel_equals_one_process(results, case):
    from ep_workers import CONFIG, GLOBAL_BATCH, SEQ

    ep, ep_groups = {"etp1": (4, [[0, 1, 2, 3]] * 4), "etp": (2, [[0, 2], [1, 3], [0, 2], [1, 3]])}[case]
    for rank, out in enumerate(results):
        got = out["cptp"][case]  # cp 2 x tp 2 (dp_shard 1): etp1 ep 4 borrows cp and tp, etp ep 2 borrows cp
        assert (got["ep"], got["cp"], got["tp"], got["dp"], got["replicas"]) == (ep, 2, 2, 1, 1), (rank, got)
        assert got["expert_tp"] == (case == "etp") and got["ep_group"] == ep_groups[rank], (rank, got)
        assert got["dense_mesh"] == ["shard_cp", "tp"], (rank, got["dense_mesh"])  # FSDP2 over cp, on TP's DTensors
        assert got["init"] == 0, f"rank {rank}: init_module's weights differ from one device's by {got['init']}"
        assert max(got["loss"]) < TOL and max(got["grad"]) < TOL and max(got["norm"]) < TOL, (rank, got)
        assert got["weights"] < TOL and out["moved"] > 1e-3, (rank, got["weights"], out["moved"])
        # the statistics over the cp ranks, not over the tp peers (which route the same tokens)
        assert got["load"] == out["ref_load"], (got["load"], out["ref_load"])
        assert all(load[2] == 0 and load[3] == 0 for load in got["load"][STEPS - 1]), got["load"]
        assert got["counts"] == 0 and got["bias"] == 0, (rank, got["counts"], got["bias"])
        # no labels: whole sequences on every cp rank, the load summed over the data-parallel ranks only
        assert got["logits"] < TOL and got["eval_load"], (rank, got["logits"], got["eval_load"])
        # the split forward's assignments computed once over all ranks (etp: each tp peer its block of every one)
        moe_layers = CONFIG.num_layers - CONFIG.moe.first_dense_layers
        rows = GLOBAL_BATCH * SEQ * CONFIG.moe.top_k * moe_layers * (2 if case == "etp" else 1)
        assert got["expert_rows"] == rows, (rank, got["expert_rows"], rows)
        # its checkpoint's next step in one process, under ep 2 x tp 2 (etp 1, no cp) and under ep 4 (no cp, no tp)
        # is the run's own
        assert max(got["to_one"], got["to_ep2tp2"], got["to_ep4"]) < TOL, (rank, got)


@pytest.mark.parametrize("case", ["hf_tp", "hf_etp", "hf_sp"])
def test_hf_moe_under_ep_and_tp_equals_one_process_and_resumes_in_one(results, case):
    for rank, out in enumerate(results):
        hf = out[case]  # Qwen3-MoE at ep 2 x tp 2 (ep_hf_workers.py) against the same model in one process
        assert (hf["ep"], hf["tp"], hf["dp"], hf["experts"]) == (2, 2, 2, "DTensor"), (rank, hf)
        # sequence parallelism: between the decoder layers each tp rank holds half of the 12 positions
        assert hf["layer_seq"] == ([6] if case == "hf_sp" else [12]), (rank, hf["layer_seq"])
        if case == "hf_etp":  # ep over one tp coordinate's dp ranks; each rank its half (I 16 / tp 2) of 2 experts
            assert hf["ep_group"] == [rank % 2, rank % 2 + 2] and hf["local"] == [[2, 16, 32], [2, 32, 8]], (rank, hf)
        else:  # ep borrows tp: the tp pair's ranks hold different experts, FSDP2-sharded over their 2 replicas
            assert hf["ep_group"] == ([0, 1] if rank < 2 else [2, 3]) and hf["local"] == [[1, 32, 32], [1, 32, 16]], (
                rank, hf)
        # attention split over tp by transformers' plan, its per-head norms replicated over tp (gradients summed)
        assert hf["q_mesh"] == ["shard", "tp"] and hf["q_norm"] == ["Shard", "Replicate"], (rank, hf)
        assert hf["init"] == 0, f"rank {rank}: initial weights differ from one process's by {hf['init']}"
        assert max(hf["loss"]) < TOL and max(hf["grad"]) < TOL and max(hf["norm"]) < TOL, (rank, hf)
        assert hf["weights"] < TOL and hf["moved"] > 1e-3, (rank, hf["weights"], hf["moved"])
        assert hf["load"] == [hf["real"]], (rank, hf["load"], hf["real"])  # padding routed to no expert
        assert hf["resumed"] < TOL, (rank, hf["resumed"])  # ep 2 x tp 2 -> 1: the same next step


def test_hf_moe_under_ep_cp_and_tp_together_equals_one_process(results):
    for rank, out in enumerate(results):
        hf = out["hf_cptp"]  # Qwen3-MoE at ep 4 x cp 2 x tp 2 (ep_hf_workers.hf_cptp_case), 3 clipped SGD steps
        assert hf["sizes"] == [4, 2, 2, 1] and hf["ep_group"] == [0, 1, 2, 3], (rank, hf)  # ep borrows cp and tp
        assert hf["q_norm"] == ["Shard", "Replicate"], (rank, hf)  # per-head norms replicated over tp
        assert max(hf["loss"]) < TOL and max(hf["grad"]) < TOL and max(hf["norm"]) < TOL, (rank, hf)
        assert max(hf["weights"]) < TOL, (rank, hf["weights"])


@pytest.mark.parametrize("case", ["pp", "pp_ep"])
def test_hf_moe_split_by_the_pipeline_equals_one_device(results, case):
    for rank, out in enumerate(results):
        hf, ref = out["ep_pp"]["hf"][case], out["ep_pp"]["hf"]  # Qwen3-MoE, its router aux loss on (ep_pp_workers)
        # Pipeline(pp_size=2) replicates each stage's experts; with dp="fsdp", ep_size=2 they are split over ep
        assert hf["layers"] == [f"model.layers.{rank // 2}.mlp.gate.weight"], (rank, hf["layers"])
        assert hf["experts"] == (["DTensor"] if case == "pp_ep" else ["Tensor"]), (rank, hf["experts"])
        assert hf["init"] == 0, f"rank {rank}: initial weights differ from one device's by {hf['init']}"
        # the aux loss (every layer's routers together, as transformers computes it) is in the loss and gradients
        assert ref["aux"] > 1.0 and max(hf["loss"]) < TOL, (rank, ref["aux"], hf["loss"])
        assert max(hf["grad"]) < TOL and max(hf["norm"]) < TOL, (rank, hf)
        assert hf["weights"] < TOL and ref["moved"] > 1e-3, (rank, hf["weights"], ref["moved"])
