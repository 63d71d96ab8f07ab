"""What GRPOTrainer/RLOOTrainer refuse, by name, and the seams they take: use_vllm without vLLM, settings not
implemented, a generation batch that does not hold whole prompt groups, reward models, rollouts on the training
model, and the prompt order each rank gets (TRL's RepeatSampler dealt as Accelerate deals TRL's loader batches)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.rl.conftest import tiny_llama


def _config(tmp_path, **kw):
    from shardkit.rl import GRPOConfig

    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=3,
                report_to="none", use_cpu=True)
    return GRPOConfig(**{**base, **kw})


def _reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_use_vllm_without_vllm_names_the_package(tokenizer, tmp_path):
    from shardkit.rl import GRPOTrainer

    with pytest.raises(ImportError, match="'vllm'"):
        GRPOTrainer(tiny_llama(len(tokenizer)), _reward, args=_config(tmp_path, use_vllm=True),
                    train_dataset=[{"prompt": "a"}] * 4, processing_class=tokenizer)


def test_refusals(tokenizer, tmp_path):
    from shardkit.rl import GRPOConfig, GRPOTrainer

    with pytest.raises(ValueError, match="loss_type='dapoo'.*dapo"):
        _config(tmp_path, loss_type="dapoo")
    with pytest.raises(NotImplementedError, match="entropy_coef"):
        _config(tmp_path, entropy_coef=0.1)
    with pytest.raises(ValueError, match="num_generations"):
        _config(tmp_path, num_generations=1)
    assert GRPOConfig(output_dir=str(tmp_path), scale_rewards=False, report_to="none").scale_rewards == "none"
    from shardkit.rl import RLOOConfig

    with pytest.raises(ValueError, match="low > high"):
        RLOOConfig(output_dir=str(tmp_path), report_to="none", reward_clip_range=(1.0, -1.0))
    with pytest.raises(ValueError, match="pair of numbers"):
        RLOOConfig(output_dir=str(tmp_path), report_to="none", reward_clip_range=(1.0,))
    # TRL's rule: the generation batch (4 per device x 1 rank x steps_per_generation 1) must hold whole groups
    with pytest.raises(ValueError, match=r"generation_batch_size \(4 = .*\) must be divisible by num_generations "
                                         r"\(3\).*steps_per_generation"):
        GRPOTrainer(tiny_llama(len(tokenizer)), _reward, args=_config(tmp_path, num_generations=3),
                    train_dataset=[{"prompt": "a"}] * 4, processing_class=tokenizer)
    # a rank's share need not hold whole groups (2 per device, 4 generations on 2 ranks), only the whole batch
    config = _config(tmp_path, per_device_train_batch_size=2, num_generations=4)
    config.resolve_generation_batch(2)
    assert (config.generation_batch_size, config.steps_per_generation) == (4, 1)
    config = _config(tmp_path, per_device_train_batch_size=2, num_generations=4)
    with pytest.raises(ValueError, match=r"generation_batch_size \(6 = .* 3 data-parallel ranks .*\) must be "
                                         r"divisible by num_generations \(4\)"):
        config.resolve_generation_batch(3)
    from shardkit.rl import RLOOConfig

    with pytest.raises(ValueError, match=r"RLOOConfig: generation_batch_size \(2 = .*\) must be divisible by "
                                         r"num_generations \(4\)"):
        RLOOConfig(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=2,
                   num_generations=4).resolve_generation_batch(1)
    with pytest.raises(ValueError, match="model_init_kwargs is set but the model is already built"):
        GRPOTrainer(tiny_llama(len(tokenizer)), _reward,
                    args=_config(tmp_path, model_init_kwargs={"dtype": "bfloat16"}),
                    train_dataset=[{"prompt": "a"}] * 4, processing_class=tokenizer)


def test_rollout_on_the_training_model_and_a_reward_model(tokenizer, tmp_path):
    """A round: each prompt's num_generations completions generated on the policy (ending at EOS or cut at
    max_completion_length), scored by a callable reading a dataset column and by a sequence-classification model."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from shardkit.rl import GRPOTrainer

    torch.manual_seed(0)
    scorer = LlamaForSequenceClassification(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                                        num_hidden_layers=1, num_attention_heads=2,
                                                        num_key_value_heads=2, num_labels=1,
                                                        pad_token_id=tokenizer.pad_token_id))
    seen = {}

    def by_column(completions, target, **kwargs):
        seen["target"] = list(target)
        return [float(t) for t in target]

    rows = [{"prompt": "The old house", "target": 1}, {"prompt": "She opened the letter", "target": 2}]
    trainer = GRPOTrainer(tiny_llama(len(tokenizer)), [by_column, scorer], args=_config(tmp_path, beta=0.0,
                          per_device_train_batch_size=8, shuffle_dataset=False), train_dataset=rows,
                          processing_class=tokenizer, reward_processing_classes=[None, tokenizer])
    batches = trainer.generate_and_score(rows)
    assert len(batches) == 1 and batches[0]["completion_ids"].shape[0] == 8
    assert seen["target"] == [1] * 4 + [2] * 4  # each prompt's row repeated for its completions
    lengths = batches[0]["completion_mask"].sum(1)
    assert int(lengths.max()) <= 3 and int(lengths.min()) >= 1
    metrics = trainer._metrics["train"]
    assert metrics["rewards/by_column/mean"][-1] == pytest.approx(1.5)
    assert metrics["rewards/by_column/std"][-1] > 0 and "rewards/LlamaForSequenceClassification/mean" in metrics


