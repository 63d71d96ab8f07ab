"""A Hugging Face dense model under TensorParallel by transformers' own plan, two tp ranks simulated in one process
(torch's LocalTensorMode: every rank's tensors, real collectives between them): Qwen3's per-head ``q_norm``/``k_norm``
are ``replicated_with_grad_allreduce`` (each rank's norm sees only its heads), so their weight's gradient must be the
sum over the ranks' heads; every gradient, on every rank, equals one device's in fp64."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

local_tensor_mod = pytest.importorskip("torch.distributed._local_tensor")
transformers = pytest.importorskip("transformers")


def _tiny_qwen3() -> torch.nn.Module:
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).double()
    with torch.no_grad():  # norms away from 1, so a gradient summed wrongly shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def test_qwen3_per_head_norms_gradients_equal_one_device_under_tp2():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardkit.strategies.tensor_parallel import resolve_plan

    ref = _tiny_qwen3()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    ref(input_ids=ids, labels=ids).loss.backward()

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        with local_tensor_mod.LocalTensorMode(2):
            model = copy.deepcopy(ref)
            model.zero_grad(set_to_none=True)
            plan = resolve_plan(model, None, 2)  # the model's own Hugging Face plan
            assert {n for n in plan if "norm" in n} == {"model.layers.0.self_attn.q_norm",
                                                          "model.layers.0.self_attn.k_norm"}
            parallelize_module(model, init_device_mesh("cpu", (2,)), plan)
            model(input_ids=ids, labels=ids).loss.backward()
            grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                     for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()
    for name, p in ref.named_parameters():
        got = grads[name]
        per_rank = list(got._local_tensors.values()) if isinstance(got, local_tensor_mod.LocalTensor) else [got]
        for rank, g in enumerate(per_rank):
            torch.testing.assert_close(g, p.grad, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name} rank {rank}: {m}")
