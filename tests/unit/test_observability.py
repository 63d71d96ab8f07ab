"""Issue 27: trackers read back with their own packages, throughput/MFU against torch's FLOP counter, the step
profiler's files, the OOM snapshot handler, the FP16 stuck-scale warning and deterministic runs."""

from __future__ import annotations

import contextlib
import csv
import glob
import json
import logging
import struct
import time

import pytest
import torch

from shardkit import Runner
from shardkit.observability import (
    StepProfiler,
    Throughput,
    flops_per_token,
    install_oom_snapshot,
    oom_report,
    parse_profile_steps,
    profiler,
)
from shardkit.observability.profiler import oom_observer
from shardkit.observability.run_log import RunLog
from shardkit.precision.fp16 import LossScaler


def _train(runner: Runner, steps: int, width: int = 8) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    model, optimizer = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(steps * runner.gradient_accumulation_steps):
        runner.backward(model(torch.randn(4, width)).pow(2).mean())
        runner.step()
    return model


def _wandb_records(run_file: str):
    """The records of an offline W&B run file (leveldb log blocks of wandb protobuf Records)."""
    from wandb.proto import wandb_internal_pb2

    data, block, header = open(run_file, "rb").read(), 32768, 7
    assert data[:4] == b":W&B"
    pos, pending = header, b""
    while pos + header <= len(data):
        if block - pos % block < header:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        chunk, pos = data[pos + header:pos + header + length], pos + header + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL/FIRST start a record, LAST ends it
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def test_runner_trackers_are_read_back_by_their_own_packages(tmp_path, monkeypatch):
    """Hyperparameters once and metrics per step, through TensorBoard, MLflow, W&B (offline), CSV and jsonl."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    runner = Runner(log_with=["tensorboard", "mlflow", "wandb", "csv", "jsonl"], logging_dir=tmp_path)
    runner.log_hyperparams({"lr": 0.1, "model": "tiny"})
    for step in range(3):
        runner.log({"loss": 1.0 / (step + 1), "note": "x"}, step=step)
    mlflow_run = next(t for t in runner.run_log.trackers if t.name == "mlflow").run_id
    runner.teardown()

    events = EventAccumulator(str(tmp_path / "shardkit"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    assert client.get_run(mlflow_run).data.params == {"lr": "0.1", "model": "tiny"}
    history = client.get_metric_history(mlflow_run, "loss")
    assert [(m.step, m.value) for m in history] == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    run_file = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))[0]
    for _ in range(300):  # wandb's service may still be writing the file after run.finish() returns
        if any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(run_file)):
            break
        time.sleep(0.1)
    history, config = [], {}
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        # A history row is a HistoryRecord, or a partial_history request when the service has not merged it yet.
        items = record.history.item if kind == "history" else None
        if kind == "request" and record.request.WhichOneof("request_type") == "partial_history":
            items = record.request.partial_history.item
        if items is not None:
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
        elif kind == "config":
            config.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.config.update})
    steps = [(h.get("_step"), h["loss"]) for h in history if "loss" in h]
    assert steps == [(0, 1), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert {k: config[k] for k in ("lr", "model")} == {"lr": 0.1, "model": "tiny"}
    with open(tmp_path / "shardkit" / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["step"], float(r["loss"])) for r in rows] == [("0", 1.0), ("1", 0.5), ("2", pytest.approx(1 / 3))]
    lines = [json.loads(line) for line in (tmp_path / "shardkit.jsonl").read_text().splitlines()]
    assert lines[0]["config"] == {"lr": 0.1, "model": "tiny"} and [x["step"] for x in lines[1:]] == [0, 1, 2]


def test_wandb_dir_is_left_to_wandb(tmp_path, monkeypatch):
    """Hugging Face's callback passes no `dir`, so wandb reads WANDB_DIR; the logging_dir is used only without it."""
    import sys
    import types

    from shardkit.observability.trackers import TRACKERS

    calls = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(kwargs) or types.SimpleNamespace()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-here"))
    TRACKERS.build("wandb", run_name="run", logging_dir=tmp_path / "logs")
    assert calls[-1] == {"project": "run"} and not (tmp_path / "logs").exists()
    monkeypatch.delenv("WANDB_DIR")
    TRACKERS.build("wandb", run_name="run", logging_dir=tmp_path / "logs")
    assert calls[-1] == {"project": "run", "dir": str(tmp_path / "logs")}
    TRACKERS.build("wandb", run_name="run", logging_dir=tmp_path / "logs", dir=str(tmp_path / "mine"))
    assert calls[-1]["dir"] == str(tmp_path / "mine")


