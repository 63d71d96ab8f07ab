"""Packing that never crosses sequences: BFD bins, the collators, varlen attention, and per-sequence losses and
gradients of packed and padding-free batches equal to unpacked ones (fp64) for shardkit's Llama and an HF Llama."""

import pytest
import torch
import torch.nn.functional as F

from shardkit.models import Llama, LlamaConfig
from shardkit.nn.varlen import Segments, varlen_attention
from shardkit.sft import DataCollatorForLanguageModeling, bfd_bins, pack_bfd, pack_wrapped
from shardkit.sft.packing import IGNORE_INDEX

transformers = pytest.importorskip("transformers")


def test_bfd_puts_each_sequence_once_in_the_tightest_bin():
    lengths = [7, 5, 4, 3, 3, 2, 1]
    bins = bfd_bins(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(7))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    # longest first: 7 opens a bin (room 3), 5 opens one (room 5), 4 fits the room-5 bin best (room 1), the 3s go
    # to the room-3 bin (room 0) and a new bin, 2 next to the last 3, 1 into the room-1 bin
    assert bins == [[0, 3], [1, 2, 6], [4, 5]]
    assert bins == bfd_bins(lengths, 10)  # deterministic
    with pytest.raises(ValueError, match="truncate sequences"):
        bfd_bins([11], 10)


def test_bfd_fills_long_tailed_bins():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.distributions.LogNormal(4.0, 1.0).sample((2000,)).clamp(1, 512).long().tolist()
    bins = bfd_bins(lengths, 512)
    assert sum(lengths) / (512 * len(bins)) > 0.99
    del generator


def _example(ids, labels=None):
    return {"input_ids": ids, "labels": labels if labels is not None else list(ids)}


def test_packed_rows_restart_positions_and_ignore_each_first_label():
    rows = pack_bfd([_example([1, 2, 3]), _example([4, 5]), _example([]), _example([6, 7, 8, 9])], 6)
    assert [r["input_ids"] for r in rows] == [[6, 7, 8, 9, 4, 5], [1, 2, 3]]
    assert rows[0]["position_ids"] == [0, 1, 2, 3, 0, 1]
    assert rows[0]["labels"] == [IGNORE_INDEX, 7, 8, 9, IGNORE_INDEX, 5]
    wrapped = pack_wrapped([_example([1, 2, 3]), _example([4, 5]), _example([6, 7, 8, 9])], 4)
    assert [r["input_ids"] for r in wrapped] == [[1, 2, 3, 4], [5, 6, 7, 8], [9]]  # crosses sequences, by design
    assert wrapped[0]["position_ids"] == [0, 1, 2, 3]


def test_collators_pad_and_flatten():
    examples = [_example([1, 2, 3]), _example([4, 5], [IGNORE_INDEX, 5])]
    padded = DataCollatorForLanguageModeling(0, pad_to_multiple_of=4)(examples)
    assert padded["input_ids"].tolist() == [[1, 2, 3, 0], [4, 5, 0, 0]]
    assert padded["labels"].tolist() == [[1, 2, 3, -100], [-100, 5, -100, -100]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    flat = DataCollatorForLanguageModeling(0, padding_free=True, flash_attn_kwargs=True)(examples)
    assert flat["input_ids"].tolist() == [[1, 2, 3, 4, 5]] and flat["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert flat["labels"].tolist() == [[-100, 2, 3, -100, 5]]
    assert flat["cu_seq_lens_q"].tolist() == [0, 3, 5] and flat["max_length_q"] == 3
    packed_rows = pack_bfd([_example([1, 2, 3]), _example([4, 5]), _example([6])], 4)  # [[1,2,3,6],[4,5]]
    rows = DataCollatorForLanguageModeling(0)(packed_rows)
    assert "attention_mask" not in rows  # HF reads the sequences from position_ids only without a mask
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 2, 3]]  # padding continues the last sequence
    assert rows["labels"].tolist() == [[-100, 2, 3, -100], [-100, 5, -100, -100]]


def test_segments_from_position_ids():
    assert Segments.from_position_ids(torch.arange(6).expand(2, 6)) is None
    seg = Segments.from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]]))
    assert seg.lengths == (3, 2, 1, 2, 4) and seg.cu_seqlens.tolist() == [0, 3, 5, 6, 8, 12] and seg.max_length == 4


@pytest.mark.parametrize("lengths", [(5, 123, 1, 140, 17, 64, 130), (9,), (3, 3, 3)], ids=["ragged", "one", "even"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_varlen_attention_equals_attention_per_sequence(lengths, kv_heads):
    torch.manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(total, kv_heads, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(total, kv_heads, 8, dtype=torch.float64, requires_grad=True)
    out = varlen_attention(q, k, v, Segments.from_lengths(lengths))
    reference, start = [], 0
    for n in lengths:
        part = [t[start:start + n].transpose(0, 1)[None] for t in (q, k, v)]
        reference.append(F.scaled_dot_product_attention(*part, is_causal=True, enable_gqa=kv_heads != 4)[0]
                         .transpose(0, 1))
        start += n
    reference = torch.cat(reference)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.autograd.grad(reference.square().sum(), (q, k, v))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-11)


LENGTHS = [5, 17, 1, 40, 3, 33, 2, 26]


def _sequences(vocab: int):
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=generator) for n in LENGTHS]


