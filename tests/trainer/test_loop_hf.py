"""The training loop as Hugging Face's Trainer runs it: step counting at epoch ends, logs, resume, schedules,
model_init, auto_find_batch_size, evaluation hooks (issue 23 item 1)."""

import math

import pytest
import torch
from trainer_tiny import Line, Regression

from shardkit.trainer import Trainer, TrainerCallback, TrainingArguments


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, learning_rate=0.1, optim="sgd",
                lr_scheduler_type="constant", max_grad_norm=0, save_strategy="no", disable_tqdm=True, seed=0,
                train_sampling_strategy="sequential", num_train_epochs=1, logging_steps=1)
    return TrainingArguments(**{**base, **kw})


def test_a_short_last_window_steps_with_its_own_mean(tmp_path):
    data = Regression(18)  # 9 batches of 2, windows of 2: four full windows and one of a single batch
    trainer = Trainer(Line(), _args(tmp_path, gradient_accumulation_steps=2), train_dataset=data)
    out = trainer.train()
    assert out.global_step == 5 and trainer.state.epoch == 1.0
    model = Line()  # the same by hand: each window's loss is the mean of its micro-batch means
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    for start in range(0, 18, 4):
        batches = [(x[i:i + 2], y[i:i + 2]) for i in range(start, min(start + 4, 18), 2)]
        loss = sum(model(bx, by)[0] for bx, by in batches) / len(batches)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.allclose(trainer.model.a, model.a) and torch.allclose(trainer.model.b, model.b)


def test_an_epoch_shorter_than_a_window_takes_a_step(tmp_path):
    data = Regression(8)  # 4 batches, windows of 5
    assert Trainer(Line(), _args(tmp_path, gradient_accumulation_steps=5, max_steps=3),
                   train_dataset=data).train().global_step == 3
    assert Trainer(Line(), _args(tmp_path, gradient_accumulation_steps=5, num_train_epochs=2),
                   train_dataset=data).train().global_step == 2


def _without_timing(history):
    timing = ("train_runtime", "train_samples_per_second", "train_steps_per_second")
    return [{k: v for k, v in entry.items() if k not in timing} for entry in history]


def test_logs_have_no_timing_so_a_resumed_history_equals_the_whole_run(tmp_path):
    kw = dict(save_strategy="steps", save_steps=3, train_sampling_strategy="random", num_train_epochs=2)
    full = Trainer(Line(), _args(tmp_path / "a", **kw), train_dataset=Regression(16))
    full.train()
    assert all(set(h) <= {"loss", "grad_norm", "learning_rate", "epoch", "step"} for h in full.state.log_history[:-1])
    resumed = Trainer(Line(), _args(tmp_path / "a", **kw), train_dataset=Regression(16))
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-6"))
    assert _without_timing(resumed.state.log_history) == _without_timing(full.state.log_history)
    assert resumed.model.a.item() == full.model.a.item()


class _NaNAfter(torch.utils.data.Dataset):
    def __init__(self, good: int):
        self.base, self.good = Regression(16), good

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        sample = dict(self.base[i])
        if i >= self.good:
            sample["input_x"] = float("nan")
        return sample


@pytest.mark.parametrize("nan_filter", [True, False])
def test_nan_inf_filter(tmp_path, nan_filter):
    trainer = Trainer(Line(), _args(tmp_path, logging_nan_inf_filter=nan_filter), train_dataset=_NaNAfter(8))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 8 and math.isfinite(losses[0])
    assert all(math.isfinite(v) for v in losses) == nan_filter


def test_a_second_train_with_model_init_honours_a_changed_seed(tmp_path):
    trainer = Trainer(model_init=Line, args=_args(tmp_path, train_sampling_strategy="random"),
                      train_dataset=Regression(16))
    trainer.train()
    first = trainer.model.a.item()
    trainer.args.seed = 7
    trainer.train()
    fresh = Trainer(model_init=Line, args=_args(tmp_path, train_sampling_strategy="random", seed=7),
                    train_dataset=Regression(16))
    fresh.train()
    assert trainer.model.a.item() == fresh.model.a.item() != first