def test_deepspeed_monitor_sections_record_loss_and_lr_per_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "job"},
              "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "job"}}
    runner = Runner(config=config, seed=0)
    _train(runner, 3)
    runner.teardown()
    events = EventAccumulator(str(tmp_path / "tb" / "job"))
    events.Reload()
    assert [e.step for e in events.Scalars("Train/Samples/train_loss")] == [8, 16, 24]  # samples, as DeepSpeed
    assert [e.value for e in events.Scalars("Train/Samples/lr")] == [pytest.approx(0.1)] * 3
    with open(tmp_path / "csv" / "job" / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["step"]) for r in rows] == [8, 16, 24] and all(float(r["Train/Samples/train_loss"]) > 0 for r in rows)


def test_trackers_are_built_on_the_main_process_only(tmp_path):
    log = RunLog(["csv", "jsonl"], tmp_path, "run", is_main_process=False)
    log.log_hyperparams({"a": 1})
    log.log({"loss": 1.0}, step=0)
    log.finish()
    assert log.trackers == [] and list(tmp_path.iterdir()) == []


def _tiny_llama(**extra):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      **extra)
    # NOTE: eager attention: torch's FLOP counter has no formula for the CPU flash-attention kernel that SDPA
    # takes on CPU, and would count the attention as 0.
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config)


def test_flops_per_token_match_torch_flop_counter_on_one_step():
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = _tiny_llama()
    ids = torch.randint(0, 256, (2, 32))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    flops = flops_per_token(model, seq_len=32)
    assert flops.model * ids.numel() == pytest.approx(counter.get_total_flops(), rel=0.05)
    assert flops.attention == 12 * 2 * 64 * 32 and flops.recompute == 0
    assert flops_per_token(model, 32, checkpointed=True).recompute > 0


def test_runner_throughput_reports_rates_and_mfu_against_a_measured_cpu_peak(caplog):
    runner = Runner(seed=0)
    model = _train(runner, 0)
    meter = runner.throughput
    rng = torch.get_rng_state()
    assert meter.peak > 0 and torch.equal(rng, torch.get_rng_state())  # measured without drawing from the run's RNG
    with caplog.at_level(logging.INFO, logger="shardkit.observability"):
        for _ in range(2):
            runner.backward(model(torch.randn(4, 8)).pow(2).mean())
            runner.step()
            rates = meter.update(tokens=4 * 8, samples=4)
    assert rates["tokens_per_s"] == pytest.approx(8 * rates["samples_per_s"])
    assert rates["tflops"] > 0 and rates["mfu"] == pytest.approx(rates["tflops"] / meter.peak)
    assert "measured here at start-up with a float32 matmul, not a data-sheet figure" in meter.describe()["peak_source"]
    assert sum("peak" in r.message and r.levelno == logging.INFO for r in caplog.records) == 1  # shown once
    # ... and a measured peak is named as such, once, with the ways to fix it
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "measured on this cpu at start-up (not a data-sheet figure)" in warning
    assert "Runner(peak_tflops=...)" in warning and "SHARDKIT_PEAK_TFLOPS" in warning
    given = Throughput(model, torch.device("cpu"), torch.float32, peak=2.0, checkpointed=True)
    checkpointed = given.update(32, 4)
    assert given.peak == 2.0 and checkpointed["hfu"] > checkpointed["mfu"]
    assert given.flops(8).recompute == 2 * (8 * 16 + 16)  # no config: no attention term; one more forward, 2N


