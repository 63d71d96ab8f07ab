"""LoRA (peft) through the Trainer on 2 CPU ranks under DDP, FSDP, ZeRO-2 and ZeRO-3, one process group each: the
loss falls, only adapters get gradients and optimizer state, the base stays bitwise unchanged, adapters agree across
ranks, saved adapters and the merged HF export give the trained model's logits; exact resume under FSDP; QLoRA (a
bitsandbytes 4-bit base, bf16 quant storage) under FSDP with BF16 on the CPU, evaluated during training."""

import os
from pathlib import Path

import pytest
import torch
from harness import run_distributed, transformers_without_zero3
from trainer_fixtures import StopAt, full_state_dict, logged_losses, text_data

from shardkit.strategies import strategy_from_name
from shardkit.trainer import Trainer, TrainerCallback, TrainingArguments

peft = pytest.importorskip("peft", reason="LoRA needs the peft extra: pip install shardkit[peft]")
transformers = pytest.importorskip("transformers")

HF_TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=2, max_position_embeddings=32)
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")


def _hf_base():
    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_TINY))


def _hf_lora():
    model = peft.get_peft_model(_hf_base(), peft.LoraConfig(**LORA))
    for name, p in model.named_parameters():  # lora_B starts at zero: nudge it so a wrong merge or load shows
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def _args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=2, learning_rate=5e-2, lr_scheduler_type="constant",
                max_steps=6, logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, optim="adamw_torch",
                report_to="none")
    return TrainingArguments(**{**base, **kw})


def _data():
    return text_data(48)


class GradNames(TrainerCallback):
    names: set = set()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.names = {n.removeprefix("module.") for n, p in model.named_parameters() if p.grad is not None}


def _optimizer_held(trainer) -> set[str]:
    """Names of the parameters the optimizer keeps state (or, under ZeRO, fp32 masters) for."""
    runner = trainer.runner
    named = list(runner.unwrap_model(trainer.model).named_parameters())
    layout = getattr(runner.strategy, "layout", None)
    if layout is not None:
        return {n for n, p in named if layout.trainable(p)}
    return {n for n, p in named if p in trainer.optimizer.state and trainer.optimizer.state[p]}


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _saves_match(trainer, out: Path, ids: torch.Tensor) -> dict:
    """save_model both ways on every rank; the main process reloads each without shardkit and compares logits."""
    want = _logits(trainer.model, ids)  # on every rank: a sharded forward is a collective
    trainer.save_model(str(out / "adapter"))
    trainer.save_model(str(out / "merged"), merge_adapters=True)
    if not trainer.runner.is_main_process:
        return {}
    with transformers_without_zero3():
        adapter = peft.PeftModel.from_pretrained(_hf_base(), str(out / "adapter"))
        merged = transformers.LlamaForCausalLM.from_pretrained(str(out / "merged"))
    return {"adapter_gap": (_logits(adapter, ids) - want).abs().max().item(),
            "merged_gap": (_logits(merged, ids) - want).abs().max().item(),
            "adapter_files": sorted(p.name for p in (out / "adapter").iterdir())}


def _resume_equal(strategy: str, out: Path) -> bool:
    def trainer(path, callbacks=()):
        args = _args(path, save_strategy="steps", save_steps=3, gradient_accumulation_steps=2)
        return Trainer(_hf_lora(), args, train_dataset=_data(), callbacks=list(callbacks),
                       strategy=strategy_from_name(strategy))

    full = trainer(out / "full")
    full.train()
    trainer(out / "resumed", [StopAt(3)]).train()
    torch.manual_seed(99)  # another RNG state than at the save: the checkpoint must restore it
    second = trainer(out / "resumed")
    second.train(resume_from_checkpoint=True)
    a, b = full_state_dict(full.runner, full.model), full_state_dict(second.runner, second.model)
    return logged_losses(second) == logged_losses(full) and all(torch.equal(a[k], b[k]) for k in a)


def _train_and_check(strategy: str, out: Path, resume: bool) -> dict:
    model = _hf_lora()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    grads = GradNames()
    trainer = Trainer(model, _args(out / "run"), train_dataset=_data(), callbacks=[grads],
                      strategy=strategy_from_name(strategy))
    trainer.train()
    full = full_state_dict(trainer.runner, trainer.model)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    result = {"losses": logged_losses(trainer), "adapters": adapters, "held": _optimizer_held(trainer),
              "grad_names": grads.names, "frozen_equal": all(torch.equal(full[k], v) for k, v in frozen.items()),
              "adapter_values": {k: v for k, v in full.items() if k in adapters},
              "zero": getattr(trainer.runner.strategy, "layout", None) is not None}
    result.update(_saves_match(trainer, out / "save", ids))
    if resume:
        result["resume_equal"] = _resume_equal(strategy, out / "resume")
    return result


