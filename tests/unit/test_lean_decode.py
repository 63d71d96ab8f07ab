"""The lean decoding loop for Hugging Face causal LMs: its tokens equal ``generate``'s (greedy and seeded sampling,
left padding, EOS mid-batch, the model's generation_config defaults), its logits processing equals Hugging Face's
LogitsProcessorList step by step, and every setting it does not reproduce runs ``generate`` instead."""

from __future__ import annotations

import importlib
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardkit.inference import decode  # noqa: E402
from shardkit.inference.decode import lean_generate  # noqa: E402
from shardkit.inference.generate import generate  # noqa: E402

VOCAB = 97
# the package re-exports the function under the module's name
generate_module = importlib.import_module("shardkit.inference.generate")


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def _qwen2():
    torch.manual_seed(1)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def models():
    return {"llama": _llama(), "qwen2": _qwen2()}


def _prompts(padded: bool):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (4, 7), generator=g)
    mask = torch.ones_like(ids)
    if padded:  # left padding of different lengths
        for row, pad in enumerate((0, 2, 4, 1)):
            ids[row, :pad] = 0
            mask[row, :pad] = 0
    return ids, mask


_eos_cache: dict = {}


def _eos_mid_batch(model, ids, mask):
    """An EOS token that one row (not all) emits within the first steps of greedy decoding."""
    key = (id(model), bool((mask == 0).any()))
    if key not in _eos_cache:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0, do_sample=False)
        _eos_cache[key] = int(out[1, ids.shape[1] + 1])
    return _eos_cache[key]


def _both(model, ids, mask, seed, **kwargs):
    torch.manual_seed(seed)
    ours = lean_generate(model, ids, {"attention_mask": mask, **kwargs})
    torch.manual_seed(seed)
    theirs = model.generate(ids, attention_mask=mask, **kwargs)
    return ours, theirs


SETTINGS = [
    {"do_sample": False},
    {"do_sample": False, "repetition_penalty": 1.3},
    {"do_sample": True},  # the global default top_k=50 applies
    {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 0.9},
    {"do_sample": True, "temperature": 1.3, "top_k": 20, "top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.2},
    {"do_sample": True, "temperature": 0.9, "top_k": None, "top_p": 1.0, "min_p": 0.1},
    {"do_sample": True, "suppress_tokens": [4, 9], "repetition_penalty": 1.1},  # the GRPO benchmark's EOS suppression
]


# every setting on the left-padded Llama; a few on Qwen2 and on prompts without padding (no mask reaches the model)
CASES = ([("llama", True, i) for i in range(len(SETTINGS))] + [("qwen2", True, i) for i in (0, 2, 4, 6)]
         + [("llama", False, i) for i in (0, 4)] + [("qwen2", False, 3)])


@pytest.mark.parametrize(("arch", "padded", "which"), CASES, ids=[f"{a}-{'left' if p else 'unpadded'}-{i}"
                                                                 for a, p, i in CASES])
def test_tokens_equal_generate(models, arch, padded, which):
    model, settings = models[arch], SETTINGS[which]
    ids, mask = _prompts(padded)
    eos = _eos_mid_batch(model, ids, mask)
    ours, theirs = _both(model, ids, mask, 0, max_new_tokens=7, pad_token_id=0, eos_token_id=[eos, 2], **settings)
    assert ours is not None, "the loop fell back on settings it supports"
    assert torch.equal(ours, theirs), (ours, theirs)
    ours, theirs = _both(model, ids, mask, 5, max_new_tokens=5, pad_token_id=0, **settings)  # no EOS at all
    assert torch.equal(ours, theirs)


def _forward_inputs(model, run):
    seen = []

    def record(module, args, kwargs):
        seen.append({k: v.clone() if isinstance(v, torch.Tensor) else type(v) if k == "past_key_values" else v
                     for k, v in kwargs.items()} | {"grad enabled": torch.is_grad_enabled()})

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return seen


@pytest.mark.parametrize("padded", [False, True])
def test_forwards_get_generate_inputs(models, padded):
    """Every argument of every forward is generate's: token ids, position ids, the 2-D mask (none without padding),
    the cache's type, logits_to_keep, no autograd (a rotary model's tokens alone would not show a position shift)."""
    model = models["llama"]
    ids, mask = _prompts(padded)
    kwargs = {"attention_mask": mask, "max_new_tokens": 4, "pad_token_id": 0, "do_sample": False}
    ours = _forward_inputs(model, lambda: lean_generate(model, ids, kwargs))
    theirs = _forward_inputs(model, lambda: model.generate(ids, **kwargs))
    assert len(ours) == len(theirs) == 4
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys()
        for key in a:
            assert (torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]), key