def test_a_peak_set_by_the_user_is_the_one_mfu_divides_by(monkeypatch, caplog):
    from shardkit.trainer import TrainingArguments, TrainingArgumentsError

    runner = Runner(seed=0, peak_tflops=3.0)
    model = _train(runner, 0)
    with caplog.at_level(logging.INFO, logger="shardkit.observability"):
        rates = runner.throughput.update(tokens=32, samples=4)
    assert runner.throughput.peak == 3.0 and runner.throughput.describe()["peak_source"] == "given"
    assert rates["mfu"] == pytest.approx(rates["tflops"] / 3.0)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]  # nothing measured, nothing to warn of
    monkeypatch.setenv("SHARDKIT_PEAK_TFLOPS", "5")
    from_env = Throughput(model, torch.device("cpu"), torch.float32)
    assert from_env.peak == 5.0 and from_env.describe()["peak_source"] == "SHARDKIT_PEAK_TFLOPS"
    assert Throughput(model, torch.device("cpu"), torch.float32, peak=2.0).peak == 2.0  # the argument wins
    monkeypatch.setenv("SHARDKIT_PEAK_TFLOPS", "fast")
    with pytest.raises(ValueError, match="SHARDKIT_PEAK_TFLOPS='fast' is not a positive number of TFLOP/s"):
        Throughput(model, torch.device("cpu"), torch.float32)
    with pytest.raises(TrainingArgumentsError, match="peak_tflops=-1.0 must be a positive number"):
        TrainingArguments(output_dir="x", peak_tflops=-1.0)


def test_flops_count_a_partitioned_weight_whole():
    """A weight an engine partitions in place is an empty placeholder (ZeRO-3): counted by the strategy's
    parameter_numel it gives the FLOPs of the whole model, as under a single device."""
    torch.manual_seed(0)
    model = _tiny_llama()
    whole = flops_per_token(model, 32)
    sizes = {id(p): p.numel() for p in model.parameters()}
    for p in model.parameters():
        p.data = torch.empty(0)
    assert flops_per_token(model, 32).matmul_params == 0  # what Tensor.numel counts now
    partitioned = flops_per_token(model, 32, numel=lambda p: sizes[id(p)])
    assert partitioned == whole


def test_profile_steps_write_a_trace_a_memory_timeline_and_the_top_ops(tmp_path, caplog):
    runner = Runner(seed=0, profile_steps=(1, 3), logging_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="shardkit.observability"):
        _train(runner, 4)
    files = runner.profiler.files
    assert [f.name for f in files] == ["trace.rank0.json", "memory_timeline.rank0.json", "top_ops.rank0.txt"]
    trace = json.loads(files[0].read_text())
    steps = [e for e in trace["traceEvents"] if e.get("name") == "Optimizer.step#SGD.step"]
    assert len(steps) == 2  # steps 1 and 2, not 0 or 3
    assert json.loads(files[1].read_text())  # the profiler's own memory timeline (times, bytes per category)
    table = files[2].read_text()
    assert "Self CPU time total" in table and table.count("aten::") >= 5 and table in caplog.text
    runner.teardown()
    assert parse_profile_steps("2-3") == range(2, 4) == parse_profile_steps((2, 4))
    assert parse_profile_steps(5) == range(5, 6)
    with pytest.raises(ValueError, match=r"profile_steps=\(4, 2\) is empty"):
        StepProfiler((4, 2), tmp_path)


def test_oom_observer_writes_the_memory_snapshot_and_names_it(tmp_path, monkeypatch, caplog):
    """The CUDA allocator calls this observer on an out-of-memory error; simulated here (no GPU)."""
    written = []
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: written.append(path) or open(path, "w"))
    monkeypatch.setattr(oom_report, "_last_cuda_oom", {})  # the allocator's figures, kept for the report
    with caplog.at_level(logging.ERROR, logger="shardkit.observability"):
        oom_observer(tmp_path / "profile", rank=3)(0, 2**30, 5 * 2**30, 2**20)
    assert written == [str(tmp_path / "profile" / "oom_snapshot.rank3.pickle")]
    assert oom_report._last_cuda_oom == {"device": 0, "alloc": 2**30, "allocated": 5 * 2**30, "free": 2**20}
    assert "asking for 1073741824 bytes" in caplog.text and "oom_snapshot.rank3.pickle" in caplog.text


def test_one_allocator_observer_serves_the_latest_runner(tmp_path, monkeypatch):
    """The CUDA allocator keeps every observer attached: a second Runner must not add a second snapshot per OOM."""
    attached, written = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kwargs: None)
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", attached.append, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", written.append)
    monkeypatch.setattr(profiler, "_snapshot", {"current": None})
    monkeypatch.setattr(oom_report, "_last_cuda_oom", {})
    install_oom_snapshot(tmp_path / "first", 0)
    install_oom_snapshot(tmp_path / "second", 0)
    assert len(attached) == 1
    attached[0](0, 2**20, 2**30, 0)
    assert written == [str(tmp_path / "second" / "oom_snapshot.rank0.pickle")]


