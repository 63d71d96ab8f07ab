"""DPOTrainer's own behaviour: precomputed reference = on the fly, a PEFT model's disabled adapter = a frozen copy
of its base, padding-free = padded, shardkit's Llama trains, bad rows and unsupported settings are named."""

from __future__ import annotations

import copy

import pytest
import torch

from shardkit.preference import DPOConfig, DPOTrainer
from shardkit.trainer.callbacks import TrainerCallback
from tests.preference.conftest import rows

datasets = pytest.importorskip("datasets")


class Grads(TrainerCallback):
    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, learning_rate=1e-2,
                lr_scheduler_type="constant", logging_steps=1, report_to="none", max_grad_norm=0.0, seed=0,
                max_length=64, beta=0.5, save_strategy="no", disable_tqdm=True, use_cpu=True,
                train_sampling_strategy="sequential")
    return DPOConfig(**{**base, **kw})


def _train(model, tokenizer, args, data=None, **kw):
    grads = Grads()
    trainer = DPOTrainer(model, args=args, train_dataset=data if data is not None else rows(),
                         processing_class=tokenizer, callbacks=[grads], **kw)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, grads.grads, trainer


def _assert_same(a, b, atol=1e-6):
    (la, ga, _), (lb, gb, _) = a, b
    assert la == pytest.approx(lb, abs=atol)
    assert len(ga) == len(gb) and ga
    for x, y in zip(ga, gb):
        assert set(x) == set(y)
        for name in x:
            torch.testing.assert_close(x[name], y[name], atol=atol, rtol=1e-5, msg=name)


def test_precomputed_reference_equals_on_the_fly(model, tokenizer, tmp_path):
    live = _train(copy.deepcopy(model), tokenizer, _args(tmp_path / "live"), eval_dataset=rows(3))
    pre = _train(copy.deepcopy(model), tokenizer, _args(tmp_path / "pre", precompute_ref_log_probs=True,
                                                         precompute_ref_batch_size=3), eval_dataset=rows(3))
    assert pre[2].ref_model is None  # nothing kept in memory during training
    assert all("ref_chosen_logps" in row for row in pre[2].train_dataset)
    assert all("ref_chosen_logps" in row for row in pre[2].eval_dataset)
    _assert_same(live, pre)
    live_eval, pre_eval = live[2].evaluate(), pre[2].evaluate()
    assert pre_eval["eval_loss"] == pytest.approx(live_eval["eval_loss"], abs=1e-6)
    assert pre_eval["eval_rewards/margins"] == pytest.approx(live_eval["eval_rewards/margins"], abs=1e-6)
    assert live_eval["eval_rewards/margins"] != 0.0  # after training, the policy differs from the reference


def test_peft_disabled_adapter_reference_equals_frozen_base_copy(model, tokenizer, tmp_path):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                             init_lora_weights=False)  # non-zero adapters: policy and reference differ from step 0
    torch.manual_seed(1)
    adapter = _train(copy.deepcopy(model), tokenizer, _args(tmp_path / "adapter"), peft_config=config)
    assert adapter[2].ref_model is None  # no second copy
    torch.manual_seed(1)
    frozen = _train(copy.deepcopy(model), tokenizer, _args(tmp_path / "copy"), peft_config=config,
                    ref_model=copy.deepcopy(model))
    _assert_same(adapter, frozen)
    rewards = [h["rewards/margins"] for h in adapter[2].state.log_history if "rewards/margins" in h]
    assert rewards and any(abs(r) > 1e-6 for r in rewards)  # the reference is not the policy


def test_padding_free_equals_padded(model, tokenizer, tmp_path):
    padded = _train(copy.deepcopy(model), tokenizer, _args(tmp_path / "padded"))
    flat = _train(copy.deepcopy(model), tokenizer, _args(tmp_path / "flat", padding_free=True))
    batch = flat[2].data_collator([flat[2].train_dataset[i] for i in range(2)])
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch  # one row, no padding
    _assert_same(padded, flat, atol=1e-5)


def test_shardkit_llama_loss_falls_with_ld_alpha_and_sft(tokenizer, tmp_path):
    from shardkit.models import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2,
                              num_heads=4, num_kv_heads=2, max_position=128, fused=False))
    losses, _, trainer = _train(model, tokenizer, _args(tmp_path, max_steps=8, loss_type=["sigmoid", "sft"],
                                                        loss_weights=[1.0, 0.1], ld_alpha=0.5, padding_free=True,
                                                        per_device_train_batch_size=8))
    assert losses[-1] < losses[0]
    accuracies = [h["rewards/accuracies"] for h in trainer.state.log_history if "rewards/accuracies" in h]
    assert accuracies[-1] == 1.0


