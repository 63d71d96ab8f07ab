"""LoRA (peft) through the Trainer on one process: only adapters train and carry state, adapter-only checkpoints
and saves that peft loads, a merged HF export with the PeftModel's logits, exact resume, and the named errors."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.utils.data import Subset

from shardkit import Runner
from shardkit.checkpoint.hf import load_pretrained
from shardkit.models import ByteTextDataset, Llama
from shardkit.models import LlamaConfig as SKConfig
from shardkit.strategies import SingleDevice
from shardkit.trainer import Trainer, TrainerCallback, TrainingArguments
from shardkit.trainer.peft_support import merged_tensors, trainable_view

peft = pytest.importorskip("peft", reason="LoRA needs the peft extra: pip install shardkit[peft]")
transformers = pytest.importorskip("transformers")

TEXT = Path(__file__).resolve().parents[2] / "examples" / "data" / "public_domain.txt"
HF_TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=2, max_position_embeddings=32)
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _hf_base(**sizes):
    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**HF_TINY, **sizes}))


def _hf_lora():
    model = peft.get_peft_model(_hf_base(), peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
    for name, p in model.named_parameters():  # lora_B starts at zero: nudge it so a wrong merge shows
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def _data(n=48):
    return Subset(ByteTextDataset(TEXT, seq_len=16, stride=16), range(n))


def _args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=4, learning_rate=5e-2, max_steps=6, logging_steps=1,
                lr_scheduler_type="constant", save_strategy="no", disable_tqdm=True, seed=0, optim="adamw_torch",
                report_to="none")
    return TrainingArguments(**{**base, **kw})


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


class GradNames(TrainerCallback):
    names: set = set()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.names = {n for n, p in model.named_parameters() if p.grad is not None}


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One LoRA run on a tiny HF Llama, saved three ways; the checks below read it."""
    out = tmp_path_factory.mktemp("lora")
    model = _hf_lora()
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    grads = GradNames()
    trainer = Trainer(model, _args(out / "run", save_strategy="steps", save_steps=3), train_dataset=_data(),
                      callbacks=[grads])
    trainer.train()
    trainer.save_model(str(out / "adapter"))
    trainer.save_model(str(out / "merged"), merge_adapters=True)
    return dict(out=out, trainer=trainer, model=trainer.model, base_before=base_before, grads=grads.names)


def test_only_adapters_train_and_carry_optimizer_state(trained):
    model, trainer = trained["model"], trained["trainer"]
    losses = _losses(trainer)
    assert losses[-1] < losses[0] - 0.05
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    assert trained["grads"] == adapters
    state_params = {id(p) for p in trainer.optimizer.state}
    assert state_params == {id(p) for n, p in model.named_parameters() if n in adapters}
    for name, p in model.named_parameters():
        if name in trained["base_before"]:
            assert torch.equal(p, trained["base_before"][name]), name


def test_saved_adapters_load_with_peft_and_give_the_same_logits(trained):
    adapter = trained["out"] / "adapter"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in adapter.iterdir()}
    assert not (adapter / "model.safetensors").exists()
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        assert f.keys() and all("lora_" in k for k in f.keys())
    loaded = peft.PeftModel.from_pretrained(_hf_base(), str(adapter))
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(loaded, ids), _logits(trained["model"], ids))


def test_merged_export_loads_without_peft_and_matches(trained):
    merged_dir = trained["out"] / "merged"
    assert (merged_dir / "config.json").is_file() and (merged_dir / "model.safetensors").is_file()
    merged = transformers.LlamaForCausalLM.from_pretrained(str(merged_dir))
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    want = _logits(trained["model"], ids)
    torch.testing.assert_close(_logits(merged, ids), want, rtol=1e-5, atol=1e-5)


def test_checkpoints_hold_adapters_only_and_peft_reads_them(trained):
    ckpt = trained["out"] / "run" / "checkpoint-3"
    assert (ckpt / "adapter_model.safetensors").is_file()
    names = []
    for file in ckpt.rglob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names += list(f.keys())
    manifest = json.loads((ckpt / "shardkit.json").read_text())
    assert "model" in json.dumps(manifest)
    assert not any("embed_tokens" in n or "base_layer" in n or "mlp" in n for n in names), names[:10]
    peft.PeftModel.from_pretrained(_hf_base(), str(ckpt))


