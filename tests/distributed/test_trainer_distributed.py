"""Trainer on 2 CPU ranks: exact loss under accumulation across ranks, loss trace equal to a hand-written
Runner loop, uneven eval counted once (over a stream too, as on one rank), and mid-epoch resume equal to the
uninterrupted run (DDP, FSDP, ZeRO-2)."""

from pathlib import Path

import pytest
import torch
from harness import run_distributed
from torch import nn
from torch.utils.data import DataLoader
from trainer_fixtures import (
    FixedRows,
    GradCatcher,
    LogitsOnly,
    StopAt,
    SumLossLM,
    VarLen,
    full_state_dict,
    logged_losses,
    pad_collate,
    text_data,
)

from shardkit import Runner
from shardkit.models import Llama, LlamaConfig
from shardkit.strategies import strategy_from_name
from shardkit.trainer import Trainer, TrainingArguments

TINY = LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, max_position=16)


def _llama():
    torch.manual_seed(3)
    return Llama(TINY)


def _args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1,
                save_strategy="no", disable_tqdm=True, seed=0, warmup_steps=1, max_steps=6, optim="adamw_torch")
    return TrainingArguments(**{**base, **kw})


def _big_batch_grads(factory, data) -> dict[str, torch.Tensor]:
    model = factory()
    batch = pad_collate([data[i] for i in range(len(data))])
    if isinstance(model, LogitsOnly):
        logits = model(batch["input_ids"])
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 32), batch["labels"][:, 1:].reshape(-1),
                                           ignore_index=-100)
    else:
        loss = model(**batch)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _accumulation_gap(out: Path, factory) -> float:
    """2 ranks x GA 4 x batch 2 of padded variable-length rows: largest gap to the gradients of one batch of 16."""
    data, catcher = VarLen(16), GradCatcher()
    args = _args(out, gradient_accumulation_steps=4, max_steps=1, max_grad_norm=0.0, remove_unused_columns=False)
    Trainer(factory(), args, train_dataset=data, data_collator=pad_collate, callbacks=[catcher],
            strategy=strategy_from_name("ddp")).train()
    expected = _big_batch_grads(factory, data)
    return max(float((catcher.grads[n] - g).abs().max() / g.abs().max()) for n, g in expected.items())