def test_batch_eval_metrics_get_tensors_and_evaluate_uses_the_loader_hook(tmp_path):
    seen = []

    def metrics(pred, compute_result):
        seen.append(type(pred.predictions))
        return {"n": float(len(seen))} if compute_result else None

    class OwnLoader(Trainer):
        def get_eval_dataloader(self, eval_dataset=None):
            return super().get_eval_dataloader(Regression(6))  # 3 batches whatever eval_dataset is

    trainer = OwnLoader(Line(), _args(tmp_path, batch_eval_metrics=True, per_device_eval_batch_size=2),
                        eval_dataset=Regression(40), compute_metrics=metrics)
    out = trainer.evaluate()
    assert seen == [torch.Tensor] * 3 and out["eval_n"] == 3.0


def test_a_metric_driven_scheduler_gets_the_metric(tmp_path):
    class OnMetric:
        def __init__(self, optimizer):
            self.optimizer, self.got = optimizer, []

        def step(self, metrics):
            self.got.append(metrics)

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    model = Line()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = OnMetric(optimizer)
    trainer = Trainer(model, _args(tmp_path, eval_strategy="epoch", num_train_epochs=2, metric_for_best_model="loss"),
                      train_dataset=Regression(8), eval_dataset=Regression(8), optimizers=(optimizer, scheduler))
    trainer.train()
    assert scheduler.got == [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]


def test_cosine_warmup_with_min_lr_and_greedy(tmp_path):
    args = _args(tmp_path, lr_scheduler_type="cosine_warmup_with_min_lr", lr_scheduler_kwargs={"min_lr": 1e-5},
                 learning_rate=0.2, warmup_steps=2, optim="adamw_torch")
    trainer = Trainer(Line(), args, train_dataset=Regression(8))
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    lrs = []
    for _ in range(10):
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.lr_scheduler.step()
    assert (lrs[0], lrs[1], lrs[-1]) == (0.1, 0.2, 1e-05)
    from transformers.optimization import GreedyLR

    greedy = Trainer(Line(), _args(tmp_path, lr_scheduler_type="greedy", eval_strategy="epoch", num_train_epochs=4,
                                   lr_scheduler_kwargs={"patience": 1, "factor": 0.5}, metric_for_best_model="loss"),
                     train_dataset=Regression(8), eval_dataset=Regression(8))
    greedy.train()
    assert isinstance(greedy.lr_scheduler, GreedyLR) and greedy.state.global_step == 16


