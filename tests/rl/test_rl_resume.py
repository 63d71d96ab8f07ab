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


def _trainer(kind, tokenizer, out, **extra):
    from shardkit.rl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
    from shardkit.utils.seeding import seed_everything

    seed_everything(0)
    config, trainer_class = (GRPOConfig, GRPOTrainer) if kind == "grpo" else (RLOOConfig, RLOOTrainer)
    settings = dict(output_dir=str(out), max_steps=4, per_device_train_batch_size=4, num_generations=4,
                    steps_per_generation=2, max_completion_length=4, learning_rate=5e-2, lr_scheduler_type="constant",
                    logging_steps=1, report_to="none", save_strategy="steps", save_steps=1, disable_tqdm=True,
                    seed=0, use_cpu=True)
    settings.update(extra)
    return trainer_class(tiny_llama(len(tokenizer), seed=0), _reward, args=config(**settings), train_dataset=ROWS,
                         eval_dataset=EVAL, processing_class=tokenizer)


def _run(kind, tokenizer, out, resume=None, **extra):
    trainer = _trainer(kind, tokenizer, out, **extra)
    trainer.train(resume_from_checkpoint=resume)
    return trainer.state.log_history, [p.detach().clone() for p in trainer.model.parameters()]


def _train_logs(history):
    return [h for h in history if "loss" in h]


def _logs(history):
    """Every training and evaluation log, less the evaluation's timings."""
    return [{k: v for k, v in h.items() if not k.endswith(("_runtime", "_per_second"))} for h in history]


@pytest.mark.parametrize(("kind", "async_save"), [("grpo", False), ("rloo", True)])
def test_a_resume_inside_a_round_goes_on_with_its_completions(tokenizer, tmp_path, kind, async_save):
    """Two micro-steps per round, one per optimizer step: checkpoint-1 falls inside the first round. The resumed run
    trains step 2 on the completions the first round generated (not new ones from the moved weights) and logs, at
    logging_steps=2, the first round's rewards with the second step's: its logs and weights are the uninterrupted
    run's. With async_save too: the round is the one at the save, not what the background write sees later."""
    full, weights = _run(kind, tokenizer, tmp_path / "full", logging_steps=2, async_save=async_save)
    round_entry = _round_entry(tmp_path / "full" / "checkpoint-1")
    assert round_entry["round"]["used"] == 1 and round_entry["metrics"]["reward"]
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


def _round_entry(checkpoint, rank=0):
    """Rank ``rank``'s round state in ``checkpoint``: an entry of its manifest (no file beside it)."""
    from shardkit.checkpoint import CheckpointReader, rank_entry

    assert not list(checkpoint.glob("rl_round*.pt"))
    with CheckpointReader(checkpoint) as reader:
        return reader.read_state(rank_entry("rl_round", rank))


