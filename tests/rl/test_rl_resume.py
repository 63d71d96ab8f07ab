"""Exact resumption of GRPO/RLOO runs on one process (tiny Llama): a checkpoint saved inside a generation round
(more micro-steps per round than per optimizer step) and right after an in-training evaluation resumes to the
uninterrupted run's logs and weights."""

from __future__ import annotations

import pytest
import torch

from tests.rl.conftest import tiny_llama

ROWS = [{"prompt": p} for p in ("The old house", "She opened", "In the morning", "He asked the way")] * 2
EVAL = [{"prompt": p} for p in ("When the bell rang", "At night")]


def _reward(completion_ids, **kwargs):
    return [sum(100 <= t < 150 for t in c) / len(c) for c in completion_ids]


def _run(kind, tokenizer, out, resume=None, **extra):
    from shardkit.rl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
    from shardkit.utils.seeding import seed_everything

    seed_everything(0)
    config, trainer_class = (GRPOConfig, GRPOTrainer) if kind == "grpo" else (RLOOConfig, RLOOTrainer)
    settings = dict(output_dir=str(out), max_steps=4, per_device_train_batch_size=4, num_generations=4,
                    steps_per_generation=2, max_completion_length=4, learning_rate=5e-2, lr_scheduler_type="constant",
                    logging_steps=1, report_to="none", save_strategy="steps", save_steps=1, disable_tqdm=True,
                    seed=0, use_cpu=True)
    settings.update(extra)
    trainer = trainer_class(tiny_llama(len(tokenizer), seed=0), _reward, args=config(**settings), train_dataset=ROWS,
                            eval_dataset=EVAL, processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=resume)
    return trainer.state.log_history, [p.detach().clone() for p in trainer.model.parameters()]


def _train_logs(history):
    return [h for h in history if "loss" in h]


def _logs(history):
    """Every training and evaluation log, less the evaluation's timings."""
    return [{k: v for k, v in h.items() if not k.endswith(("_runtime", "_per_second"))} for h in history]


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_a_resume_inside_a_round_goes_on_with_its_completions(tokenizer, tmp_path, kind):
    """Two micro-steps per round, one per optimizer step: checkpoint-1 falls inside the first round. The resumed run
    trains step 2 on the completions the first round generated (not new ones from the moved weights) and logs, at
    logging_steps=2, the first round's rewards with the second step's: its logs and weights are the uninterrupted
    run's."""
    full, weights = _run(kind, tokenizer, tmp_path / "full", logging_steps=2)
    resumed, resumed_weights = _run(kind, tokenizer, tmp_path / "resumed", tmp_path / "full" / "checkpoint-1",
                                    logging_steps=2)
    assert len(_train_logs(full)) == 2 and "reward" in _train_logs(full)[0]
    assert _train_logs(resumed) == _train_logs(full)
    assert all(torch.equal(a, b) for a, b in zip(weights, resumed_weights))


def test_a_resume_right_after_an_evaluation_is_exact(tokenizer, tmp_path):
    """Evaluating and saving at every step (eval, then save): resumed from checkpoint-1 (inside a round, saved right
    after the evaluation), the run logs the uninterrupted run's training losses, rewards and evaluations, and ends
    with its weights."""
    extra = dict(eval_strategy="steps", eval_steps=1, num_generations_eval=2, per_device_eval_batch_size=4)
    full, weights = _run("grpo", tokenizer, tmp_path / "full", **extra)
    resumed, resumed_weights = _run("grpo", tokenizer, tmp_path / "resumed", tmp_path / "full" / "checkpoint-1",
                                    **extra)
    assert [h["step"] for h in full if "eval_loss" in h] == [1, 2, 3, 4]
    assert len({h["loss"] for h in _train_logs(full)}) > 1
    assert _logs(resumed) == _logs(full)
    assert all(torch.equal(a, b) for a, b in zip(weights, resumed_weights))


def test_a_resume_inside_an_epoch_with_another_prompt_layout_is_refused(tokenizer, tmp_path):
    """Another seed (or batch, generations, ...) would deal the rest of the epoch's prompts differently from the
    checkpoint's run, repeating some and skipping others: refused by name, before anything trains."""
    _run("grpo", tokenizer, tmp_path / "full", max_steps=1, steps_per_generation=1)
    with pytest.raises(ValueError, match=r"another prompt layout \(seed 0 -> 1\)"):
        _run("grpo", tokenizer, tmp_path / "other", tmp_path / "full" / "checkpoint-1", max_steps=2,
             steps_per_generation=1, seed=1)


def test_a_damaged_round_file_is_a_named_error_and_no_temporary_is_left(tokenizer, tmp_path):
    """The round state is renamed into place whole (no temporary left in the checkpoint); a truncated or foreign one
    is a CheckpointError naming the file, not an unpickling traceback or a KeyError."""
    from shardkit.checkpoint import CheckpointError

    _run("grpo", tokenizer, tmp_path / "full", max_steps=1)
    checkpoint = tmp_path / "full" / "checkpoint-1"
    file = checkpoint / "rl_round-rank0.pt"
    assert file.is_file() and not list(checkpoint.glob(".*.tmp"))
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"rl_round-rank0\.pt: not a readable RL round state"):
        _run("grpo", tokenizer, tmp_path / "resumed", checkpoint, max_steps=2)
    torch.save({"world_size": "1"}, file)
    with pytest.raises(CheckpointError, match=r"rl_round-rank0\.pt: not an RL round state written by shardkit"):
        _run("grpo", tokenizer, tmp_path / "resumed", checkpoint, max_steps=2)
