"""save_pretrained under sharded strategies on 2 ranks: the directory from_pretrained loads equals the model."""

import json
from pathlib import Path

import pytest
import torch
from harness import run_distributed

from shardkit.checkpoint.hf import save_pretrained


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def _export(strategy, out):
    from shardkit import Runner
    from shardkit.strategies import strategy_from_name

    runner = Runner(strategy_from_name(strategy), seed=0)
    model = _tiny_llama()
    model, _ = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    sharded = save_pretrained(runner, out, model, max_shard_size="20KB")
    save_pretrained(runner, out + "_bf16", model, dtype=torch.bfloat16)
    runner.teardown()
    return [str(p) for p in sharded]


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_save_pretrained_loads_with_from_pretrained(tmp_path, strategy):
    from transformers import LlamaForCausalLM

    out = str(tmp_path / "export")
    written = run_distributed(_export, world_size=2, args=(strategy, out), env={"DS_ACCELERATOR": "cpu"})
    assert written[1] == [] and written[0][-1].endswith("model.safetensors.index.json") and len(written[0]) > 3
    index = json.loads(Path(written[0][-1]).read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied: written once, as save_pretrained does
    ref = _tiny_llama().eval()
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    for suffix, dtype in (("", torch.float32), ("_bf16", torch.bfloat16)):
        loaded = LlamaForCausalLM.from_pretrained(out + suffix, torch_dtype=dtype).eval()
        got, want = loaded.state_dict(), ref.state_dict()
        assert set(got) == set(want)
        for k, v in want.items():
            assert got[k].dtype == dtype and torch.equal(got[k], v.to(dtype)), k
    loaded = LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref(ids).logits)


def _load(strategy, src, ids):
    import shardkit.checkpoint.hf as hf
    from shardkit import Runner
    from shardkit.checkpoint.hf import load_pretrained
    from shardkit.strategies import strategy_from_name

    runner = Runner(strategy_from_name(strategy), seed=0)
    torch.manual_seed(123)  # other weights than the files hold: the load must replace them
    with runner.init_module():
        model = _tiny_llama_unseeded()
    # lr 0: the step below must leave the loaded weights as they are (DeepSpeed's fp32 masters refreshed)
    model, optimizer = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
    peak = [0]
    gather = runner.gathered_parameters

    def counting(params, modifier_rank=None):  # bytes of whole tensors this rank holds at once while loading
        ctx = gather(params, modifier_rank)

        class _Count:
            def __enter__(self):
                whole = ctx.__enter__()
                peak[0] = max(peak[0], sum(t.numel() * t.element_size() for t in whole))
                return whole

            def __exit__(self, *exc):
                return ctx.__exit__(*exc)

        return _Count()

    runner.gathered_parameters = counting
    read = [0]
    hf_get, hf_flat = hf.HFWeights.get, hf.HFWeights.read_flat

    def get(self, key):
        t = hf_get(self, key)
        read[0] += t.numel() * t.element_size()
        return t

    def read_flat(self, key, start, count):
        t = hf_flat(self, key, start, count)
        read[0] += t.numel() * t.element_size()
        return t

    hf.HFWeights.get, hf.HFWeights.read_flat = get, read_flat
    assert load_pretrained(runner, model, src) == []
    runner.gathered_parameters = gather
    runner.backward(model(ids, labels=ids).loss)
    runner.step()
    with torch.no_grad():
        logits = model(ids).logits
    runner.teardown()
    return logits, peak[0], read[0]


def _tiny_llama_unseeded():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_load_pretrained_into_a_sharded_model(tmp_path, strategy):
    ref = _tiny_llama().eval()
    ref.save_pretrained(tmp_path / "hf", max_shard_size="20KB")  # sharded with an index
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    results = run_distributed(_load, world_size=2, args=(strategy, str(tmp_path / "hf"), ids),
                              env={"DS_ACCELERATOR": "cpu"})
    with torch.no_grad():
        want = ref(ids).logits
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    for rank, (logits, peak, read) in enumerate(results):
        assert torch.allclose(logits, want, rtol=1e-5, atol=1e-6)
        # whole tensors held at once: the largest module (the embedding, 61 x 32 fp32) at most, never the model
        assert peak <= 61 * 32 * 4 < total / 4
        if strategy == "zero3":  # each rank reads its own half (+ the small persistent norms), not the model
            assert 0.4 * total < read < 0.65 * total, (rank, read, total)
        else:  # rank 0 reads and the shards are scattered
            assert read == (total if rank == 0 else 0), (rank, read, total)