@pytest.mark.parametrize("row, message", [
    ({"prompt": "Hello", "chosen": " there."}, r"row 2: field 'rejected' is missing"),
    ({"prompt": "Hello", "chosen": "", "rejected": " no."}, r"row 2, field 'chosen': the completion is empty"),
    ({"prompt": "word " * 80, "chosen": " a.", "rejected": " b."}, r"row 2, field 'prompt': the prompt is \d+ tokens"),
    ({"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "hello"}],
      "rejected": [{"role": "assistant"}]}, r"row 2: .*rejected"),
])
def test_bad_rows_are_named(model, tokenizer, tmp_path, row, message):
    data = rows(2) + [row]
    with pytest.raises(ValueError, match=message):
        DPOTrainer(model, args=_args(tmp_path), train_dataset=data, processing_class=tokenizer)


def test_conversational_rows_use_the_chat_template(model, tokenizer, tmp_path):
    convo = [{"prompt": [{"role": "user", "content": p}], "chosen": [{"role": "assistant", "content": c}],
              "rejected": [{"role": "assistant", "content": r}]} for p, c, r in
             ((r["prompt"], r["chosen"], r["rejected"]) for r in rows(4))]
    trainer = DPOTrainer(model, args=_args(tmp_path, max_steps=1), train_dataset=datasets.Dataset.from_list(convo),
                         processing_class=tokenizer)
    row = trainer.train_dataset[0]
    prompt = tokenizer.apply_chat_template(convo[0]["prompt"], tokenize=True, add_generation_prompt=True,
                                           return_dict=True)["input_ids"]
    assert list(row["prompt_ids"]) == list(prompt)
    assert tokenizer.decode(row["chosen_ids"]).startswith(convo[0]["chosen"][0]["content"])
    trainer.train()


@pytest.mark.parametrize("field, value", [("f_divergence_type", "js_divergence"), ("router_aux_loss_coef", 0.1),
                                          ("activation_offloading", True), ("trust_remote_code", True)])
def test_unsupported_trl_fields_are_refused(tmp_path, field, value):
    with pytest.raises(NotImplementedError, match=field):
        _args(tmp_path, **{field: value})


def test_config_checks(tmp_path):
    with pytest.raises(ValueError, match="did you mean 'sigmoid'"):
        _args(tmp_path, loss_type="sigmoud")
    with pytest.raises(ValueError, match="loss_weights has 1 weights for 2 loss types"):
        _args(tmp_path, loss_type=["sigmoid", "sft"], loss_weights=[1.0])
    with pytest.raises(ValueError, match="exo_pair"):
        _args(tmp_path, loss_type="exo_pair")
    assert _args(tmp_path, loss_type="ipo").loss_type == ["ipo"]


def test_trl_config_fields_are_all_known():
    """Every field of TRL 1.16's DPOConfig exists here (supported, or refused when set)."""
    trl = pytest.importorskip("trl")
    import dataclasses

    ours = {f.name for f in dataclasses.fields(DPOConfig)}
    theirs = {f.name for f in dataclasses.fields(trl.DPOConfig)}
    from transformers import TrainingArguments

    trl_own = theirs - {f.name for f in dataclasses.fields(TrainingArguments)}
    assert trl_own - ours == set()


def test_model_and_reference_must_differ(model, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="same object"):
        DPOTrainer(model, ref_model=model, args=_args(tmp_path), train_dataset=rows(), processing_class=tokenizer)


def test_token_log_probs_equal_full_logits():
    """The log-probs equal log_softmax of the full logits (the op path against the plain computation)."""
    from shardkit.preference.logps import token_log_probs

    torch.manual_seed(0)
    hidden, weight = torch.randn(7, 16, dtype=torch.float64), torch.randn(300, 16, dtype=torch.float64)
    labels = torch.randint(0, 300, (7,))
    expected = torch.log_softmax(hidden @ weight.t(), -1).gather(1, labels[:, None]).squeeze(1)
    torch.testing.assert_close(token_log_probs(hidden, weight, labels).double(), expected, atol=1e-6, rtol=1e-6)


def test_sync_ref_model_mixes_the_policy_into_the_reference(model, tokenizer, tmp_path):
    """TR-DPO with alpha=1 every step: each step starts with reference = policy, so every reward is 0; without it
    the second step's rewards are not."""
    synced = _train(copy.deepcopy(model), tokenizer, _args(tmp_path / "sync", sync_ref_model=True,
                                                            ref_model_mixup_alpha=1.0, ref_model_sync_steps=1))[2]
    plain = _train(copy.deepcopy(model), tokenizer, _args(tmp_path / "plain"))[2]
    margins = [h["rewards/margins"] for h in synced.state.log_history if "rewards/margins" in h]
    assert len(margins) == 2 and all(m == 0.0 for m in margins)
    assert [h["rewards/margins"] for h in plain.state.log_history if "rewards/margins" in h][1] != 0.0
    for p, q in zip(synced.model.parameters(), synced.ref_model.parameters()):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize("kind, padding_free", [("hf", False), ("hf", True), ("llama", True), ("llama", False)])