def test_exact_resume_of_a_lora_run(tmp_path):
    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                control.should_training_stop = True

    def trainer(out, callbacks=()):
        args = _args(out, save_strategy="steps", save_steps=3, gradient_accumulation_steps=2)
        return Trainer(_hf_lora(), args, train_dataset=_data(), callbacks=list(callbacks))

    full = trainer(tmp_path / "full")
    full.train()
    trainer(tmp_path / "resumed", [StopAt()]).train()
    torch.manual_seed(123)
    second = trainer(tmp_path / "resumed")
    second.train(resume_from_checkpoint=True)
    assert _losses(second) == _losses(full)  # the first 3 restored from the checkpoint, the last 3 retrained
    a, b = dict(full.model.named_parameters()), dict(second.model.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_shardkit_llama_takes_lora_and_trains(tmp_path):
    torch.manual_seed(1)
    base = Llama(SKConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, max_position=16))
    model = peft.get_peft_model(base, peft.LoraConfig(**{**LORA, "target_modules": ["q_proj", "v_proj", "up_proj"]}))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainer = Trainer(model, _args(tmp_path), train_dataset=_data())
    assert trainer.loss_settings.shift_labels  # read from the Llama under the PeftModel: its loss shifts labels inside
    trainer.train()
    losses = _losses(trainer)
    assert losses[-1] < losses[0] - 0.05
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    trainer.save_model(str(tmp_path / "merged"), merge_adapters=True)
    # the merged weights are written as the transformers Llama they equal (config.json + HF names), tied once;
    # shardkit's own reader takes them back into a shardkit Llama
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), "pt") as f:
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
    merged = Llama(SKConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, max_position=16))
    runner = Runner(SingleDevice("cpu"))
    merged = runner.setup(merged)
    assert load_pretrained(runner, merged, tmp_path / "merged") == []
    ids = torch.randint(0, 256, (2, 12))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(ids), model(ids), rtol=1e-5, atol=1e-5)


def test_merge_adapters_refuses_plain_models_and_dora(tmp_path):
    trainer = Trainer(_hf_base(), _args(tmp_path))
    with pytest.raises(ValueError, match="not a peft PeftModel"):
        trainer.save_model(str(tmp_path / "x"), merge_adapters=True)
    dora = peft.get_peft_model(_hf_base(), peft.LoraConfig(use_dora=True, **LORA))
    with pytest.raises(NotImplementedError, match="DoRA.*merge_and_unload"):
        list(merged_tensors(iter(dora.state_dict().items()), dora))


def test_trainable_view_holds_the_live_trainable_parameters():
    model = _hf_lora()
    view = trainable_view(model)
    assert set(view.state_dict()) == {n for n, p in model.named_parameters() if p.requires_grad}
    name = next(iter(view.state_dict()))
    assert view.get_parameter(name) is model.get_parameter(name)
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        trainable_view(model)


# ---- QLoRA (bitsandbytes 4-bit; its CPU backend quantizes and computes, so this runs without a GPU) -------------


def _quantized_lora(tmp_path, storage=torch.float32, lora=None, **sizes):
    from shardkit.trainer.qlora import qlora_config

    _hf_base(**sizes).save_pretrained(str(tmp_path / "base"))
    bnb_config = qlora_config(compute_dtype=torch.float32, quant_storage=storage)
    base = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "base"), quantization_config=bnb_config,
                                                         dtype=torch.float32, device_map="cpu")
    base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    torch.manual_seed(2)
    return peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", **(lora or LORA)))


def test_qlora_config_checks_its_arguments():
    pytest.importorskip("bitsandbytes")
    from shardkit.trainer.qlora import qlora_config

    config = qlora_config(compute_dtype=torch.bfloat16)
    assert config.load_in_4bit and config.bnb_4bit_quant_storage == torch.bfloat16
    assert config.bnb_4bit_compute_dtype == torch.bfloat16 and config.bnb_4bit_quant_type == "nf4"
    with pytest.raises(ValueError, match="quant_type='int3'"):
        qlora_config(quant_type="int3")
    with pytest.raises(ValueError, match="compute_dtype=torch.int8 must be a floating"):
        qlora_config(compute_dtype=torch.int8)
    with pytest.raises(ValueError, match="quant_storage=torch.int32 is not one of"):
        qlora_config(quant_storage=torch.int32)


