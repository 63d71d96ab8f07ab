"""shardkit's GRPO and RLOO against TRL 1.16's trainers on the same tiny Llama, prompts, completions and rewards:
advantages, loss and gradients for every loss_type (CPU, fp32, 1e-5), on the first iteration (ratio 1) and on a
later one (the model moved since generation: importance ratios and clipping)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.rl.conftest import G, PROMPTS, fixed_completions, reward_first, reward_length, tiny_llama

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

TOL = 1e-5
# (loss_type, extra GRPOConfig fields): every loss type TRL 1.16 defines, and the reward scalings and masks.
CASES = [
    ("grpo", {}),
    ("dr_grpo", {"scale_rewards": "none"}),
    ("dapo", {"mask_truncated_completions": True}),
    ("bnpo", {"scale_rewards": "batch"}),
    ("cispo", {"epsilon_high": 1.5}),
    ("sapo", {}),
    ("luspo", {"importance_sampling_level": "sequence"}),
    ("vespo", {}),
    ("grpo", {"multi_objective_aggregation": "normalize_then_sum", "delta": 1.3}),
]


def _common(loss_type, extra, num_iterations):
    return dict(per_device_train_batch_size=len(PROMPTS) * G, num_generations=G, max_completion_length=6,
                loss_type=loss_type, beta=0.1, epsilon=0.05, report_to="none", gradient_checkpointing=False,
                seed=0, reward_weights=[1.0, 0.5], temperature=0.7, num_iterations=num_iterations,
                save_strategy="no", disable_tqdm=True, **extra)


def _rows():
    return [{"prompt": p} for p in PROMPTS for _ in range(G)]


def _move(model, seed=3, scale=0.05):
    """The same parameter change on both sides: the policy moved since the completions were generated."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def _grads(model):
    return {n.removeprefix("module."): p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def _trl(model, tokenizer, loss_type, extra, tmp_path, num_iterations, completions):
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False,
                          model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"}, **_common(loss_type, extra, num_iterations))
    path = tmp_path / "model"  # TRL loads its reference from the policy's path
    model.save_pretrained(path)
    trainer = trl.GRPOTrainer(model=str(path), reward_funcs=[reward_length, reward_first], args=args,
                              train_dataset=datasets.Dataset.from_list(_rows()), processing_class=tokenizer)
    trainer._generate_single_turn = lambda prompt_ids, *a, **k: (completions, None)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by TRL's training loop, which this skips
    out = trainer._generate_and_score_completions(_rows())
    if num_iterations > 1:
        _move(trainer.model)
    loss = trainer.compute_loss(trainer.model, out)
    loss.backward()
    return out, loss.detach(), _grads(trainer.model), trainer


def _ours(model, tokenizer, loss_type, extra, tmp_path, num_iterations, completions, truncated):
    from shardkit.rl import GRPOConfig, GRPOTrainer
    from shardkit.rl.rollout import Completions, tokenize_prompts

    args = GRPOConfig(output_dir=str(tmp_path / "ours"), use_cpu=True, **_common(loss_type, extra, num_iterations))
    trainer = GRPOTrainer(copy.deepcopy(model), [reward_length, reward_first], args=args, train_dataset=_rows(),
                          processing_class=tokenizer)
    trainer.model.train()
    prompt_ids = tokenize_prompts(tokenizer, [r["prompt"] for r in _rows()])
    batch = trainer.score_completions(_rows(), prompt_ids, Completions(completions, truncated))
    if num_iterations > 1:
        _move(trainer.model)
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return batch, loss.detach(), _grads(trainer.model), trainer


@pytest.mark.parametrize("num_iterations", [1, 2], ids=["first_iteration", "later_iteration"])
@pytest.mark.parametrize("loss_type,extra", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_grpo_equals_trl(tokenizer, tmp_path, loss_type, extra, num_iterations):
    model = tiny_llama(len(tokenizer))
    completions, truncated = fixed_completions(tokenizer)
    theirs, trl_loss, trl_grads, trl_trainer = _trl(model, tokenizer, loss_type, extra, tmp_path, num_iterations,
                                                    completions)
    ours, our_loss, our_grads, our_trainer = _ours(model, tokenizer, loss_type, extra, tmp_path, num_iterations,
                                                   completions, truncated)
    torch.testing.assert_close(ours["advantages"], theirs["advantages"], rtol=0, atol=TOL)
    torch.testing.assert_close(ours["completion_mask"].long(), theirs["completion_mask"].long())
    assert ("old_per_token_logps" in ours) == (theirs.get("old_per_token_logps") is not None)
    assert abs(our_loss.item() - trl_loss.item()) <= TOL * max(1.0, abs(trl_loss.item())), (our_loss, trl_loss)
    assert our_grads.keys() == trl_grads.keys()
    for name, grad in trl_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=TOL, msg=name)
    for name in ("reward", "reward_std", "frac_reward_zero_std", "rewards/reward_first/mean", "entropy", "kl",
                 "completions/mean_length", "completions/clipped_ratio"):
        ours_value = our_trainer._metrics["train"][name][-1]
        theirs_value = trl_trainer._metrics["train"][name][-1]
        assert ours_value == pytest.approx(theirs_value, abs=1e-5), name