def _llama(fused: bool):
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, max_position=64, fused=fused)).double()


def _hf_llama(attn: str):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).double()
    if attn == "varlen":
        from shardkit.sft.hf_attention import use_varlen_attention

        assert use_varlen_attention(model)
    return model


def _logits(model, batch):
    skip = ("labels", "attention_mask") if isinstance(model, Llama) else ("labels",)
    features = {k: v for k, v in batch.items() if k not in skip}
    out = model(**features)
    return out if isinstance(out, torch.Tensor) else out.logits


def _token_losses(logits, labels):
    """Per-token next-token CE, (rows, T-1), 0 where ignored."""
    lp = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=IGNORE_INDEX, reduction="none")
    return lp


def _locate(ids, positions, seqs):
    """(sequence index, row, start) of every sequence in a batch: at each position restart, the sequence whose
    tokens come next (a packed row's padding continues its last sequence, so a segment may run longer)."""
    found = []
    for row in range(ids.shape[0]):
        starts = [0] + [t for t in range(1, ids.shape[1]) if positions[row, t] != positions[row, t - 1] + 1]
        for a in starts:
            match = [i for i, s in enumerate(seqs) if torch.equal(ids[row, a:a + len(s)], s)]
            found.extend((i, row, a) for i in match[-1:])
    return found


MODELS = {"llama-fused": lambda: _llama(True), "llama-plain": lambda: _llama(False),
          "hf-varlen": lambda: _hf_llama("varlen"), "hf-sdpa": lambda: _hf_llama("sdpa")}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_and_padding_free_losses_and_gradients_equal_unpacked(name):
    model = MODELS[name]()
    seqs = _sequences(96)
    examples = [_example(s.tolist()) for s in seqs]
    # unpacked: one sequence per forward
    reference = []
    for s in seqs:
        batch = DataCollatorForLanguageModeling(0)([_example(s.tolist())])
        reference.append(_token_losses(_logits(model, batch), batch["labels"]).sum())
    batches = {
        "padded": DataCollatorForLanguageModeling(0)(examples),
        "packed": DataCollatorForLanguageModeling(0)(pack_bfd(examples, 64)),
        "padding_free": DataCollatorForLanguageModeling(0, padding_free=True)(examples),
        "packed_padding_free": DataCollatorForLanguageModeling(0, padding_free=True)(pack_bfd(examples, 64)),
    }
    gradients = {}
    for mode, batch in batches.items():
        model.zero_grad()
        losses = _token_losses(_logits(model, batch), batch["labels"])
        positions = batch.get("position_ids", torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"]))
        located = _locate(batch["input_ids"], positions, seqs)
        assert sorted(i for i, _, _ in located) == list(range(len(seqs))), mode
        sums = [None] * len(seqs)
        for i, row, a in located:  # tokens a..a+n-2 predict a+1..a+n-1
            sums[i] = losses[row, a:a + len(seqs[i]) - 1].sum()
        for got, want in zip(sums, reference):
            torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64), want, rtol=0, atol=1e-10)
        losses.sum().backward()
        gradients[mode] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    for mode, grads in gradients.items():  # the same tokens' summed loss: the same gradients as padded training
        for g, e in zip(grads, gradients["padded"]):
            torch.testing.assert_close(g, e, rtol=0, atol=1e-10, msg=lambda m: f"{mode}: {m}")


def test_hf_sdpa_with_a_cache_mixes_packed_sequences_and_varlen_does_not():
    """Why SFTTrainer sets use_cache=False and switches HF models to shardkit_varlen: transformers 5.23 builds its
    block-diagonal mask from position_ids only without a KV cache, and a training forward makes one by default."""
    seqs = _sequences(96)[:3]
    ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    alone = _hf_llama("sdpa")(seqs[1][None]).logits[0]
    for attn, crosses in (("sdpa", True), ("varlen", False)):
        model = _hf_llama(attn)
        model.config.use_cache = True
        packed = model(input_ids=ids, position_ids=positions).logits[0, len(seqs[0]):len(seqs[0]) + len(seqs[1])]
        assert (not torch.allclose(packed, alone, atol=1e-8)) == crosses, attn


def test_llama_refuses_positions_past_its_table():
    model = _llama(False)
    with pytest.raises(ValueError, match="max_position=64"):
        model(torch.zeros(1, 3, dtype=torch.long), position_ids=torch.tensor([[0, 1, 64]]))
    with pytest.raises(ValueError, match="do not match input_ids"):
        model(torch.zeros(1, 3, dtype=torch.long), position_ids=torch.tensor([[0, 1]]))