def _trace_pair(out: Path) -> tuple[list[float], list[float], bool]:
    """The Trainer's logged losses and a hand-written DDP Runner loop's, on the same data and settings."""
    data = text_data(64)
    args = _args(out, gradient_accumulation_steps=2, max_steps=4, lr_scheduler_type="constant", warmup_steps=0,
                 max_grad_norm=1.0, weight_decay=0.01)
    trainer = Trainer(_llama(), args, train_dataset=data, strategy=strategy_from_name("ddp"))
    trainer.train()
    runner = Runner(strategy_from_name("ddp"), gradient_accumulation_steps=2, seed=0)
    model = _llama()
    groups = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.01},
              {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    model, opt = runner.setup(model, torch.optim.AdamW(groups, lr=1e-2))
    loader = runner.setup_dataloader(DataLoader(data, batch_size=2, shuffle=True))
    losses, window = [], torch.zeros(1, dtype=torch.float64)
    for batch in loader:
        loss = model(batch["input_ids"], batch["labels"])
        runner.backward(loss)
        window += loss.detach().double() / (2 * runner.world_size)
        if runner.sync_gradients:
            runner.clip_gradients(1.0)
            runner.step()
            losses.append(round(float(runner.all_reduce(window, "sum")), 6))
            window = torch.zeros(1, dtype=torch.float64)
            if len(losses) == 4:
                break
    ours = full_state_dict(trainer.runner, trainer.model)
    same = all(torch.equal(ours[k], v) for k, v in full_state_dict(runner, model).items())
    return logged_losses(trainer), losses, same


def _uneven_eval(out: Path) -> tuple[int, float, float]:
    """7 eval rows on 2 ranks in batches of 2: compute_metrics must see each row once."""
    seen = {}

    def metrics(pred):
        seen["rows"] = pred.label_ids.shape[0]
        return {"rows": float(pred.label_ids.shape[0])}

    data = VarLen(7)
    args = _args(out, per_device_eval_batch_size=2, remove_unused_columns=False)
    trainer = Trainer(SumLossLM(), args, eval_dataset=data, data_collator=pad_collate, compute_metrics=metrics,
                      strategy=strategy_from_name("ddp"))
    result = trainer.evaluate()
    return seen["rows"], result["eval_rows"], result["eval_loss"]


def _stream_metrics(pred):
    hits = pred.predictions[:, :-1].argmax(-1) == pred.label_ids[:, 1:]
    return {"rows": float(pred.label_ids.shape[0]), "accuracy": float(hits.mean()),
            "logit_sum": float(pred.predictions.sum())}


def _stream_eval(out: Path, strategy=None) -> dict:
    """evaluate() and predict() over streams of 9 and 7 rows in batches of 2: on 2 ranks neither length divides
    by 4, so each rank's last batch carries a repeat (9: a batch of that repeat alone; 7: beside a real row)."""
    args = _args(out, per_device_eval_batch_size=2, remove_unused_columns=False)
    trainer = Trainer(SumLossLM(), args, data_collator=pad_collate, compute_metrics=_stream_metrics, strategy=strategy)
    result = {"eval": trainer.evaluate(FixedRows(9))}
    for n in (9, 7):
        predicted = trainer.predict(FixedRows(n))
        result[f"predict{n}"] = (predicted.predictions.shape[0], predicted.label_ids.shape[0], predicted.metrics)
    return result


def _exactness_worker(out: str) -> dict:
    out = Path(out)
    gaps = {f.__name__: _accumulation_gap(out / f.__name__, f) for f in (SumLossLM, LogitsOnly, _llama)}
    trace = _trace_pair(out / "trace")
    rows = _uneven_eval(out / "eval")
    stream = _stream_eval(out / "stream", strategy_from_name("ddp"))
    return {"gaps": gaps, "trace": trace, "rows": rows, "stream": stream}


def _same_metrics(ours: dict, one_rank: dict) -> None:
    timed = ("_runtime", "_per_second")
    assert {k for k in ours if not k.endswith(timed)} == {k for k in one_rank if not k.endswith(timed)}
    for key, value in one_rank.items():
        if not key.endswith(timed):
            assert ours[key] == pytest.approx(value, rel=1e-5), key


def test_exact_loss_trace_and_uneven_eval(tmp_path):
    results = run_distributed(_exactness_worker, 2, args=(str(tmp_path),))
    for result in results:
        for name, gap in result["gaps"].items():
            assert gap < 1e-5, (name, gap)  # mean-of-means would be off by ~1e-1 with these lengths
        trainer_losses, runner_losses, same_weights = result["trace"]
        assert trainer_losses == pytest.approx(runner_losses, rel=1e-6)
        assert same_weights
        assert result["rows"][0] == 7 and result["rows"][1] == 7.0
    # A stream on 2 ranks gives what one rank gives: every row counted once in the loss, the metrics and the
    # predictions (the eval loss exactly where the padded batch is the repeat alone).
    one_rank = _stream_eval(tmp_path / "one_rank")
    for result in results:
        stream = result["stream"]
        _same_metrics(stream["eval"], one_rank["eval"])
        assert stream["eval"]["eval_rows"] == 9.0
        assert stream["predict9"][:2] == one_rank["predict9"][:2] == (9, 9)
        _same_metrics(stream["predict9"][2], one_rank["predict9"][2])
        assert stream["predict7"][:2] == one_rank["predict7"][:2] == (7, 7)
        ours, theirs = stream["predict7"][2], one_rank["predict7"][2]
        for key in ("test_rows", "test_accuracy", "test_logit_sum"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5), key


def _resume_worker(strategy: str, out: str) -> dict:
    out = Path(out)
    data = text_data(96)
    dropout = LlamaConfig(**{**TINY.to_dict(), "dropout": 0.1})

    def trainer(path, callbacks=()):
        torch.manual_seed(3)
        args = _args(path, gradient_accumulation_steps=2, logging_steps=2, save_strategy="steps", save_steps=3)
        return Trainer(Llama(dropout), args, train_dataset=data, callbacks=list(callbacks),
                       strategy=strategy_from_name(strategy))

    full = trainer(out / "full")
    full.train()
    first = trainer(out / "resumed", [StopAt(3)])
    first.train()
    torch.manual_seed(99)  # other RNG state than at the save: the checkpoint must restore it
    second = trainer(out / "resumed")
    second.train(resume_from_checkpoint=True)
    losses = lambda t: [h["loss"] for h in t.state.log_history if "loss" in h]  # noqa: E731
    a, b = full_state_dict(full.runner, full.model), full_state_dict(second.runner, second.model)
    return {"full": losses(full), "resumed": losses(second), "equal": all(torch.equal(a[k], b[k]) for k in a),
            "step": second.state.global_step}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2"])
def test_resume_mid_epoch_equals_the_uninterrupted_run(tmp_path, strategy):
    results = run_distributed(_resume_worker, 2, args=(strategy, str(tmp_path)), env={"DS_ACCELERATOR": "cpu"})
    for result in results:
        assert result["step"] == 6
        assert result["resumed"] == result["full"]
        assert result["equal"]
