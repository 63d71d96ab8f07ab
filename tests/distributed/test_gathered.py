"""Whole weights on demand under every strategy (2 CPU ranks, gloo): ``runner.gathered_parameters`` yields plain
whole tensors (FSDP2 and TP DTensors gathered), the set-up model reads whole inside the block, writes on
``modifier_rank`` are kept on every rank, and ``runner.iter_full_state_dict`` streams the full state dict to
rank 0 one module at a time without any rank holding the whole model."""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from test_init_parity import LiveBytes

STRATEGIES = ["single", "ddp", "fsdp", "zero1", "zero2", "zero3", "tp"]
SHARDED = {"fsdp", "zero3"}


def _llama_config():
    from shardkit.models import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=8, num_heads=2, max_position=16)


def gathered_worker(name: str) -> dict:
    from shardkit import Runner
    from shardkit.models import Llama
    from shardkit.strategies import strategy_from_name

    runner = Runner(strategy_from_name(name), seed=0)
    reference = Llama(_llama_config())  # seeded alike on every rank: the weights every strategy must show
    expected = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    model = Llama(_llama_config())
    model.load_state_dict(expected)
    model, _ = runner.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    inner = runner.unwrap_model(model)
    names = [n for n, _ in inner.named_parameters()]
    out: dict = {}

    with runner.gathered_parameters(inner.parameters()) as whole:
        out["types"] = sorted({type(t).__name__ for t in whole})
        out["whole_equal"] = all(torch.equal(t.detach(), expected[n]) for n, t in zip(names, whole))
        out["flat_numel"] = torch.cat([t.detach().reshape(-1) for t in whole]).numel()
        # The idiom: read the model's own parameters inside the block.
        out["module_flat_numel"] = torch.cat([p.detach().reshape(-1) for p in inner.parameters()]).numel()
    out["model_numel"] = sum(t.numel() for t in reference.parameters())

    target = dict(inner.named_parameters())["layers.1.mlp.up_proj.weight"]
    with runner.gathered_parameters([target], modifier_rank=0) as (w,), torch.no_grad():
        w.fill_(0.25 if runner.rank == 0 else 7.0)  # only rank 0's write counts
    with runner.gathered_parameters([target]) as (w,):
        out["kept"] = torch.equal(w.detach(), torch.full_like(w.detach(), 0.25))

    probe, sizes = LiveBytes(), {}
    with probe:
        for key, tensor in runner.iter_full_state_dict(model):
            sizes[key] = (tuple(tensor.shape), tensor.device.type, bool(torch.equal(tensor, expected[key]))
                          if key != "layers.1.mlp.up_proj.weight" else True)
    out.update(stream=sizes, stream_peak=probe.peak, keys=list(expected),
               model_bytes=sum(t.numel() * t.element_size() for t in reference.parameters()),
               shapes={k: tuple(v.shape) for k, v in expected.items()})
    return out


@pytest.mark.parametrize("name", STRATEGIES)
def test_gathered_parameters_and_streamed_state_dict(name):
    world = 1 if name == "single" else 2
    results = run_distributed(gathered_worker, world_size=world, args=(name,), timeout=600)

    for rank, r in enumerate(results):
        assert set(r["types"]) <= {"Parameter", "Tensor"}, f"{name}: yielded {r['types']}, not plain tensors"
        assert r["whole_equal"], f"{name} rank {rank}: gathered tensors differ from the full weights"
        assert r["flat_numel"] == r["model_numel"] == r["module_flat_numel"]
        assert r["kept"], f"{name} rank {rank}: rank 0's write under modifier_rank=0 was not kept"
    r0 = results[0]
    assert list(r0["stream"]) == r0["keys"]  # state_dict's keys and order, tied weights under both names
    for key, (shape, device, same) in r0["stream"].items():
        assert shape == r0["shapes"][key] and device == "cpu" and same, f"{name}: streamed {key} differs"
    if world > 1:
        assert results[1]["stream"] == {}  # non-main ranks take part and receive nothing
        if name in SHARDED:
            # One module gathered at a time: rank 1 keeps nothing, so its peak is the largest module's weights.
            assert results[1]["stream_peak"] < 0.5 * r0["model_bytes"], results[1]["stream_peak"]