class _OutOfMemoryAt(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.train_batch_size >= 16:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


class _OutOfMemoryMidWindow(TrainerCallback):
    def on_substep_end(self, args, state, control, **kwargs):  # after the first of two backwards of a window
        if state.train_batch_size >= 8:
            raise torch.OutOfMemoryError("out of memory")


def test_auto_find_batch_size_retries_with_a_smaller_batch_and_resumes_with_it(tmp_path):
    args = _args(tmp_path, per_device_train_batch_size=16, auto_find_batch_size=True, max_steps=2,
                 save_strategy="steps", save_steps=1)
    trainer = Trainer(Line(), args, train_dataset=Regression(64), callbacks=[_OutOfMemoryAt()])
    trainer.train()
    assert trainer._train_batch_size == 14 and trainer.state.global_step == 2
    resumed = Trainer(Line(), _args(tmp_path, per_device_train_batch_size=16, auto_find_batch_size=True, max_steps=3,
                                    save_strategy="steps", save_steps=1), train_dataset=Regression(64))
    resumed.train(resume_from_checkpoint=True)
    assert resumed._train_batch_size == 14 and resumed.state.global_step == 3
    mid = Trainer(Line(), _args(tmp_path / "mid", per_device_train_batch_size=8, auto_find_batch_size=True,
                                max_steps=2, gradient_accumulation_steps=2), train_dataset=Regression(64),
                  callbacks=[_OutOfMemoryMidWindow()])
    mid.train()
    assert mid._train_batch_size == 7 and mid.state.global_step == 2
    with pytest.raises(RuntimeError, match="out of memory"):  # without the flag the error reaches the user
        Trainer(Line(), _args(tmp_path, per_device_train_batch_size=16, max_steps=1), train_dataset=Regression(64),
                callbacks=[_OutOfMemoryAt()]).train()


class _LineOutOfMemoryInBackward(Line):
    """Runs out of memory inside backward (so inside runner.backward) while the batch is 8 or more."""

    def forward(self, input_x, labels=None):
        out = super().forward(input_x, labels)
        if self.training and input_x.shape[0] >= 8:
            def fail(grad):
                raise torch.OutOfMemoryError("out of memory (test)")
            out[-1].register_hook(fail)
        return out


def test_auto_find_batch_size_writes_no_oom_report_for_what_it_recovers_from(tmp_path):
    trainer = Trainer(_LineOutOfMemoryInBackward(), _args(tmp_path, per_device_train_batch_size=8,
                                                          auto_find_batch_size=True, max_steps=2),
                      train_dataset=Regression(32))
    trainer.train()
    assert trainer._train_batch_size == 7 and trainer.state.global_step == 2
    assert not list(trainer.runner.logging_dir.glob("oom_report.rank*.json"))
    # without the flag the same error is reported (and reaches the user)
    plain = Trainer(_LineOutOfMemoryInBackward(), _args(tmp_path / "plain", per_device_train_batch_size=8,
                                                        max_steps=1), train_dataset=Regression(32))
    with pytest.raises(torch.OutOfMemoryError):
        plain.train()
    assert len(list(plain.runner.logging_dir.glob("oom_report.rank*.json"))) == 1


def test_public_methods(tmp_path, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    trainer = Trainer(model, _args(tmp_path, optim="adamw_torch", weight_decay=0.1))
    with pytest.raises(ValueError, match="optimizer is None"):
        trainer.get_learning_rates()
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    assert trainer.get_learning_rates() == [0.1, 0.1] and len(trainer.get_optimizer_group()) == 2
    assert trainer.get_optimizer_group(model[0].bias)["weight_decay"] == 0.0
    assert trainer.get_decay_parameter_names(model) == ["0.weight"]
    assert trainer.get_num_trainable_parameters() == 4 * 3 + 3 + 3 + 3 and trainer.is_world_process_zero()
    assert trainer.model_wrapped is model and not trainer.is_fsdp_enabled and trainer.deepspeed is None
    trainer.log_metrics("train", {"train_loss": 1.5, "train_runtime": 2.123456})
    assert "***** train metrics *****" in capsys.readouterr().out
    trainer.save_metrics("train", {"train_loss": 1.5})
    trainer.save_metrics("eval", {"eval_loss": 2.0})
    trainer.save_state()
    import json

    out = tmp_path / "out"
    assert json.loads((out / "all_results.json").read_text()) == {"train_loss": 1.5, "eval_loss": 2.0}
    assert (out / "trainer_state.json").is_file()


def test_include_for_metrics_and_unconcatenated_batches(tmp_path):
    got = {}

    def metrics(pred):
        got.update(inputs=pred.inputs, losses=pred.losses, predictions=pred.predictions)
        return {}

    class WithIds(Line):
        main_input_name = "input_x"

    trainer = Trainer(WithIds(), _args(tmp_path, include_for_metrics=["inputs", "loss"], per_device_eval_batch_size=4,
                                       eval_do_concat_batches=False), compute_metrics=metrics)
    trainer.evaluate(Regression(8))
    assert got["inputs"].shape == (8,) and got["losses"].shape == (8,)
    assert isinstance(got["predictions"], list) and len(got["predictions"]) == 2
