"""shardkit's Llama with an attention mask: a left-padded row's logits and greedy tokens equal its prompt run alone
(fp32 and fp64, with and without the KV cache, grouped-query attention), padding changes the result without the
mask, and malformed masks are refused by name."""

from __future__ import annotations

import pytest
import torch

from shardkit.models import Llama, LlamaConfig

WIDTH = 7


def _model(dtype, fused):
    torch.manual_seed(0)
    # a large init: the tiny model's tokens then depend on their context, so that padding would show
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      max_position=32, init_std=0.5, fused=fused)
    return Llama(cfg).to(dtype).eval()


def _padded():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 64, (n,), generator=g) for n in (5, 2, WIDTH)]
    ids = torch.zeros(len(prompts), WIDTH, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, WIDTH - len(p):], mask[i, WIDTH - len(p):] = p, 1
    return prompts, ids, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_left_padded_rows_equal_their_prompts_alone(dtype):
    model = _model(dtype, fused=False)
    prompts, ids, mask = _padded()
    logits = model(ids, attention_mask=mask)
    unmasked = model(ids)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for i, p in enumerate(prompts):
        alone = model(p[None])[0]
        torch.testing.assert_close(logits[i, WIDTH - len(p):], alone, rtol=0, atol=tol)
        if len(p) < WIDTH:  # without the mask the padding is attended: the real tokens' logits change
            assert (unmasked[i, WIDTH - len(p):] - alone).abs().max() > 1e-3
    for use_cache in (True, False):
        out = model.generate(ids, 8, attention_mask=mask, use_cache=use_cache, synced=False)
        assert torch.equal(out[:, :WIDTH], ids)
        for i, p in enumerate(prompts):
            alone = model.generate(p[None], 8, use_cache=use_cache, synced=False)
            assert torch.equal(out[i, WIDTH:], alone[0, len(p):]), (use_cache, i)
    # and the padding really changed the greedy tokens when it was attended
    assert not torch.equal(model.generate(ids, 8, synced=False), out)


def test_fused_ops_follow_the_padding():
    """The fused rotary embedding (per-row positions) with the mask, over the prompt and one cached step."""
    from shardkit.models.llama import KVCache

    model = _model(torch.float32, fused=True)
    prompts, ids, mask = _padded()
    cache = KVCache(len(model.layers))
    logits = model(ids, cache=cache, attention_mask=mask)
    step = model(ids[:, -1:], cache=cache)
    for i, p in enumerate(prompts):
        alone = model(torch.cat([p, p[-1:]])[None])[0]
        torch.testing.assert_close(logits[i, WIDTH - len(p):], alone[:-1], rtol=0, atol=1e-5)
        torch.testing.assert_close(step[i, 0], alone[-1], rtol=0, atol=1e-5)


def test_eos_list_and_cache_follow_the_padding():
    model = _model(torch.float64, False)
    prompts, ids, mask = _padded()
    free = model.generate(ids, 6, attention_mask=mask, synced=False)
    eos = [int(free[0, WIDTH + 1]), int(free[1, WIDTH + 2])]
    out = model.generate(ids, 6, attention_mask=mask, eos_token_id=eos, pad_token_id=0, synced=False)
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], 6, eos_token_id=eos, pad_token_id=0, synced=False)[0, len(p):]
        got = out[i, WIDTH:WIDTH + alone.numel()]
        assert torch.equal(got, alone), i
    assert out[0, WIDTH + 1] == eos[0] and bool((out[0, WIDTH + 2:] == 0).all())


def test_malformed_masks_are_refused():
    model = _model(torch.float32, False)
    _, ids, mask = _padded()
    with pytest.raises(ValueError, match="does not match input_ids"):
        model(ids, attention_mask=mask[:, 1:])
    with pytest.raises(ValueError, match="0/1 integers or booleans"):
        model(ids, attention_mask=mask.float())
    with pytest.raises(ValueError, match="other than 0 and 1"):
        model(ids, attention_mask=mask * 2)
    with pytest.raises(ValueError, match="do not mix"):
        model(ids, attention_mask=mask, position_ids=torch.arange(WIDTH)[None])
    # an empty batch (a rank joining the others' forwards, handed another request's kwargs) is not refused
    assert model.generate(ids[:0], 3, attention_mask=mask, synced=False).shape == (0, WIDTH)


def test_eos_ids_as_a_tensor_and_top_k_zero():
    """eos_token_id as a 0-d or 1-d tensor (a generation config may hold one) stops as the ints do; top_k=0 samples
    from the whole vocabulary, as Hugging Face's generate reads it."""
    model = _model(torch.float64, False)
    _, ids, mask = _padded()
    free = model.generate(ids, 6, attention_mask=mask, synced=False)
    eos = [int(free[0, WIDTH + 1]), int(free[1, WIDTH + 2])]
    want = model.generate(ids, 6, attention_mask=mask, eos_token_id=eos, pad_token_id=0, synced=False)
    got = model.generate(ids, 6, attention_mask=mask, eos_token_id=torch.tensor(eos), pad_token_id=0, synced=False)
    assert torch.equal(got, want)
    one = model.generate(ids, 6, attention_mask=mask, eos_token_id=eos[0], pad_token_id=0, synced=False)
    assert torch.equal(model.generate(ids, 6, attention_mask=mask, eos_token_id=torch.tensor(eos[0]), pad_token_id=0,
                                      synced=False), one)
    sampled = [model.generate(ids, 4, temperature=1.0, top_k=k, generator=torch.Generator().manual_seed(3),
                              attention_mask=mask, synced=False) for k in (0, None)]
    assert torch.equal(sampled[0], sampled[1])


def test_rows_that_fit_are_scored_when_the_padded_width_does_not():
    """A long prompt with a short completion beside a short prompt with a long one (an RL scoring batch: prompts
    left-padded, completions right-padded) is wider than max_position while each row fits: each row's logits are its
    own; a row that is itself too long is refused."""
    model = _model(torch.float64, False)  # max_position 32
    g = torch.Generator().manual_seed(2)
    rows = [(torch.randint(1, 64, (24,), generator=g), torch.randint(1, 64, (2,), generator=g)),
            (torch.randint(1, 64, (4,), generator=g), torch.randint(1, 64, (20,), generator=g))]
    width_p, width_c = 24, 20
    ids = torch.zeros(2, width_p + width_c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(rows):
        ids[i, width_p - len(p):width_p], mask[i, width_p - len(p):width_p] = p, 1
        ids[i, width_p:width_p + len(c)], mask[i, width_p:width_p + len(c)] = c, 1
    logits = model(ids, attention_mask=mask)
    for i, (p, c) in enumerate(rows):
        alone = model(torch.cat([p, c])[None])[0]
        got = logits[i][mask[i].bool()]
        torch.testing.assert_close(got, alone, rtol=0, atol=1e-10)
    too_long = torch.randint(1, 64, (2, 33), generator=g)
    with pytest.raises(ValueError, match="exceeds max_position=32"):
        model(too_long, attention_mask=torch.ones_like(too_long))
