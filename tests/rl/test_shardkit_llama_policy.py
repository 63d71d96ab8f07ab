"""shardkit's own Llama as the GRPO/RLOO policy: its loss, advantages and gradients on fixed left-padded rollouts
equal those of the same weights in a Hugging Face Llama (the padding is honoured when scoring), and GRPO with it
learns the toy task on one process (generation with left-padded prompts under its attention mask)."""

from __future__ import annotations

import pytest
import torch

from tests.rl.conftest import PROMPTS, G, fixed_completions, reward_first, reward_length, tiny_llama
from tests.rl.test_toy_task import MARGIN, in_target

TOL = 1e-5


def shardkit_copy(hf_model):
    """shardkit's Llama with ``hf_model``'s weights (the parameter names map one to one, less HF's "model.")."""
    from shardkit.models import Llama, LlamaConfig

    cfg = hf_model.config
    model = Llama(LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                              intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
                              num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                              max_position=cfg.max_position_embeddings, rms_eps=cfg.rms_norm_eps,
                              tie_embeddings=cfg.tie_word_embeddings, fused=False))
    state = {k.removeprefix("model."): v for k, v in hf_model.state_dict().items()}
    model.load_state_dict(state)
    return model


def _rows():
    return [{"prompt": p} for p in PROMPTS for _ in range(G)]


def _loss_and_grads(model, tokenizer, tmp_path, name):
    from shardkit.rl import GRPOConfig, GRPOTrainer
    from shardkit.rl.rollout import Completions, tokenize_prompts

    args = GRPOConfig(output_dir=str(tmp_path / name), use_cpu=True, per_device_train_batch_size=len(PROMPTS) * G,
                      num_generations=G, max_completion_length=6, report_to="none", seed=0, beta=0.1,
                      reward_weights=[1.0, 0.5], temperature=0.7, loss_type="grpo", save_strategy="no",
                      disable_tqdm=True)
    trainer = GRPOTrainer(model, [reward_length, reward_first], args=args, train_dataset=_rows(),
                          processing_class=tokenizer)
    trainer.model.train()
    prompt_ids = tokenize_prompts(tokenizer, [r["prompt"] for r in _rows()])
    batch = trainer.score_completions(_rows(), prompt_ids, Completions(*fixed_completions(tokenizer)))
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n.removeprefix("model."): p.grad.clone() for n, p in trainer.model.named_parameters()}
    return batch, loss.detach(), grads


def test_grpo_loss_and_gradients_equal_the_hf_llama_with_the_same_weights(tokenizer, tmp_path):
    hf = tiny_llama(len(tokenizer))
    ours = shardkit_copy(hf)
    hf_batch, hf_loss, hf_grads = _loss_and_grads(hf, tokenizer, tmp_path, "hf")
    batch, loss, grads = _loss_and_grads(ours, tokenizer, tmp_path, "shardkit")
    assert not bool(batch["prompt_mask"].all())  # the prompts really are left-padded
    for key in ("advantages", "ref_per_token_logps"):
        if key in hf_batch:
            torch.testing.assert_close(batch[key], hf_batch[key], rtol=0, atol=TOL, msg=key)
    assert abs(loss.item() - hf_loss.item()) <= TOL * max(1.0, abs(hf_loss.item())), (loss, hf_loss)
    assert grads.keys() == hf_grads.keys()
    for name, grad in hf_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=TOL, msg=name)


def test_grpo_with_a_shardkit_llama_policy_learns_the_toy_task(tokenizer, tmp_path):
    from shardkit.models import Llama, LlamaConfig
    from shardkit.rl import GRPOConfig, GRPOTrainer
    from shardkit.utils.seeding import seed_everything

    seed_everything(0)
    model = Llama(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2,
                              num_heads=2, max_position=64, fused=False))
    prompts = [{"prompt": p} for p in ("The old house", "She opened", "In the morning", "He asked the way")] * 16
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=15, per_device_train_batch_size=16, num_generations=8,
                      max_completion_length=4, learning_rate=5e-2, lr_scheduler_type="constant", logging_steps=1,
                      report_to="none", save_strategy="no", disable_tqdm=True, seed=0, use_cpu=True, loss_type="grpo")
    trainer = GRPOTrainer(model, in_target, args=args, train_dataset=prompts, processing_class=tokenizer)
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert len(rewards) == 15
    start, end = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert start < 0.25, rewards
    assert end > start + MARGIN, rewards


def test_unsupported_sampling_settings_are_refused_by_name():
    from shardkit.models import Llama, LlamaConfig
    from shardkit.rl.rollout import llama_sampling

    model = Llama(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2))
    assert llama_sampling(model, {"do_sample": True, "temperature": 0.7, "top_p": 1.0, "top_k": 0, "min_p": None,
                                  "repetition_penalty": 1.0}) == {"temperature": 0.7, "top_k": None}
    with pytest.raises(NotImplementedError, match="top_p=0.9"):
        llama_sampling(model, {"temperature": 1.0, "top_p": 0.9})
    with pytest.raises(NotImplementedError, match="num_beams"):
        llama_sampling(model, {"temperature": 1.0, "num_beams": 2})
