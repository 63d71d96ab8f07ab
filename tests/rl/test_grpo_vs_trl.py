"""shardkit's GRPO and RLOO against TRL 1.16's trainers on the same tiny Llama, prompts, completions and rewards:
advantages, loss and gradients for every loss_type (CPU, fp32, 1e-5), on the first iteration (ratio 1) and on a
later one (the model moved since generation: importance ratios and clipping); and GRPO's clipped objective on a
later iteration against a hand computation from the full logits."""

from __future__ import annotations

import pytest
import torch

from tests.rl.conftest import PROMPTS, G, fixed_completions, reward_first, reward_length, tiny_llama

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
GRPO_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "rewards/reward_first/mean", "rewards/reward_first/std",
                "entropy", "kl", "completions/mean_length", "completions/clipped_ratio")


def _common(extra):
    return dict(per_device_train_batch_size=len(PROMPTS) * G, num_generations=G, max_completion_length=6,
                epsilon=0.05, report_to="none", seed=0, reward_weights=[1.0, 0.5], temperature=0.7,
                num_iterations=2, save_strategy="no", disable_tqdm=True, **extra)


def _rows():
    return [{"prompt": p} for p in PROMPTS for _ in range(G)]


def _move(model, seed=3, scale=0.05):
    """The same parameter change on both sides: the policy moved since the completions were generated."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=gen) * scale)
            p.grad = None


def _loss_and_grads(trainer, model, batch):
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _two_iterations(trainer, model, batch):
    """(loss, grads) at generation (iteration 1) and after the model moved (iteration 2)."""
    first = _loss_and_grads(trainer, model, batch)
    _move(model)
    return first, _loss_and_grads(trainer, model, batch)


def _trl(kind, model, tokenizer, extra, tmp_path):
    path = tmp_path / "model"  # TRL loads its reference from the policy's path
    model.save_pretrained(path)
    config, trainer_cls = (trl.GRPOConfig, trl.GRPOTrainer) if kind == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)
    args = config(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, gradient_checkpointing=False,
                  model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"}, **_common(extra))
    trainer = trainer_cls(model=str(path), reward_funcs=[reward_length, reward_first], args=args,
                          train_dataset=datasets.Dataset.from_list(_rows()), processing_class=tokenizer)
    completions, _ = fixed_completions(tokenizer)
    fixed = (completions, None) if kind == "grpo" else completions  # RLOO's returns the ids alone
    trainer._generate_single_turn = lambda prompt_ids, *a, **k: fixed
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by TRL's training loop, which this skips
    out = trainer._generate_and_score_completions(_rows())
    return out, _two_iterations(trainer, trainer.model, out), trainer


def _ours(kind, model, tokenizer, extra, tmp_path, iterate=True):
    from shardkit.rl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
    from shardkit.rl.rollout import Completions, tokenize_prompts

    config, trainer_cls = (GRPOConfig, GRPOTrainer) if kind == "grpo" else (RLOOConfig, RLOOTrainer)
    args = config(output_dir=str(tmp_path / "ours"), use_cpu=True, **_common(extra))
    trainer = trainer_cls(model, [reward_length, reward_first], args=args, train_dataset=_rows(),
                          processing_class=tokenizer)
    trainer.model.train()
    prompt_ids = tokenize_prompts(tokenizer, [r["prompt"] for r in _rows()])
    batch = trainer.score_completions(_rows(), prompt_ids, Completions(*fixed_completions(tokenizer)))
    return batch, (_two_iterations(trainer, trainer.model, batch) if iterate else None), trainer


def _compare(ours, theirs, metrics):
    (our_batch, our_runs, our_trainer), (trl_batch, trl_runs, trl_trainer) = ours, theirs
    torch.testing.assert_close(our_batch["advantages"], trl_batch["advantages"], rtol=0, atol=TOL)
    torch.testing.assert_close(our_batch["completion_mask"].long(), trl_batch["completion_mask"].long())
    for (our_loss, our_grads), (trl_loss, trl_grads) in zip(our_runs, trl_runs):
        assert abs(our_loss.item() - trl_loss.item()) <= TOL * max(1.0, abs(trl_loss.item())), (our_loss, trl_loss)
        assert our_grads.keys() == trl_grads.keys()
        for name, grad in trl_grads.items():
            torch.testing.assert_close(our_grads[name], grad, rtol=1e-4, atol=TOL, msg=name)
    assert our_runs[0][0] != our_runs[1][0]  # the second iteration saw a moved model
    for name in metrics:
        assert our_trainer._metrics["train"][name][-1] == pytest.approx(trl_trainer._metrics["train"][name][-1],
                                                                        abs=1e-5), name


@pytest.mark.parametrize("loss_type,extra", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_grpo_equals_trl(tokenizer, tmp_path, loss_type, extra):
    model = tiny_llama(len(tokenizer))
    extra = {"loss_type": loss_type, "beta": 0.1, **extra}
    theirs = _trl("grpo", model, tokenizer, extra, tmp_path)
    ours = _ours("grpo", model, tokenizer, extra, tmp_path)
    assert "old_per_token_logps" in ours[0] and theirs[0].get("old_per_token_logps") is not None
    _compare(ours, theirs, GRPO_METRICS)


@pytest.mark.parametrize("extra", [{}, {"normalize_advantages": True, "reward_clip_range": (0.0, 1.5)}],
                         ids=["default", "normalized_clipped"])
def test_rloo_equals_trl(tokenizer, tmp_path, extra):
    model = tiny_llama(len(tokenizer))
    theirs = _trl("rloo", model, tokenizer, extra, tmp_path)
    ours = _ours("rloo", model, tokenizer, extra, tmp_path)
    _compare(ours, theirs, ("reward", "kl", "entropy", "frac_reward_zero_std", "clip_ratio/region_mean"))


def test_later_iteration_matches_hand_computation(tokenizer, tmp_path):
    """num_iterations=2: on the first iteration the ratio is exactly 1; after the model moved, the loss is the clipped
    objective computed here from the full logits: mean over sequences of the token mean of -min(rA, clip(r)A)."""
    from shardkit.rl.losses import policy_loss

    model = tiny_llama(len(tokenizer))
    batch, _, trainer = _ours("grpo", model, tokenizer, {"loss_type": "grpo", "beta": 0.0}, tmp_path, iterate=False)
    mask = batch["completion_mask"].float()
    with torch.no_grad():  # the first iteration: the policy scores exactly what it scored at generation
        now = trainer._log_probs(trainer.model, trainer.model, batch)[0]
    first = policy_loss(now, batch["old_per_token_logps"], batch["advantages"], mask, trainer.args.loss_settings())
    assert torch.equal(first.ratio[mask.bool()], torch.ones_like(first.ratio[mask.bool()]))
    _move(trainer.model)
    loss = trainer.compute_loss(trainer.model, batch).detach()
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, attention_mask=attention).logits.float() / trainer.args.temperature
    width = batch["completion_ids"].shape[1]
    logps = torch.log_softmax(logits[:, -width - 1:-1], -1).gather(-1, batch["completion_ids"][..., None])[..., 0]
    ratio = torch.exp(logps - batch["old_per_token_logps"])
    advantages = batch["advantages"][:, None]
    per_token = -torch.min(ratio * advantages, ratio.clamp(1 - 0.05, 1 + 0.05) * advantages)
    expected = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    clipped = ((ratio - 1).abs() > 0.05) & mask.bool()
    assert clipped.any() and not clipped.all()  # the case exercises the clip
    assert abs(loss.item() - expected.item()) <= TOL