def test_eos_mid_batch_pads_finished_rows(models):
    model = models["llama"]
    ids, mask = _prompts(True)
    eos = _eos_mid_batch(model, ids, mask)
    out = lean_generate(model, ids, {"attention_mask": mask, "max_new_tokens": 8, "pad_token_id": 0,
                                     "eos_token_id": eos, "do_sample": False})
    row = out[1, ids.shape[1]:].tolist()
    assert row[1] == eos and set(row[2:]) <= {0}
    assert out.shape[1] > ids.shape[1] + 2  # another row went on


def test_model_generation_config_defaults_merge_as_generate(models):
    model = models["qwen2"]
    ids, mask = _prompts(True)
    saved = model.generation_config
    model.generation_config = transformers.GenerationConfig(do_sample=True, temperature=0.6, top_k=7, top_p=0.85)
    try:
        ours, theirs = _both(model, ids, mask, 4, max_new_tokens=8, pad_token_id=0)
    finally:
        model.generation_config = saved
    assert ours is not None and torch.equal(ours, theirs)


def _hf_processors(model, settings, mask):
    config, _ = model._prepare_generation_config(None, **settings)
    return model._get_logits_processor(generation_config=config, input_ids_seq_length=mask.shape[1],
                                       device=mask.device, model_kwargs={"attention_mask": mask})


@pytest.mark.parametrize("settings", SETTINGS[1:], ids=[str(i) for i in range(1, len(SETTINGS))])
def test_processed_logits_equal_hf_processors(models, settings):
    model = models["llama"]
    ids, mask = _prompts(True)
    theirs = _hf_processors(model, settings, mask)
    config, _ = model._prepare_generation_config(None, **settings)
    ours = decode._Processing(config, mask)
    g = torch.Generator().manual_seed(7)
    for step in range(4):
        scores = torch.randn(ids.shape[0], VOCAB, generator=g) * 3
        expected = theirs(ids, scores.clone())
        assert torch.equal(ours(ids, scores.clone()), expected)
        ids = torch.cat([ids, torch.randint(0, VOCAB, (ids.shape[0], 1), generator=g)], dim=-1)


FALLBACKS = [
    {"num_beams": 2},
    {"min_new_tokens": 2},
    {"no_repeat_ngram_size": 2},
    {"return_dict_in_generate": True},
    {"bad_words_ids": [[5]]},
    {"typical_p": 0.5, "do_sample": True},
    {"logits_processor": transformers.LogitsProcessorList()},
    {"output_scores": True, "return_dict_in_generate": True},
    {"use_cache": False},
]


@pytest.mark.parametrize("extra", FALLBACKS, ids=[next(iter(f)) for f in FALLBACKS])
def test_unsupported_settings_fall_back_to_generate(models, extra):
    model = models["llama"]
    ids, mask = _prompts(True)
    kwargs = {"attention_mask": mask, "max_new_tokens": 3, "pad_token_id": 0, **extra}
    assert lean_generate(model, ids, kwargs) is None
    with mock.patch.object(type(model), "generate", autospec=True, return_value="hf") as hf:
        assert generate(model, ids, **{k: v for k, v in kwargs.items() if k != "synced_gpus"}) == "hf"
    hf.assert_called_once()


