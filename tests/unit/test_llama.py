import pytest
import torch

from shardkit.models import ByteTextDataset, Llama, LlamaConfig
from shardkit.models.llama import KVCache


def test_forward_loss_and_logits_shapes():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, max_position=16))
    ids = torch.randint(0, 256, (3, 16))
    assert model(ids).shape == (3, 16, 256)
    loss = model(ids, ids)
    assert loss.ndim == 0 and abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5


def test_tied_head_shares_the_embedding_and_gqa_runs():
    model = Llama(LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2))
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model(torch.randint(0, 256, (1, 8)), torch.randint(0, 256, (1, 8))).isfinite()


def test_attention_is_causal():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2)).eval()
    ids = torch.randint(0, 256, (1, 10))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 256
    assert torch.allclose(model(ids)[:, :-1], model(changed)[:, :-1], atol=1e-6)


def test_generate_is_greedy_and_deterministic():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, max_position=32))
    prompt = torch.tensor([[1, 2, 3]])
    out = model.generate(prompt, max_new_tokens=5)
    assert out.shape == (1, 8) and torch.equal(out, model.generate(prompt, max_new_tokens=5))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
@pytest.mark.parametrize("kv_heads", [None, 2], ids=["mha", "gqa"])
def test_kv_cache_gives_the_full_recompute_logits_and_tokens(fused, kv_heads):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=kv_heads, max_position=24, fused=fused)
    model = Llama(config).eval()
    ids = torch.randint(0, 64, (3, 9))
    # the prompt in pieces (several tokens after cached ones need the offset causal mask), then one at a time
    cache = KVCache(config.num_layers)
    pieces = [model(ids[:, a:b], cache=cache) for a, b in ((0, 3), (3, 7), (7, 8), (8, 9))]
    assert cache.length == 9 and cache.keys[0].shape == (3, config.kv_heads, 9, config.head_dim)
    torch.testing.assert_close(torch.cat(pieces, dim=1), model(ids), rtol=1e-5, atol=1e-5)
    # greedy and sampled decoding, past max_position (the window slides without the cache from there)
    for kwargs in ({}, {"temperature": 0.8, "top_k": 5}):
        plain = model.generate(ids, 25, use_cache=False, generator=torch.Generator().manual_seed(1), **kwargs)
        cached = model.generate(ids, 25, generator=torch.Generator().manual_seed(1), **kwargs)
        assert plain.shape == (3, 34) and torch.equal(cached, plain), kwargs
    with pytest.raises(ValueError, match="sequence length 25 exceeds max_position=24"):  # 9 cached + 16 new
        model(torch.zeros(3, 16, dtype=torch.long), cache=cache)


def test_bad_config_names_the_numbers():
    with pytest.raises(ValueError, match=r"hidden_size\(30\).*num_heads\(4\)"):
        LlamaConfig(hidden_size=30, num_heads=4)


def test_byte_dataset_windows():
    ds = ByteTextDataset("abcdefghij" * 10, seq_len=8, stride=4)
    item = ds[1]
    assert bytes(item["input_ids"].tolist()) == b"efghijab" and len(ds) == 24


@pytest.mark.parametrize("fused", [True, False])
def test_module_apply_still_works(fused):
    # Regression: a submodule method named `apply` once hid nn.Module.apply, which DeepSpeed calls.
    model = Llama(LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, fused=fused))
    seen = []
    model.apply(lambda m: seen.append(type(m).__name__))
    assert "Attention" in seen and "Llama" in seen