def test_scoring_inside_the_forward_equals_scoring_after_it(tokenizer, tmp_path, monkeypatch, kind, padding_free):
    """The path FSDP's sharded head takes (the head's forward replaced by the scorer for one model forward), forced
    on one process: loss, metrics (logits/*, entropy, token accuracy, WPO's weights) and gradients equal those of
    scoring the last hidden states after the forward; the head's own forward is back afterwards."""
    from shardkit.models import Llama, LlamaConfig
    from shardkit.preference import logps
    from tests.preference.conftest import tiny_llama

    def build():
        torch.manual_seed(0)
        if kind == "hf":
            return tiny_llama(len(tokenizer))
        return Llama(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2,
                                 num_heads=4, num_kv_heads=2, max_position=128, fused=False))

    args = dict(padding_free=padding_free, use_weighting=True, max_steps=1)
    after = _train(build(), tokenizer, _args(tmp_path / "after", **args))
    monkeypatch.setattr(logps, "whole_only_in_forward", lambda weight: True)
    inside = _train(build(), tokenizer, _args(tmp_path / "inside", **args))
    _assert_same(after, inside, atol=1e-6)
    names = ("logits/", "logps/", "rewards/", "entropy", "mean_token_accuracy", "num_tokens")
    logged = [{k: v for k, v in h.items() if k.startswith(names)}
              for r in (after, inside) for h in r[2].state.log_history if "loss" in h]
    assert {"entropy", "mean_token_accuracy", "num_tokens"} <= set(logged[0])
    assert logged[0] == pytest.approx(logged[1], abs=1e-6)
    head = logps.lm_head_of(inside[2].model)
    assert "forward" not in head.__dict__


def test_a_partitioned_head_is_scored_in_forward_and_refused_outside_it_with_a_gradient(monkeypatch):
    """A head an engine partitions in place (ZeRO-3, played here by a handler that claims the weight): the trainers
    score it inside its forward; read outside with a gradient, backward would find it partitioned again, so
    head_log_probs refuses by name; under no_grad (a frozen reference) it is read as before."""
    import contextlib

    from shardkit.nn.log_probs import head_log_probs, whole_only_in_forward
    from shardkit.utils import partitioned

    weight = torch.randn(11, 4, requires_grad=True)

    class Claims:
        def is_partitioned(self, param):
            return param is weight

        def gathered_for_read(self, params):
            return contextlib.nullcontext()

    hidden, labels = torch.randn(3, 4), torch.tensor([1, 2, 3])
    assert not whole_only_in_forward(weight)
    monkeypatch.setattr(partitioned, "handlers", lambda: [Claims()])
    assert whole_only_in_forward(weight)
    with pytest.raises(ValueError, match="partitioned by ZeRO-3.*inside the head module's forward"):
        head_log_probs(hidden, weight, labels)
    with torch.no_grad():
        got = head_log_probs(hidden, weight, labels)
    torch.testing.assert_close(got, torch.log_softmax(hidden @ weight.T, -1)[torch.arange(3), labels])


def test_scoring_inside_the_forward_refuses_a_model_that_changes_its_head_output(base_model, monkeypatch):
    """A model that scales (or softcaps) its logits after the head would turn the scorer's log-probs into something
    else: named, and the head's own forward is back afterwards."""
    from shardkit.preference import logps

    class Scaled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def get_output_embeddings(self):
            return self.inner.lm_head

        def forward(self, **kwargs):
            out = self.inner(**kwargs)
            out.logits = out.logits * 2.0
            return out

    model = Scaled(copy.deepcopy(base_model))
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "completion_mask": torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 0]])}
    monkeypatch.setattr(logps, "whole_only_in_forward", lambda weight: True)
    with pytest.raises(ValueError, match="Scaled: preference scoring inside the forward needs a model whose forward "
                                         "returns its LM head's output as is"):
        logps.sequence_log_probs(model, model, batch, 2)
    assert "forward" not in model.inner.lm_head.__dict__
    monkeypatch.undo()
    model.forward = lambda **kwargs: model.inner(**kwargs)  # unchanged output: scored
    monkeypatch.setattr(logps, "whole_only_in_forward", lambda weight: True)
    inside = logps.sequence_log_probs(model, model, batch, 2, mean_logits=False)
    monkeypatch.undo()
    after = logps.sequence_log_probs(model.inner, model.inner, batch, 2, mean_logits=False)
    torch.testing.assert_close(inside.logps, after.logps)
