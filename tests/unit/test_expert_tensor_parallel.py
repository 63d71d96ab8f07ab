"""Expert parallelism x tensor parallelism without real collectives: the sizes ep may take with tp (torchtitan's
rule: ep borrows every tp rank, so it is a multiple of tp dividing dp_shard * tp), the expert mesh each rank gets
(a fake process group: the ep group is tp peers, the experts' replicas the other batches), the selection
(``--strategy-opt tp_size=2``, Accelerate's ``parallelism_config_tp_size`` with ``parallelism_config_ep_size``), each
tp rank's share of the expert-sorted assignments, and the named refusals. The 4-rank run against one device is
tests/distributed/test_expert_parallel.py::test_expert_parallel_with_tensor_parallel_equals_one_process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import yaml

from shardkit.config.accelerate import load_accelerate_config
from shardkit.strategies.ep_tensor import _share
from shardkit.strategies.parallel_dims import ParallelDims
from shardkit.strategies.registry import STRATEGIES


def test_ep_borrows_the_tp_ranks_and_names_sizes_that_do_not_divide():
    assert ParallelDims(tp=2, ep=2).resolve(4).expert_replicas == 2  # 2 batches x 2 tp ranks, over ep 2
    assert ParallelDims(tp=2, ep=8).resolve(8).expert_replicas == 1
    assert ParallelDims(dp_replicate=2, tp=2, ep=2).resolve(8).expert_replicas == 4
    with pytest.raises(ValueError, match=r"ep\(2\) with tp\(4\): .*must be a multiple of 4 that divides dp_shard \* "
                                         r"tp = 8; e.g. ep=4"):
        ParallelDims(tp=4, ep=2).resolve(8)
    with pytest.raises(ValueError, match=r"ep\(6\) with tp\(2\): .*multiple of 2 that divides dp_shard \* tp = 8"):
        ParallelDims(tp=2, ep=6).resolve(8)
    assert ParallelDims(tp=2).resolve(8).expert_replicas == 8  # no ep: tp alone is no borrowing


@pytest.mark.parametrize("rank, ep, holders", [(0, [0, 1, 2, 3], [0, 4]), (3, [0, 1, 2, 3], [3, 7]),
                                               (5, [4, 5, 6, 7], [1, 5])])
def test_expert_mesh_under_tp(rank, ep, holders):
    """8 ranks, tp 2, ep 4: dp_shard 4 splits into dp_shard_mod_ep 2 x dp_shard_in_ep 2; ep is dp_shard_in_ep x tp."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=8, store=FakeStore())
    try:
        mesh = ParallelDims(tp=2, ep=4).resolve(8).build_expert("cpu")
        assert mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")
        assert mesh["ep"].mesh.tolist() == ep and mesh["dp_shard_mod_ep"].mesh.tolist() == holders
    finally:
        dist.destroy_process_group()


def test_each_tp_rank_takes_a_contiguous_share_of_the_sorted_assignments():
    counts = torch.tensor([3, 0, 4, 2])  # 9 assignments sorted by expert: bounds 0, 4, 9 for tp 2
    assert _share(counts, 0, 4).tolist() == [3, 0, 1, 0]
    assert _share(counts, 4, 9).tolist() == [0, 0, 3, 2]
    assert (_share(counts, 0, 3) + _share(counts, 3, 6) + _share(counts, 6, 9)).tolist() == counts.tolist()
    assert _share(torch.zeros(4, dtype=torch.long), 0, 0).tolist() == [0, 0, 0, 0]