def test_an_moe_models_router_aux_loss_is_never_dropped_unsaid(tokenizer, tmp_path):
    """TRL adds a Mixture-of-Experts model's router loss by default (router_aux_loss_coef=None: the model's own
    coefficient); shardkit's RL and preference trainers do not add it, so they refuse unless told 0.0, and refuse any
    other coefficient."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from shardkit.rl import GRPOTrainer, RLOOTrainer

    def qwen3_moe():
        torch.manual_seed(0)
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
            router_aux_loss_coef=0.01))

    rows = [{"prompt": "a"}] * 4
    with pytest.raises(NotImplementedError, match="router load-balancing loss.*router_aux_loss_coef=0.0"):
        GRPOTrainer(qwen3_moe(), _reward, args=_config(tmp_path), train_dataset=rows, processing_class=tokenizer)
    with pytest.raises(NotImplementedError, match="router_aux_loss_coef=0.5"):
        _config(tmp_path, router_aux_loss_coef=0.5)
    GRPOTrainer(qwen3_moe(), _reward, args=_config(tmp_path, router_aux_loss_coef=0.0), train_dataset=rows,
                processing_class=tokenizer)  # asked for explicitly: trains without it
    GRPOTrainer(tiny_llama(len(tokenizer)), _reward, args=_config(tmp_path), train_dataset=rows,
                processing_class=tokenizer)  # a dense model: nothing to add
    from shardkit.preference import CPOConfig, CPOTrainer, DPOConfig, DPOTrainer
    from shardkit.rl import RLOOConfig

    with pytest.raises(NotImplementedError, match="router load-balancing loss"):
        RLOOTrainer(qwen3_moe(), _reward, args=RLOOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4,
                                                          num_generations=4, report_to="none", use_cpu=True),
                    train_dataset=rows, processing_class=tokenizer)
    # the preference trainers follow TRL's rule too: DPO's field as GRPO's, CPO/ORPO by output_router_logits
    pairs = [{"prompt": "a", "chosen": " b", "rejected": " c"}] * 2
    with pytest.raises(NotImplementedError, match="DPOTrainer.*router_aux_loss_coef=0.0"):
        DPOTrainer(qwen3_moe(), args=DPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True),
                   train_dataset=pairs, processing_class=tokenizer)
    routed = qwen3_moe()
    routed.config.output_router_logits = True
    with pytest.raises(NotImplementedError, match="CPOTrainer.*output_router_logits=False"):
        CPOTrainer(routed, args=CPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True),
                   train_dataset=pairs, processing_class=tokenizer)


def test_ds3_gather_for_generation_false_gathers_per_layer(tokenizer, tmp_path):
    """TRL's ds3_gather_for_generation=False (do not hold the whole model gathered while generating) reaches the
    strategy as keep_unsharded=False; the default leaves the choice to it (gathered once when memory allows)."""
    from shardkit.rl import GRPOTrainer

    for flag, expected in ((False, False), (True, None)):
        trainer = GRPOTrainer(tiny_llama(len(tokenizer)), _reward,
                              args=_config(tmp_path, ds3_gather_for_generation=flag),
                              train_dataset=[{"prompt": "a"}] * 4, processing_class=tokenizer)
        seen, generate = {}, trainer.runner.generate

        def spy(model, ids, **kwargs):
            seen["keep_unsharded"] = kwargs.get("keep_unsharded", "not passed")
            return generate(model, ids, **kwargs)

        trainer.runner.generate = spy
        trainer.generate([[5, 6]])
        assert seen["keep_unsharded"] is expected


def test_reward_outputs_that_are_not_one_number_per_completion_are_named():
    """A scalar for the whole batch, a string per completion or a vector per completion is refused by the function's
    name; None, numbers, bools and one-element tensors are rewards."""
    from shardkit.rl.rollout import RewardFunctions

    def call(output):
        def batch_reward(completions, **kwargs):
            return output
        return RewardFunctions(batch_reward)(["p", "q"], ["a", "b"], [[1], [2]], [{}, {}], torch.device("cpu"), {})

    for bad, match in ((1.0, "returned a float"), ("0.5", "returned a str"), (torch.tensor(1.0), "returned a Tensor"),
                       (["0.5", "1"], "returned '0.5' for completion 0"),
                       ([torch.ones(2), torch.ones(2)], "for completion 0: a reward is a number")):
        with pytest.raises(TypeError, match=match):
            call(bad)
    rewards = call([None, True])
    assert torch.isnan(rewards[0, 0]) and rewards[1, 0] == 1.0
    assert call(torch.tensor([[0.5], [2.0]])).flatten().tolist() == [0.5, 2.0]


@pytest.mark.parametrize("per_device, spg, iterations, ranks, generations, shuffle",
                         [(2, 1, 1, 2, 4, True), (2, 3, 2, 2, 4, True), (3, 2, 1, 2, 4, True),
                          (4, 1, 1, 3, 6, False), (8, 1, 1, 2, 4, True)])
def test_each_ranks_prompts_are_trls(per_device, spg, iterations, ranks, generations, shuffle):
    """Every slot's rows over two epochs equal what TRL 1.16 hands that rank at that micro-step: its RepeatSampler
    (prompt i num_generations times in a row, one seeded generator drawing each epoch's order), cut into loader batches
    of per_device x steps_per_generation that Accelerate deals to the processes in turn. Groups spread over ranks in
    the first four layouts; in the last each rank holds whole groups, shardkit's layout before spreading."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    from shardkit.rl.trainer import RoundSlots

    rows = [{"prompt": f"p{i}"} for i in range(23)]
    share, repeats = per_device * spg, spg * iterations
    sampler = trl_utils.RepeatSampler(rows, mini_repeat_count=generations,
                                      batch_size=share * ranks // generations, repeat_count=repeats, shuffle=shuffle,
                                      seed=7)
    slots = RoundSlots(rows, generations, share, ranks, repeats, seed=7, shuffle=shuffle)
    assert len(slots) * share == len(sampler)
    first = None
    for epoch in range(2):
        stream = list(sampler)  # TRL's Trainer iterates its loader once per epoch
        first = first or stream[:share]
        batches = [stream[i:i + share] for i in range(0, len(stream), share)]
        for index in range(len(slots)):  # slot k is rank k % ranks' (k // ranks)-th micro-step; so is batch k
            slot = slots[index]
            assert slot["rank"] == index % ranks
            got = slots.completion_rows(epoch, slot["round"], slot["rank"])
            assert [row["prompt"] for row in got] == [rows[i]["prompt"] for i in batches[index]], (epoch, index)
    # a resume into an earlier epoch (or a second train()) draws that epoch's order again
    assert [row["prompt"] for row in slots.completion_rows(0, 0, 0)] == [rows[i]["prompt"] for i in first]


def test_a_resume_in_a_later_epoch_restarts_at_its_slot(tokenizer, tmp_path):
    """Each epoch draws its own prompt order (as TRL's sampler does); a run resumed from a checkpoint in the second
    epoch generates for the prompts, and ends with the weights, of the uninterrupted run."""
    from shardkit.rl import GRPOTrainer

    def run(out, resume=None):
        seen = []

        def reward(prompts, completions, **kwargs):
            seen.append(prompts[0])
            return [float(len(c)) for c in completions]

        args = _config(out, max_steps=8, save_strategy="steps", save_steps=7, learning_rate=1e-2, seed=5,
                       logging_steps=1, disable_tqdm=True)
        trainer = GRPOTrainer(tiny_llama(len(tokenizer)), reward, args=args, processing_class=tokenizer,
                              train_dataset=[{"prompt": f"prompt {i}"} for i in range(6)])
        trainer.train(resume_from_checkpoint=resume)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return seen, losses, [p.detach().clone() for p in trainer.model.parameters()]

    seen, losses, weights = run(tmp_path / "full")
    assert len(seen) == 8 and sorted(seen[:6]) == [f"prompt {i}" for i in range(6)]
    assert seen[6:8] != seen[0:2]  # the second epoch's own order (one prompt per generation batch here)
    resumed_seen, resumed_losses, resumed_weights = run(tmp_path / "resumed", tmp_path / "full" / "checkpoint-7")
    assert resumed_seen == seen[7:] and resumed_losses[-1] == losses[-1]
    assert all(torch.equal(a, b) for a, b in zip(weights, resumed_weights))


def test_what_the_online_trainers_would_not_do_as_asked_is_refused_or_said(tokenizer, tmp_path, caplog):
    """Settings the trainers do not read are refused (never ignored), data_seed orders the prompts as it orders a
    Trainer's samples, bad prompt rows fail before the first round (not when their round comes up on one rank), and
    prompts left out of every epoch (a dataset not divisible into rounds) are said."""
    import logging

    from shardkit.rl import GRPOTrainer

    with pytest.raises(NotImplementedError, match="train_sampling_strategy='sequential'.*shuffle_dataset=False"):
        _config(tmp_path, train_sampling_strategy="sequential")
    with pytest.raises(NotImplementedError, match="label_smoothing_factor=0.1"):
        _config(tmp_path, label_smoothing_factor=0.1)

    calls = []

    def reward(completions, **kwargs):
        calls.append(len(completions))
        return [0.0] * len(completions)

    def build(rows, **kw):
        return GRPOTrainer(tiny_llama(len(tokenizer)), reward, args=_config(tmp_path, max_steps=1, **kw),
                           train_dataset=rows, processing_class=tokenizer)

    rows = [{"prompt": f"p{i}"} for i in range(7)]
    for seed, data_seed in ((3, None), (3, 5)):
        trainer = build(rows, seed=seed, data_seed=data_seed)
        trainer.get_train_dataloader()
        generator = torch.Generator().manual_seed(data_seed if data_seed is not None else seed)
        assert trainer._slots.order(0) == torch.randperm(7, generator=generator).tolist()
    chat = [{"role": "user", "content": "hi"}]
    for bad, error, match in (([{"prompt": "a"}, {"prompt": None}] * 2, TypeError, "row 1: the prompt is a NoneType"),
                              ([{"prompt": "a"}, {"prompt": []}] * 2, TypeError, "row 1"),
                              ([{"prompt": "a"}, {"prompt": chat}] * 2, ValueError, "mixes text prompts and conv")):
        with pytest.raises(error, match=match):
            build(bad).train()
    assert calls == []
    with caplog.at_level(logging.WARNING, logger="shardkit.rl"):
        build(rows, per_device_train_batch_size=8).get_train_dataloader()  # 2 prompts a round: 3 rounds, 1 left
    assert "1 prompt(s) of each epoch, a different set each epoch, are not trained on" in caplog.text


def test_completions_no_reward_function_scores_are_said(tokenizer, tmp_path, caplog):
    """A completion every reward function returns None for gets advantage 0 (as in TRL) and teaches nothing: said,
    with the count over the generation batch."""
    import logging

    from shardkit.rl import GRPOTrainer

    def partial(completions, **kwargs):
        return [None if i < 3 else 1.0 for i in range(len(completions))]

    rows = [{"prompt": "The old house"}]
    trainer = GRPOTrainer(tiny_llama(len(tokenizer)), partial, args=_config(tmp_path), train_dataset=rows * 4,
                          processing_class=tokenizer)
    with caplog.at_level(logging.WARNING, logger="shardkit.rl"):
        batch = trainer.generate_and_score(rows)[0]
    assert "3 of 4 completions got None from every reward function" in caplog.text
    assert batch["advantages"].abs().sum() == 0