def test_quant_storage_check_names_the_weight_fsdp_would_scramble():
    bnb = pytest.importorskip("bitsandbytes")
    from shardkit.strategies.quant_storage import check_quant_storage

    layers = {}
    for storage in (torch.uint8, torch.bfloat16, torch.float32):
        layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.float32, quant_storage=storage)
        layer.load_state_dict(torch.nn.Linear(64, 32, bias=False).state_dict())
        layers[storage] = torch.nn.Sequential(layer.to("cpu"))  # quantized here, on the CPU
        assert layers[storage][0].weight.dtype == storage
    check_quant_storage(layers[torch.uint8], torch.bfloat16)  # not floating: FSDP leaves it alone
    check_quant_storage(layers[torch.bfloat16], torch.bfloat16)  # gathered in its own dtype: no cast
    check_quant_storage(layers[torch.float32], None)  # no mixed precision: no cast
    with pytest.raises(ValueError, match=r"4-bit weight 0.weight is stored as torch.float32.*"
                                         r"bnb_4bit_quant_storage=torch.bfloat16"):
        check_quant_storage(layers[torch.float32], torch.bfloat16)


def test_qlora_trains_on_cpu_saves_adapters_and_refuses_a_merge(tmp_path):
    pytest.importorskip("bitsandbytes")
    from shardkit.trainer.qlora import quantized_parameters

    model = _quantized_lora(tmp_path)
    # Packed bytes held as float32 can read as NaN: compare the bytes.
    packed = {n: p.detach().view(torch.uint8).clone() for n, p in quantized_parameters(model)}
    assert len(packed) == 2 * 7  # every Linear of the 2 blocks is 4-bit (lm_head stays full precision)
    trainer = Trainer(model, _args(tmp_path / "run"), train_dataset=_data())
    trainer.train()
    losses = _losses(trainer)
    assert losses[-1] < losses[0] - 0.05
    assert all(torch.equal(p.detach().view(torch.uint8), packed[n]) for n, p in quantized_parameters(model))
    trainer.save_model(str(tmp_path / "adapter"))
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as f:
        assert f.keys() and all("lora_" in k for k in f.keys())
    with pytest.raises(NotImplementedError, match="4-bit weights.*merge_adapters=False"):
        trainer.save_model(str(tmp_path / "merged"), merge_adapters=True)


def test_qlora_after_an_evaluation_trains_as_without_it(tmp_path):
    """The FSDP seed's QLoRA (LoRA on every linear layer) with an evaluation in the middle: the steps after it
    get the same gradients and losses as the run without one. (bitsandbytes' CPU inference layout, taken on an
    eval forward, would route training through a kernel without gradients; the layers are 64 wide so that
    layout applies.)"""
    pytest.importorskip("bitsandbytes")

    def run(name, **kw):
        model = _quantized_lora(tmp_path / name, lora={**LORA, "target_modules": "all-linear"}, hidden_size=64,
                                intermediate_size=128)
        trainer = Trainer(model, _args(tmp_path / f"{name}-run", max_steps=4, **kw), train_dataset=_data(16),
                          eval_dataset=_data(4))
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        return [h["loss"] for h in logs], [h["grad_norm"] for h in logs], trainer

    losses, norms, evaluated = run("eval", eval_strategy="steps", eval_steps=2)
    assert any("eval_loss" in h for h in evaluated.state.log_history)
    plain_losses, plain_norms, _ = run("plain")
    assert losses == pytest.approx(plain_losses, rel=1e-6, abs=1e-6)
    assert norms == pytest.approx(plain_norms, rel=1e-5)


def test_setup_puts_a_4bit_weight_back_in_its_training_layout():
    """A 4-bit layer evaluated before setup holds bitsandbytes' inference-only CPU layout; the Runner puts it back
    (same bytes as before) and the layer never takes that layout again, so gradients reach its input."""
    bnb = pytest.importorskip("bitsandbytes")
    from shardkit import Runner
    from shardkit.strategies import SingleDevice

    layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32, quant_storage=torch.uint8)
    layer.load_state_dict(torch.nn.Linear(64, 64, bias=False).state_dict())
    layer = layer.to("cpu")
    before = layer.weight.detach().clone()
    weight = layer.weight
    weight.data, weight.quant_state = bnb.functional._convert_weight_packed_for_cpu(weight.data, weight.quant_state)
    assert weight.quant_state.packing_format_for_cpu  # the layout an eval forward leaves on AVX512-BF16 CPUs
    model = Runner(SingleDevice("cpu")).setup(torch.nn.Sequential(layer))
    assert not getattr(layer.weight.quant_state, "packing_format_for_cpu", False)
    assert torch.equal(layer.weight.detach().view(-1), before.view(-1))
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 64))
    assert not getattr(layer.weight.quant_state, "packing_format_for_cpu", False)
    model.train()
    x = torch.randn(2, 64, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