def _qlora_fsdp(out: Path) -> dict:
    """The seed's QLoRA: 4-bit base (quant storage = compute dtype = bf16) + LoRA under FSDP with BF16, on CPU."""
    from shardkit.trainer.qlora import qlora_config, quantized_parameters

    local = out / f"base-{os.environ['RANK']}"  # each rank writes and reads its own copy
    _hf_base().save_pretrained(str(local))
    base = transformers.LlamaForCausalLM.from_pretrained(
        str(local), quantization_config=qlora_config(compute_dtype=torch.bfloat16), dtype=torch.bfloat16,
        device_map="cpu")
    torch.manual_seed(2)
    model = peft.get_peft_model(base, peft.LoraConfig(**LORA))
    packed = {n: p.detach().view(torch.uint8).clone() for n, p in quantized_parameters(model)}
    # the seed evaluates during training: evaluation must leave the 4-bit layers as training needs them
    trainer = Trainer(model, _args(out / "run", bf16=True, eval_strategy="steps", eval_steps=3), train_dataset=_data(),
                      eval_dataset=text_data(4), strategy=strategy_from_name("fsdp"))
    trainer.train()
    inference_layout = [n for n, p in quantized_parameters(model)
                        if getattr(p.quant_state, "packing_format_for_cpu", False)]
    with trainer.runner.gathered_parameters([p for _, p in quantized_parameters(model)]) as whole:
        same = all(torch.equal(w.view(torch.uint8), packed[n]) for (n, _), w in zip(quantized_parameters(model), whole))
    evals = sum("eval_loss" in h for h in trainer.state.log_history)
    return {"losses": logged_losses(trainer), "packed": len(packed), "packed_equal": same, "evals": evals,
            "inference_layout": inference_layout,
            "held": _optimizer_held(trainer), "adapters": {n for n, p in model.named_parameters() if p.requires_grad}}


def _lora_worker(strategies: list[tuple[str, bool]], out: str) -> dict:
    # One process group for every strategy: starting the ranks (importing torch, transformers and peft) costs
    # more than the training here. Each strategy's error is kept so the others still run and report.
    # QLoRA runs first: its from_pretrained on ranks whose process group already exists hung (a gloo recv timed out).
    results = {}
    for case, resume in strategies:
        try:
            if case == "fsdp_qlora":
                results[case] = _qlora_fsdp(Path(out) / case)
            else:
                results[case] = _train_and_check(case, Path(out) / case, resume)
        except Exception as err:  # noqa: BLE001 - reported per strategy by the test
            results[case] = {"error": f"{type(err).__name__}: {err}"}
    return results


STRATEGIES = [("ddp", False), ("fsdp", True), ("zero2", False), ("zero3", False)]
CASES = [("fsdp_qlora", False), *STRATEGIES]


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    return run_distributed(_lora_worker, 2, args=(CASES, str(out)), env={"DS_ACCELERATOR": "cpu"})


@pytest.mark.parametrize("strategy", [s for s, _ in STRATEGIES])
def test_lora_trains_saves_and_exports(lora_runs, strategy):
    results = [r[strategy] for r in lora_runs]
    for r in results:
        assert "error" not in r, r.get("error")
    main = results[0]
    assert main["losses"][-1] < main["losses"][0] - 0.05
    assert main["held"] == main["adapters"]
    if not main["zero"]:  # DeepSpeed keeps gradients in its own buckets, not in .grad
        assert main["grad_names"] == main["adapters"]
    for r in results:
        assert r["frozen_equal"]
        assert r["adapter_values"].keys() == main["adapters"]
        assert all(torch.equal(r["adapter_values"][k], v) for k, v in main["adapter_values"].items())
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(main["adapter_files"])
    assert "model.safetensors" not in main["adapter_files"]
    assert main["adapter_gap"] < 1e-5 and main["merged_gap"] < 1e-4
    if "resume_equal" in main:
        assert all(r["resume_equal"] for r in results)


def test_qlora_trains_under_fsdp_with_bf16_quant_storage(lora_runs):
    for r in lora_runs:
        result = r["fsdp_qlora"]
        assert "error" not in result, result.get("error")
        assert result["packed"] == 14 and result["packed_equal"]  # 7 Linears x 2 blocks stay 4-bit, untouched
        assert result["held"] == result["adapters"]
        assert result["evals"] == 2 and result["inference_layout"] == []
    losses = lora_runs[0]["fsdp_qlora"]["losses"]
    assert losses[-1] < losses[0] - 0.05