def test_an_oom_inside_step_writes_one_report_and_still_reaches_the_loop(tmp_path, caplog):
    """An out-of-memory error raised inside runner.step() (a CUDA one, as a GPU raises it): the report names the
    allocation and holds the steps before it; the loop still gets the error, and a second report_oom is a no-op."""
    runner = Runner(logging_dir=tmp_path, seed=0)
    model = runner.setup(torch.nn.Linear(8, 1))
    failing = {"now": False}

    class Hungry(torch.optim.SGD):
        def step(self, closure=None):
            if failing["now"]:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ...")
            return super().step(closure)

    model, _ = runner.setup(model, Hungry(model.parameters(), lr=0.1))
    for i in range(4):
        failing["now"] = i == 3
        runner.backward(model(torch.randn(4, 8)).square().mean())
        with caplog.at_level(logging.ERROR, logger="shardkit.observability"), \
                pytest.raises(torch.OutOfMemoryError) if i == 3 else contextlib.nullcontext() as caught:
            runner.step()
    path = tmp_path / "oom_report.rank0.json"
    report = json.loads(path.read_text())
    assert report["failing_allocation_bytes"] == 2 * 2**30 and report["error"]["type"] == "OutOfMemoryError"
    assert [r["step"] for r in report["last_steps"]] == [1, 2, 3] and "cuda" not in report["memory"]
    assert "--params 9 --num-gpus 1" in report["fix"] and str(path) in caplog.text
    path.unlink()
    assert runner.report_oom(caught.value) == path and not path.exists()  # once per error
    assert runner.report_oom(ValueError("not memory")) is None


def test_fp16_loss_scale_stuck_at_its_minimum_warns_once(caplog):
    scaler = LossScaler(initial_scale=4.0, window=1000, hysteresis=1, min_scale=1.0, dynamic=True, stuck_steps=5)
    with caplog.at_level(logging.WARNING, logger="shardkit.precision"):
        for _ in range(2 + 5 + 10):  # 4 -> 2 -> 1, then 15 overflows at the minimum
            scaler.update(overflow=True)
    stuck = [r for r in caplog.records if "stuck at its minimum" in r.getMessage()]
    assert len(stuck) == 1 and "min_loss_scale=1" in stuck[0].getMessage() and "BF16()" in stuck[0].getMessage()
    scaler.update(overflow=False)
    assert scaler.overflows_at_min == 0


class _Noisy(torch.utils.data.Dataset):
    """Random augmentation in the workers: equal runs need seeded workers."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((8,), float(i)) + torch.randn(8)


def _deterministic_run() -> dict[str, torch.Tensor]:
    runner = Runner(deterministic=True, seed=3)
    assert torch.are_deterministic_algorithms_enabled()
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    model, optimizer = runner.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    loader = runner.setup_dataloader(torch.utils.data.DataLoader(_Noisy(), batch_size=8, shuffle=True,
                                                                 num_workers=2))
    for batch in loader:
        runner.backward(model(batch).pow(2).mean())
        runner.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_deterministic_runs_are_bitwise_equal(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        first, second = _deterministic_run(), _deterministic_run()
        import os

        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_a_report_that_cannot_be_written_never_replaces_the_out_of_memory_error(tmp_path, monkeypatch, caplog):
    """A full disk (here: the writer raising OSError) is logged; the loop still gets the out-of-memory error."""
    import shardkit.runner.observe as observe

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(observe, "write_oom_report", disk_full)
    runner = Runner(logging_dir=tmp_path, seed=0)
    model = runner.setup(torch.nn.Linear(8, 1))
    out = model(torch.randn(4, 8)).square().mean()
    out.register_hook(lambda grad: (_ for _ in ()).throw(torch.OutOfMemoryError("out of memory (test)")))
    with caplog.at_level(logging.WARNING, logger="shardkit"), pytest.raises(torch.OutOfMemoryError):
        runner.backward(out)
    assert "could not write the out-of-memory report: OSError" in caplog.text