@pytest.mark.parametrize("others", [0, 3, 12])
def test_lock_step_joins_forwards_as_generate(models, others):
    """In lock step (synced_gpus) the loop makes generate's forwards and all-reduces in generate's order: a rank that
    is done keeps joining forwards while another rank (simulated: its flag in the first ``others`` all-reduces)
    still decodes, so ranks running either meet at the same collectives."""
    model = models["llama"]
    ids, mask = _prompts(True)
    kwargs = {"attention_mask": mask, "max_new_tokens": 4, "pad_token_id": 0, "do_sample": True, "top_k": 20}

    def run(call):
        reduces = []

        def all_reduce(flag, op=None, group=None, async_op=False):
            reduces.append(float(flag))
            if len(reduces) <= others:
                flag.add_(1.0)

        torch.manual_seed(9)
        with mock.patch("torch.distributed.all_reduce", all_reduce):
            out = {}
            forwards = _forward_inputs(model, lambda: out.setdefault("ids", call()))
        return out["ids"], forwards, reduces

    ours = run(lambda: lean_generate(model, ids, {**kwargs, "synced_gpus": True}))
    theirs = run(lambda: model.generate(ids, synced_gpus=True, **kwargs))
    assert torch.equal(ours[0], theirs[0]) and ours[2] == theirs[2]
    assert len(ours[1]) == len(theirs[1]) == max(4, others)
    for a, b in zip(ours[1], theirs[1]):
        assert a.keys() == b.keys()
        for key in a:
            assert (torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]), key
    with mock.patch.object(type(model), "generate", autospec=True) as hf:  # Runner.generate's lock step takes it
        with mock.patch("torch.distributed.all_reduce", lambda flag, **kw: None):
            generate_module._call(model, ids, kwargs, sync=True)
    hf.assert_not_called()


def test_model_features_fall_back_to_generate(models):
    model = models["llama"]
    ids, mask = _prompts(True)
    kwargs = {"attention_mask": mask, "max_new_tokens": 3, "pad_token_id": 0}
    assert lean_generate(model, ids, {k: v for k, v in kwargs.items() if k != "attention_mask"}) is None
    assert lean_generate(model, ids, {**kwargs, "max_new_tokens": None}) is None
    saved = model.generation_config
    model.generation_config = transformers.GenerationConfig(no_repeat_ngram_size=3)
    try:
        assert lean_generate(model, ids, kwargs) is None
    finally:
        model.generation_config = saved

    class OwnGenerate(transformers.LlamaForCausalLM):
        def prepare_inputs_for_generation(self, *args, **kw):
            return super().prepare_inputs_for_generation(*args, **kw)

    own = OwnGenerate(model.config).eval()
    assert lean_generate(own, ids, kwargs) is None
    # what generate warns about runs generate: right padding, past the model's positions, a negative EOS id
    assert lean_generate(model, ids, {**kwargs, "attention_mask": mask.flip(1)}) is None
    assert lean_generate(model, ids, {**kwargs, "max_new_tokens": 64}) is None
    assert lean_generate(model, ids, {**kwargs, "eos_token_id": [-1]}) is None
    assert lean_generate(model, ids, kwargs) is not None


def test_runner_path_decodes_lean_and_equal(models):
    model = models["llama"]
    ids, mask = _prompts(True)
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "pad_token_id": 0, "do_sample": True, "top_k": 10}
    torch.manual_seed(2)
    expected = model.generate(ids, **kwargs)
    torch.manual_seed(2)
    with mock.patch.object(type(model), "generate", autospec=True) as hf:
        out = generate(model, ids, **kwargs)
    hf.assert_not_called()
    assert torch.equal(out, expected)


def test_grpo_rollouts_sample_lean_and_as_generate(models):
    """The GRPO trainer's sampling settings (TRL's defaults, EOS suppressed as the benchmark does) take the lean loop
    through Runner.generate and sample generate's completions."""
    from shardkit import Runner, SingleDevice
    from shardkit.rl.rollout import generate_completions

    runner = Runner(strategy=SingleDevice("cpu"), seed=0)
    model = runner.setup(_qwen2())
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [8, 9]]
    sampling = {"do_sample": True, "temperature": 0.9, "top_p": 1.0, "top_k": 0, "min_p": None,
                "repetition_penalty": 1.0, "suppress_tokens": [3]}

    def sample():
        torch.manual_seed(11)
        return generate_completions(runner, model, prompts, pad_token_id=0, eos_token_ids=[2], max_new_tokens=6,
                                    sampling=sampling).ids

    with mock.patch.object(decode, "_decode", wraps=decode._decode) as lean:
        ours = sample()
    assert lean.call_count == 1
    with mock.patch.object(generate_module, "lean_generate", return_value=None):  # generate's own sampling
        theirs = sample()
    assert ours == theirs
