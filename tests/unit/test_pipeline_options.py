"""Pipeline options that need no process group: layer_split and dp from ``--strategy-opt``, the micro-batch count
from the accumulation window, and the models a pipeline can (and cannot) split."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shardkit.strategies._pipeline_models import UnsplittableModelError, model_layout
from shardkit.strategies._pipeline_stages import PipelineRunner
from shardkit.strategies.pipeline import PipelineSettings
from shardkit.strategies.registry import STRATEGIES
from shardkit.utils.parsing import parse_int_list


def test_layer_split_and_dp_from_strategy_opt():
    pp = STRATEGIES.build_from_cli("pp", ["layer_split=1,3", "pp_size=2", "dp=fsdp"])
    assert (pp.settings.layer_split, pp.settings.dp) == ((1, 3), "fsdp")
    assert STRATEGIES.build_from_cli("pp", ["layer_split=[2, 2]"]).settings.layer_split == (2, 2)
    assert parse_int_list("(2, 6)", "x", minimum=1) == (2, 6)


@pytest.mark.parametrize("options, message", [
    (["layer_split=1,x"], r"layer_split='1,x': 'x' is not a whole number; give comma-separated whole numbers"),
    (["layer_split=0,4"], r"layer_split='0,4': 0 is out of range; give comma-separated whole numbers >= 1"),
    (["layer_split=,"], r"layer_split=',' is empty"),
    (["layer_split=1,2,1", "pp_size=2"], r"gives 3 stages; pp_size\(2\) x stages_per_rank\(1\) = 2 are run"),
    (["layer_split=1,1,1", "pp_size=2", "schedule=interleaved_1f1b"], r"pp_size\(2\) x stages_per_rank\(2\) = 4"),
    (["dp=fdsp"], r"dp='fdsp' is not one of \('ddp', 'fsdp'\); did you mean 'fsdp'"),
    (["schedule=zbv", "stages_per_rank=3"], r"stages_per_rank=3: schedule='zbv' runs exactly 2 stages per rank"),
    (["schedule=zvb"], r"schedule='zvb' is not one of .*did you mean 'zbv'"),
])
def test_bad_pipeline_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        STRATEGIES.build_from_cli("pp", options)


def _runner(microbatches: int | None, pp: int = 2) -> SimpleNamespace:
    return SimpleNamespace(settings=PipelineSettings(pp_size=pp, microbatches=microbatches), pp=pp)


def test_microbatches_come_from_the_window_unless_given():
    count = PipelineRunner.microbatches
    assert count(_runner(None), 8, 1) == 2  # no accumulation: pp_size
    assert count(_runner(None), 8, 4) == 4  # the accumulation window
    assert count(_runner(8), 8, 4) == 8  # the user's value wins
    with pytest.raises(ValueError, match=r"batch size\(6\) % microbatches\(4\) != 0; .*from the accumulation window "
                                         r"\(4 micro-batches\).*set Pipeline\(microbatches=...\)"):
        count(_runner(None), 6, 4)
    with pytest.raises(ValueError, match=r"batch size\(6\) % microbatches\(4\) != 0; use a batch size that is a "
                                         r"multiple of 4"):
        count(_runner(4), 6, 1)
    def dualpipe(microbatches: int | None) -> SimpleNamespace:
        return SimpleNamespace(settings=PipelineSettings(pp_size=2, schedule="dualpipev", microbatches=microbatches),
                               pp=2)

    assert (count(dualpipe(None), 8, 1), count(dualpipe(None), 8, 2), count(dualpipe(None), 16, 8)) == (4, 4, 8)
    with pytest.raises(ValueError, match=r"schedule='dualpipev' needs at least one micro-batch per stage "
                                         r"\(pp_size\(2\) x 2 = 4\), got microbatches=2: set "
                                         r"Pipeline\(microbatches=...\)"):
        count(dualpipe(2), 8, 1)


def _hf_config(name: str, **kw):
    import transformers

    return getattr(transformers, name)(vocab_size=32, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                       **kw)


def test_hf_llama_splits_and_other_architectures_are_named():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM, LlamaModel

    llama = LlamaForCausalLM(_hf_config("LlamaConfig", num_hidden_layers=2))
    layout = model_layout(llama)
    assert layout.hf and layout.body is llama.model
    with pytest.raises(UnsplittableModelError, match=r"GPT2LMHeadModel \(model_type 'gpt2'\): it splits HF decoders "
                                                     r"of model_type 'llama'.*with FSDP or TensorParallel instead"):
        model_layout(GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
                                                eos_token_id=0)))
    with pytest.raises(UnsplittableModelError, match=r"LlamaModel has no \['model', 'lm_head'\]: pass the "
                                                     r"\.\.\.ForCausalLM model"):
        model_layout(LlamaModel(_hf_config("LlamaConfig", num_hidden_layers=1)))
    with pytest.raises(UnsplittableModelError, match=r"shardkit Llama-style models.*Linear has no"):
        model_layout(torch.nn.Linear(2, 2))


def test_a_pipeline_forward_refuses_extra_tensor_arguments_by_name():
    """A keyword the schedule cannot carry (a tensor, so not compared with `in`) is named in the refusal."""
    from shardkit.strategies._pipeline_stages import _pipeline_forward

    ids = torch.zeros(2, 4, dtype=torch.long)
    for extra in ({"position_ids": torch.arange(4).expand(2, 4)}, {"position_ids": torch.tensor(0)},
                  {"output_hidden_states": True}):
        with pytest.raises(NotImplementedError, match=f"got \\['{next(iter(extra))}'\\]"):
            _pipeline_forward(SimpleNamespace(_shardkit_pipeline=None), ids, labels=ids, **extra)


def test_stage_placement_is_looped_or_v_shaped():
    looped = PipelineSettings(pp_size=4, schedule="interleaved_1f1b")
    v = PipelineSettings(pp_size=4, schedule="zbv")
    assert [looped.stage_indices(r) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [v.stage_indices(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert PipelineSettings(pp_size=2, schedule="1f1b").stage_indices(1) == [1]
