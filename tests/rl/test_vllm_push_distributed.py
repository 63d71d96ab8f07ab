"""use_vllm=True's weight push on 2 real processes (gloo on CPU) under ZeRO-3 and then FSDP2, against the STAND-IN
for vLLM of test_vllm_engine.py (not vLLM itself, which cannot be installed here): each rank's engine receives every
parameter of shardkit's partitioned Llama whole and equal to the unsharded weights, under Hugging Face's names, and
its greedy tokens for that rank's own prompts equal the unsharded model's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from harness import run_distributed  # noqa: E402

pytest.importorskip("deepspeed")
STRATEGIES = ("zero3", "fsdp")


def _worker() -> dict:
    import types

    import torch

    from shardkit import Runner
    from shardkit.models import Llama, LlamaConfig
    from shardkit.rl.vllm_engine import ColocatedVLLM
    from shardkit.strategies import strategy_from_name
    from tests.rl.test_vllm_engine import _stand_in_vllm

    vllm = _stand_in_vllm()
    vllm.greedy = True
    sys.modules["vllm"] = vllm
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, max_position=32,
                      fused=False, init_std=0.5)
    torch.manual_seed(0)
    base = Llama(cfg).eval()
    reference = {k: v.clone() for k, v in base.state_dict().items()}
    args = types.SimpleNamespace(vllm_tensor_parallel_size=1, vllm_gpu_memory_utilization=0.3,
                                 vllm_max_model_length=None, seed=0, vllm_importance_sampling_correction=False,
                                 temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
                                 generation_kwargs=None)
    out = {}
    for name in STRATEGIES:
        runner = Runner(strategy=strategy_from_name(name), seed=0)
        model = Llama(cfg)
        model.load_state_dict(reference)
        model = runner.setup(model)
        engine = ColocatedVLLM(runner, model, args, "test")
        pushed = engine.push_weights(version=0)
        loaded = engine.llm.model.loaded
        rank = runner.rank
        prompts = [[1 + rank, 5, 9], [7, 3]] if rank == 0 else [[11, 2, 30, 4]]
        completions = engine.generate(prompts, max_new_tokens=4, eos_token_ids=[63], version=0)
        want = [base.generate(torch.tensor([p]), 4, eos_token_id=63, synced=False)[0, len(p):].tolist()
                for p in prompts]
        differ = [n for n, t in loaded.items() if not torch.equal(t, reference[n.removeprefix("model.")])]
        out[name] = {"pushed": pushed, "names": sorted(loaded), "differ": differ,
                     "tokens": completions.ids, "want": want, "pushes_after": engine.llm.model.calls}
    return out


def test_each_rank_engine_gets_whole_weights_and_generates_the_unsharded_tokens():
    results = run_distributed(_worker, world_size=2, timeout=600)
    for rank, result in enumerate(results):
        for name in STRATEGIES:
            r = result[name]
            # embed_tokens (tied to lm_head, pushed once), 2 x 9 layer tensors, the final norm
            assert r["pushed"] == len(r["names"]) == 20 and r["pushes_after"] == 20, (rank, name, r)
            assert not r["differ"], (rank, name, r["differ"])
            for got, want in zip(r["tokens"], r["want"]):
                assert got == want[:len(got)] and (len(got) == 4 or got[-1] == 63), (rank, name, got, want)