def test_selection_and_refusals(tmp_path, monkeypatch):
    ep = STRATEGIES.build_from_cli("ep", ["ep_size=2", "tp_size=2", "sequence_parallel=true"])
    assert (ep.ep_size, ep.tp_size, ep.sequence_parallel) == (2, 2, True)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = tmp_path / "acc.yaml"
    path.write_text(yaml.safe_dump({"distributed_type": "FSDP", "mixed_precision": "no", "num_processes": 4,
                                    "use_cpu": True, "parallelism_config": {"parallelism_config_tp_size": 2,
                                                                            "parallelism_config_ep_size": 2}}))
    assert load_accelerate_config(path).strategy == ("ep", {"ep_size": 2, "tp_size": 2})
    with pytest.raises(ValueError, match=r"tp_size=0 must be an int >= 1"):
        STRATEGIES.build("ep", tp_size=0)
    with pytest.raises(ValueError, match=r"sequence_parallel=True .*needs tp_size > 1"):
        STRATEGIES.build("ep", sequence_parallel=True)
    both = STRATEGIES.build_from_cli("ep", ["ep_size=4", "cp_size=2", "tp_size=2"])  # EP x CP x TP
    assert (both.ep_size, both.cp_size, both.tp_size) == (4, 2, 2)
    with pytest.raises(ValueError, match=r"expert_tp=True splits each expert's matrices .*needs tp_size > 1"):
        STRATEGIES.build("ep", expert_tp=True)


def test_hugging_face_expert_blocks_under_tp_and_sequence_parallel():
    import transformers

    from shardkit.strategies.ep_hf_tensor import hf_dense_plan
    from shardkit.strategies.ep_tensor import apply_tensor_parallel
    from shardkit.strategies.expert_parallel import hf_expert_blocks

    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         num_experts=4, num_experts_per_tok=2)
    model = transformers.Qwen3MoeForCausalLM(config)
    blocks = hf_expert_blocks(model)
    # sequence parallelism: a layer whose mlp is dense is not mapped (named); the MoE decoder's entries
    config.mlp_only_layers = [1]
    dense = transformers.Qwen3MoeForCausalLM(config)
    with pytest.raises(ValueError, match=r"sequence_parallel=True: Qwen3MoeForCausalLM layer 1's mlp \(Qwen3MoeMLP\) "
                                         r"holds no expert block"):
        apply_tensor_parallel(dense, None, ParallelDims(tp=2, ep=2), True, hf_expert_blocks(dense))
    sp = hf_dense_plan(model, blocks, 2, True)
    assert {n: type(s).__name__ for n, s in sp.items() if n.startswith("model.layers.1.") or "." not in n[6:]} == {
        "model.layers.1.input_layernorm": "SequenceParallel", "model.layers.1.post_attention_layernorm":
        "SequenceParallel", "model.layers.1.self_attn": "PrepareModuleInput", "model.layers.1.mlp": "_WholeTokens",
        "model.layers.1.self_attn.o_proj": "RowwiseParallel", "model.layers.1.self_attn.q_proj": "ColwiseParallel",
        "model.layers.1.self_attn.k_proj": "ColwiseParallel", "model.layers.1.self_attn.v_proj": "ColwiseParallel",
        "model.layers.1.self_attn.q_norm": "SequenceParallel", "model.layers.1.self_attn.k_norm": "SequenceParallel",
        "model.norm": "SequenceParallel", "lm_head": "ColwiseParallel", "model.embed_tokens": "RowwiseParallel"}, sp
    # the embedding's output stays whole (the model takes its positions and mask from its length): split at layer 0
    assert type(sp["model.layers.0"]).__name__ == "PrepareModuleInput"
    # transformers' plan without the experts (split over ep) and without the dense MLP this model does not have; the
    # per-head norms replicated with their gradients summed; the router in no plan
    plan = hf_dense_plan(model, blocks, 2, False)
    assert {n.split(".", 3)[-1] if n.startswith("model.layers.") else n for n in plan} == {
        "self_attn.k_norm", "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.q_proj",
        "self_attn.v_proj", "lm_head", "model.embed_tokens"}, sorted(plan)


def test_mixtral_under_ep_and_tp_keeps_only_attention_and_head_in_the_plan():
    import transformers

    from shardkit.strategies.ep_hf_tensor import hf_dense_plan
    from shardkit.strategies.expert_parallel import hf_expert_blocks

    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    model = transformers.MixtralForCausalLM(config)
    plan = hf_dense_plan(model, hf_expert_blocks(model), 2, False)
    assert {n.split(".", 3)[-1] if n.startswith("model.layers.") else n for n in plan} == {
        "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj", "lm_head",
        "model.embed_tokens"}, sorted(plan)
