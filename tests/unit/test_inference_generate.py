"""Generation on one process: Llama.generate's EOS and padding, runner.generate equal to the model's own generate
for shardkit's Llama and a tiny Hugging Face Llama, and a model without a usable generate refused by name."""

from __future__ import annotations

import pytest
import torch

from shardkit import Runner, SingleDevice
from shardkit.inference import generate, is_hf_model, needs_sync, params_partitioned
from shardkit.models.llama import Llama, LlamaConfig

TINY = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, max_position=32)


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(TINY).eval()


def test_greedy_decoding_appends_the_argmax_of_the_full_forward():
    model = _model()
    ids = torch.tensor([[5, 9, 13]])
    out = model.generate(ids, max_new_tokens=4)
    tokens = ids
    for _ in range(4):
        tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, tokens)
    assert model.training is False


def test_eos_finishes_a_row_and_pads_it_and_all_finished_rows_stop_decoding():
    model = _model()
    ids = torch.tensor([[5, 9, 13], [7, 1, 2]])
    plain = model.generate(ids, max_new_tokens=6)
    eos = int(plain[0, 4])  # row 0's second new token
    out = model.generate(ids, max_new_tokens=6, eos_token_id=eos, pad_token_id=63)
    first = int((plain[0, 3:] == eos).nonzero()[0])  # it may come earlier, as the first new token
    assert torch.equal(out[0, : 3 + first + 1], plain[0, : 3 + first + 1])
    assert (out[0, 3 + first + 1 :] == 63).all()
    row1_eos = (plain[1, 3:] == eos).nonzero()
    if not len(row1_eos):  # row 1 never produces it: decodes all 6 like before
        assert torch.equal(out[1], plain[1])
    alone = model.generate(ids[:1], max_new_tokens=6, eos_token_id=eos)
    assert alone.shape[1] == 3 + first + 1  # the only row finished: decoding stopped there


def test_empty_batch_and_zero_new_tokens():
    model = _model()
    assert model.generate(torch.zeros((0, 3), dtype=torch.long), max_new_tokens=3).shape == (0, 3)
    ids = torch.tensor([[1, 2]])
    assert torch.equal(model.generate(ids, max_new_tokens=0), ids)


def test_runner_generate_equals_the_models_own_on_one_device():
    runner = Runner(strategy=SingleDevice("cpu"), seed=0)
    model = runner.setup(_model())
    ids = torch.tensor([[3, 4, 5]])
    assert torch.equal(runner.generate(model, ids, max_new_tokens=5), model.generate(ids, max_new_tokens=5))
    assert not params_partitioned(model) and not needs_sync(model)


def test_asking_about_partitioned_parameters_imports_a_handler_only_once_its_engine_is(monkeypatch):
    """Every DDP generate call asks whether a parameter is partitioned; before any engine that partitions is imported
    the answer is no, without importing a strategy's modules (ZeRO's cost a first rollout tens of milliseconds)."""
    import sys
    import types

    from shardkit.utils import partitioned

    class Owner:
        def owns(self, param):
            return hasattr(param, "fake_engine_partition")

        def is_partitioned(self, param):
            return True

    handler_module = types.ModuleType("fake_engine_handler")
    handler_module.HANDLER = Owner()
    monkeypatch.setitem(sys.modules, "fake_engine_handler", handler_module)
    imported = []
    real_import = partitioned.importlib.import_module
    monkeypatch.setattr(partitioned.importlib, "import_module", lambda name: imported.append(name) or real_import(name))
    monkeypatch.setattr(partitioned, "_HANDLERS", ["fake_engine=fake_engine_handler:HANDLER"])
    weight = torch.nn.Parameter(torch.zeros(2))
    weight.fake_engine_partition = 0
    model = torch.nn.Linear(2, 2)
    model.extra = weight
    assert partitioned.handlers() == [] and not params_partitioned(model) and imported == []
    monkeypatch.setitem(sys.modules, "fake_engine", types.ModuleType("fake_engine"))  # the engine is imported now
    assert partitioned.handlers() == [handler_module.HANDLER] and params_partitioned(model)
    assert imported == ["fake_engine_handler"]


def test_runner_generate_drives_hugging_face_generate():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, max_position_embeddings=64, pad_token_id=0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    assert is_hf_model(hf) and not is_hf_model(_model())
    runner = Runner(strategy=SingleDevice("cpu"), seed=0)
    model = runner.setup(hf)
    ids = torch.tensor([[3, 4, 5]])
    want = hf.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(runner.generate(model, ids, max_new_tokens=4, do_sample=False), want)


def test_a_model_without_a_synced_generate_is_refused_by_name():
    class NoGen(torch.nn.Linear):
        def generate(self, input_ids, max_new_tokens):
            return input_ids

    with pytest.raises(TypeError, match="NoGen.generate has no `synced` argument"):
        generate(NoGen(2, 2), torch.zeros((1, 1), dtype=torch.long), max_new_tokens=1)