def test_a_failure_at_any_point_of_a_save_never_publishes_a_checkpoint_without_its_round(tokenizer, tmp_path,
                                                                                          monkeypatch):
    """The round is an entry of the Runner's own atomic save. A failure at each write of the save, at each step of the
    publication (the checkpoint module's fault points: where a kill test stops the process), and after the publication
    (Hugging Face's files, trainer_state.json), blocking and in the background: either nothing is published, or the
    published checkpoint holds the round as it was at the save (not a later one: the background write runs after the
    trainer has moved its round on)."""
    import threading

    from shardkit.checkpoint import CheckpointError, CheckpointWriter, publish, writer
    from shardkit.checkpoint.format import MANIFEST
    from shardkit.trainer.checkpointing import Checkpointer

    trainer = _trainer("grpo", tokenizer, tmp_path / "run", max_steps=1, save_strategy="no")
    trainer.train()
    held = trainer._round
    assert 0 < held.used < trainer.round_repeats  # the save falls inside the round
    at_save = (held.used, [{k: v.clone() for k, v in b.items()} for b in held.batches])
    methods = ["write_tensors", "write_json", "write_state", "write_shard", "write_shard_streamed", "_write_part"]
    steps = ["manifest-written", "tmp-sealed", "renamed", "latest-written", "latest-moved", "old-moved"]
    calls: list[str] = []

    def save(out, fail_at, async_save):
        calls.clear()
        first_write = threading.Event()

        def point(name, original=None):
            def reached(*args, **kwargs):
                if async_save and threading.current_thread() is not threading.main_thread():
                    first_write.wait(30)  # the trainer moves its round on before the background write
                calls.append(name)
                if len(calls) == fail_at:
                    raise OSError(f"injected at {name}")
                return original(*args, **kwargs) if original is not None else None
            return reached

        trainer.args.output_dir, trainer.args.async_save = str(out), async_save
        with monkeypatch.context() as patch:
            for name in methods:
                patch.setattr(CheckpointWriter, name, point(name, getattr(CheckpointWriter, name)))
            for module in (writer, publish):
                patch.setattr(module, "fault_point", lambda step: point(step)() if step in steps else None)
            patch.setattr(Checkpointer, "_finish_save", point("after publication", Checkpointer._finish_save))
            try:
                trainer.checkpointer.save(trainer.checkpoint_parts())
                held.used += 1  # what the next micro-step does; the checkpoint must not see it
                held.batches[0]["advantages"].add_(1.0)
                first_write.set()
                trainer.runner.wait_for_save()
                failed = False
            except (OSError, CheckpointError):
                failed = True
            finally:
                first_write.set()
                held.used, held.batches = at_save[0], [{k: v.clone() for k, v in b.items()} for b in at_save[1]]
        return failed

    for async_save in (False, True):
        assert not save(tmp_path / f"whole-{async_save}", 0, async_save)
        points = list(calls)
        assert "write_state" in points and "renamed" in points and points[-1] == "after publication"
        for fail_at in range(1, len(points) + 1):
            out = tmp_path / f"{async_save}-{fail_at}"
            assert save(out, fail_at, async_save), points[fail_at - 1]
            if not (out / "checkpoint-1" / MANIFEST).is_file():
                assert fail_at - 1 < points.index("renamed"), points[fail_at - 1]  # only a failure before it
                continue
            saved = _round_entry(out / "checkpoint-1")["round"]
            assert saved["used"] == at_save[0], points[fail_at - 1]
            assert all(torch.equal(saved["batches"][i][k], v) for i, b in enumerate(at_save[1]) for k, v in b.items())


def test_a_damaged_foreign_or_missing_round_entry_is_a_named_error(tokenizer, tmp_path, monkeypatch):
    """A cut-short round entry, one that is not a round state, and a rank's entry missing from a checkpoint saved with
    round state are each a CheckpointError naming the entry and the fix, before training goes on."""
    import json

    from shardkit.checkpoint import CheckpointError
    from shardkit.checkpoint.format import MANIFEST
    from shardkit.rl.rounds import RoundState

    trainer = _trainer("grpo", tokenizer, tmp_path / "run", max_steps=1)
    trainer.train()
    checkpoint = tmp_path / "run" / "checkpoint-1"
    trainer.checkpointer.load(checkpoint, trainer.checkpoint_parts())  # whole, it loads
    assert trainer._resumed_round is not None and trainer._resumed_round.used == 1

    monkeypatch.setattr(RoundState, "state_dict", lambda self: {"world_size": "1"})
    trainer.args.output_dir = str(tmp_path / "foreign")
    trainer.checkpointer.save(trainer.checkpoint_parts())
    with pytest.raises(CheckpointError, match=r"rl_round\.rank00000\): not an RL round state written by shardkit.*"
                                              r"resume from another checkpoint"):
        trainer.checkpointer.load(tmp_path / "foreign" / "checkpoint-1", trainer.checkpoint_parts())

    manifest = json.loads((checkpoint / MANIFEST).read_text())
    tensors = checkpoint / manifest["entries"]["rl_round.rank00000"]["file"]
    data = tensors.read_bytes()
    tensors.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"rl_round\.rank00000"):
        trainer.checkpointer.load(checkpoint, trainer.checkpoint_parts())
    tensors.write_bytes(data)

    del manifest["entries"]["rl_round.rank00000"]
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"rank 0's RL round state \(rl_round\.rank00000\) is missing.*"
                                              r"resume from another checkpoint"):
        trainer.checkpointer.load(checkpoint, trainer.checkpoint_parts())
