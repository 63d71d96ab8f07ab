"""The Trainer's model preparation on one process: use_fused_kernels / use_liger_kernel patch a Hugging Face Llama
before setup (same losses as the unpatched model), liger_kernel_config maps or refuses each switch by name,
torch_compile compiles in place (same losses, same state-dict keys; NEFTune's hook reaches the compiled graph),
and bad backends / modes are refused with the fix."""

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from shardkit.models import Llama, LlamaConfig
from shardkit.trainer import Trainer, TrainingArguments
from shardkit.trainer.model_prep import is_compiled

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 16


class Tokens(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def _hf_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config)


def _shardkit_llama(fused=True):
    torch.manual_seed(1)
    return Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                             max_position=SEQ, fused=fused))


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, learning_rate=1e-2, max_steps=3,
                logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, optim="adamw_torch")
    return TrainingArguments(**{**base, **kw})


def _train(model, args):
    trainer = Trainer(model, args, train_dataset=Tokens())
    trainer.train()
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_fused_kernels_patch_before_setup_and_keep_the_losses(tmp_path):
    _, plain = _train(_hf_llama(), _args(tmp_path))
    for flag in ("use_fused_kernels", "use_liger_kernel"):
        trainer, fused = _train(_hf_llama(), _args(tmp_path, **{flag: True}))
        model = trainer.runner.unwrap_model(trainer.model)
        assert model.fused_kernels_report == {"model_type": "llama", "rms_norm": 5, "rope": 2, "swiglu": 2,
                                              "geglu": 0, "cross_entropy": True, "skipped": {}}
        assert "forward" in model.model.norm.__dict__ and "forward" in model.model.layers[0].mlp.__dict__
        assert fused == pytest.approx(plain, rel=1e-5)
        assert fused[-1] < fused[0]
    trainer, partial = _train(_hf_llama(), _args(tmp_path, use_liger_kernel=True,
                                                 liger_kernel_config={"rope": False, "geglu": False,
                                                                      "fused_linear_cross_entropy": False}))
    report = trainer.model.fused_kernels_report
    assert report["rope"] == 0 and report["cross_entropy"] is False and report["swiglu"] == 2
    assert partial == pytest.approx(plain, rel=1e-5)


@pytest.mark.parametrize("config, match", [
    ({"layer_norm": True}, "no layer_norm kernel"),
    ({"cross_entropy": True}, "fused_linear_cross_entropy=True"),
    ({"rms_nrom": True}, "rms_norm"),
    ({"rope": "yes"}, "true or false"),
])
def test_liger_kernel_config_refuses_what_shardkit_cannot_do(tmp_path, config, match):
    with pytest.raises(ValueError, match=match):
        _args(tmp_path, use_liger_kernel=True, liger_kernel_config=config)


def test_fused_kernels_refuse_models_they_cannot_patch(tmp_path):
    with pytest.raises(ValueError, match="use_fused_kernels=True"):
        _args(tmp_path, liger_kernel_config={"rope": True})
    with pytest.raises(ValueError, match=r"LlamaConfig\(fused=True\)"):
        Trainer(_shardkit_llama(fused=False), _args(tmp_path, use_fused_kernels=True))
    Trainer(_shardkit_llama(), _args(tmp_path, use_fused_kernels=True))  # built fused: nothing to patch
    with pytest.raises(ValueError, match="use_fused_kernels=True.*not supported"):
        Trainer(nn.Linear(2, 2), _args(tmp_path, use_fused_kernels=True))


def test_torch_compile_in_place_keeps_losses_keys_and_neftune(tmp_path):
    _, plain = _train(_shardkit_llama(), _args(tmp_path))
    model = _shardkit_llama()
    keys = list(model.state_dict())
    trainer, compiled = _train(model, _args(tmp_path, torch_compile=True, torch_compile_backend="eager"))
    assert is_compiled(model) and trainer.runner.unwrap_model(trainer.model) is model
    assert list(model.state_dict()) == keys  # no "_orig_mod." prefix: checkpoints load into an uncompiled model
    assert compiled == pytest.approx(plain, rel=1e-5)
    # NEFTune on a model compiled and run before train(): the hook must reach the compiled code, and leave it.
    model, ids = _shardkit_llama(), Tokens()[0]["input_ids"][None]
    model.compile(backend="eager")
    model(ids)
    _, noisy = _train(model, _args(tmp_path, neftune_noise_alpha=50.0))
    assert noisy[0] != plain[0]
    with torch.no_grad():
        assert torch.equal(model(ids), model(ids))  # training mode, no dropout: no noise after train()


def test_torch_compile_arguments_are_checked(tmp_path):
    args = _args(tmp_path, torch_compile_mode="max-autotune")
    assert args.torch_compile and args.torch_compile_backend == "inductor"
    assert _args(tmp_path, torch_compile=True).torch_compile_backend == "inductor"
    with pytest.raises(ValueError, match="torch_compile_backend='inductr'.*inductor"):
        _args(tmp_path, torch_compile_backend="inductr")
    with pytest.raises(ValueError, match="torch_compile_mode='fast'"):
        _args(tmp_path, torch_compile_mode="fast")
    with pytest.raises(ValueError, match="inductor setting"):
        _args(tmp_path, torch_compile_backend="eager", torch_compile_mode="reduce-overhead")
    with pytest.raises(ValueError, match="True or False"):
        _args(tmp_path, torch_compile="yes")
