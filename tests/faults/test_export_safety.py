"""Issue 30, nothing lost: exports (save_pretrained, zero-to-fp32) publish atomically and never write into a
checkpoint; a full disk (RLIMIT_FSIZE in a subprocess) leaves the previous export and the previous checkpoint
whole with an error naming the file; an output directory that cannot be made is a one-line error; export files
get the umask's permissions; zero-to-fp32 copies config.json and tokenizer files so from_pretrained builds the
right model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ds_corpus import write_good
from safetensors.torch import load_file
from torch import nn

from shardkit import Runner, cli
from shardkit.checkpoint import CheckpointError, CheckpointReader, CheckpointWriter, consolidate
from shardkit.checkpoint.export import Export
from shardkit.checkpoint.hf import save_pretrained
from shardkit.checkpoint.zero_to_fp32 import main
from shardkit.trainer.checkpointing import sorted_checkpoints

HERE = Path(__file__).parent


def _snapshot(d: Path) -> dict[str, bytes]:
    """Every file's bytes (the save lock's holder pid aside)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()
            and p.name != ".shardkit.lock"}


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.rglob(".*") if ".export-" in p.name or ".tmp" in p.name)


def test_a_full_disk_loses_neither_the_previous_export_nor_the_previous_checkpoint(tmp_path):
    torch.manual_seed(0)
    runner = Runner(seed=0)
    model = runner.setup(nn.Linear(256, 256))
    save_pretrained(runner, tmp_path / "export", model)
    (tmp_path / "export" / "README.md").write_text("kept\n")
    runner.save(tmp_path / "ck" / "step-1", {"model": model})
    before_export = _snapshot(tmp_path / "export")
    before_ck = _snapshot(tmp_path / "ck")

    proc = subprocess.run([sys.executable, str(HERE / "probe_disk_full.py"), str(64 << 10),
                           "export", str(tmp_path / "export"), "save", str(tmp_path / "ck" / "step-2")],
                          capture_output=True, text=True, timeout=120)
    results = {r["kind"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert set(results) == {"export", "save"}, proc.stderr[-2000:]
    for kind, r in results.items():  # a CheckpointError naming the file, the reason and what was kept
        assert r["error"] == "CheckpointError", r
        named = r"/model(-\d+)?\.safetensors(\.partial)?: cannot be written \(File too large\)"
        assert re.search(named, r["message"]), r
        assert "file-size limit" in r["message"] and "nothing was published" in r["message"], r
    assert _snapshot(tmp_path / "export") == before_export
    assert _snapshot(tmp_path / "ck") == before_ck and (tmp_path / "ck" / "latest").read_text().strip() == "step-1"
    assert _leftovers(tmp_path) == []
    fresh = nn.Linear(256, 256)
    Runner(seed=0).load(tmp_path / "ck", {"model": fresh})
    assert torch.equal(fresh.weight, model.weight)


def test_exports_never_write_into_a_checkpoint(tmp_path, capsys):
    runner = Runner(seed=0)
    model = runner.setup(nn.Linear(4, 3))
    runner.save(tmp_path / "ck" / "step-1", {"model": model})
    before = _snapshot(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="step-1/shardkit.json exists\\); an export never writes into a"):
        save_pretrained(runner, tmp_path / "ck" / "step-1", model)
    assert main([str(tmp_path / "ck"), str(tmp_path / "ck" / "step-1")]) == 2
    assert "never writes into a checkpoint" in capsys.readouterr().err
    assert _snapshot(tmp_path / "ck") == before
    with CheckpointReader(tmp_path / "ck") as r:
        r.verify_all()


def test_an_output_directory_that_cannot_be_made_is_one_line(tmp_path, capsys):
    with CheckpointWriter(tmp_path / "ck" / "step-1") as w:
        w.write_tensors("model", {"w": torch.ones(2)})
    (tmp_path / "a-file").write_text("x")
    assert cli.main(["zero-to-fp32", str(tmp_path / "ck"), str(tmp_path / "a-file" / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1, err
    assert "a-file" in err


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_export_files_follow_the_umask(tmp_path, umask):
    with CheckpointWriter(tmp_path / "ck" / "step-1") as w:
        w.write_tensors("model", {"w": torch.ones(300), "v": torch.ones(300)})
    old = os.umask(umask)
    try:
        consolidate(tmp_path / "ck", tmp_path / "out", max_shard_size=1000)
    finally:
        os.umask(old)
    files = list((tmp_path / "out").iterdir())
    assert len(files) == 3 and all(f.stat().st_mode & 0o777 == 0o666 & ~umask for f in files)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask


@pytest.mark.parametrize("subdir", [False, True])  # a directory of files is swapped; a run's folder is not moved
def test_a_new_export_replaces_the_weights_and_keeps_the_other_files(tmp_path, subdir):
    with CheckpointWriter(tmp_path / "ck" / "step-1") as w:
        w.write_tensors("model", {"w": torch.ones(300), "v": torch.zeros(300)})
    consolidate(tmp_path / "ck", tmp_path / "out", max_shard_size=1000)
    (tmp_path / "out" / "README.md").write_text("my notes\n")
    if subdir:
        (tmp_path / "out" / "runs").mkdir()
        (tmp_path / "out" / "runs" / "events").write_text("a\n")
    inode = (tmp_path / "out").stat().st_ino
    paths = consolidate(tmp_path / "ck", tmp_path / "out")
    assert [p.name for p in paths] == ["model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["README.md", "model.safetensors",
                                                                   *(["runs"] if subdir else [])]
    assert (tmp_path / "out" / "README.md").read_text() == "my notes\n"
    assert ((tmp_path / "out").stat().st_ino == inode) == subdir
    assert _leftovers(tmp_path) == []


def test_save_model_into_a_training_runs_folder_is_allowed(tmp_path):
    runner = Runner(seed=0)
    model = runner.setup(nn.Linear(4, 3))
    runner.save(tmp_path / "run" / "checkpoint-1", {"model": model})  # run/latest names a shardkit checkpoint
    save_pretrained(runner, tmp_path / "run", model)
    assert (tmp_path / "run" / "model.safetensors").is_file() and (tmp_path / "run" / "checkpoint-1").is_dir()
    with CheckpointReader(tmp_path / "run") as r:
        r.verify_all()


def test_an_export_killed_between_its_renames_gets_the_previous_one_back(tmp_path):
    with CheckpointWriter(tmp_path / "ck" / "step-1") as w:
        w.write_tensors("model", {"w": torch.ones(3)})
    consolidate(tmp_path / "ck", tmp_path / "out")
    before = _snapshot(tmp_path / "out")
    os.rename(tmp_path / "out", tmp_path / ".out.export-old")  # the state a kill after the first rename leaves
    (tmp_path / ".out.export-0123456789ab").mkdir()  # and a half-written staging directory
    Export(tmp_path / "out").abort()
    assert _snapshot(tmp_path / "out") == before and _leftovers(tmp_path) == []


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def test_zero_to_fp32_writes_the_config_so_from_pretrained_builds_the_right_model(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    model = _tiny_llama()
    with CheckpointWriter(tmp_path / "run" / "step-1") as w:
        w.write_tensors("model", model.state_dict())
    model.config.save_pretrained(tmp_path / "run")  # beside the checkpoint, as a training script keeps it
    (tmp_path / "run" / "tokenizer_config.json").write_text('{"model_max_length": 32}')
    assert main([str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    assert "config.json, tokenizer_config.json" in capsys.readouterr().err
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert loaded.config.vocab_size == 40 and loaded.config.num_hidden_layers == 2
    ids = torch.tensor([[1, 5, 7, 3]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_zero_to_fp32_copies_a_deepspeed_runs_config_and_refuses_a_hostile_one(tmp_path):
    write_good(tmp_path / "checkpoint-1")  # a Hugging Face Trainer's layout: config.json beside global_step1/
    (tmp_path / "checkpoint-1" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(CheckpointError, match="checkpoint-1/latest exists"):  # a DeepSpeed checkpoint-N itself
        Export(tmp_path / "checkpoint-1")
    for inside in ("checkpoint-1/global_step1", "checkpoint-1/global_step1/hf"):  # DeepSpeed's tag directory
        assert main([str(tmp_path / "checkpoint-1"), str(tmp_path / inside)]) == 2
    assert main([str(tmp_path / "checkpoint-1"), str(tmp_path / "checkpoint-1" / "hf")]) == 0  # a directory of its own
    assert json.loads((tmp_path / "checkpoint-1" / "hf" / "config.json").read_text()) == {"model_type": "llama"}
    assert main([str(tmp_path / "checkpoint-1"), str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {"model_type": "llama"}
    (tmp_path / "checkpoint-1" / "config.json").unlink()
    os.symlink("/etc/hostname", tmp_path / "checkpoint-1" / "config.json")
    with pytest.raises(CheckpointError, match="config.json: the model file config.json cannot be opened"):
        from shardkit.checkpoint import consolidate_deepspeed

        consolidate_deepspeed(tmp_path / "checkpoint-1", tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def test_a_new_directory_inside_a_checkpoint_replaces_nothing_and_is_not_read_as_the_checkpoint(tmp_path, monkeypatch,
                                                                                                capsys):
    """DeepSpeed's page consolidates inside the checkpoint: `cd checkpoint-N; zero_to_fp32 . pytorch_model.bin`."""
    runner = Runner(seed=0)
    model = runner.setup(nn.Linear(4, 3))
    ck = tmp_path / "run" / "checkpoint-2"
    runner.save(ck, {"model": model}, update_latest=False)
    before = _snapshot(ck)
    monkeypatch.chdir(ck)
    for _ in range(2):  # the second run replaces the first one's export
        assert main([".", "pytorch_model.bin"]) == 0, capsys.readouterr().err
    assert torch.equal(load_file(ck / "pytorch_model.bin" / "model.safetensors")["weight"], model.weight)
    assert {k: v for k, v in _snapshot(ck).items() if not k.startswith("pytorch_model.bin/")} == before
    with CheckpointReader(ck) as r:
        r.verify_all()
    fresh = nn.Linear(4, 3)
    Runner(seed=0).load(ck, {"model": fresh})
    assert torch.equal(fresh.weight, model.weight) and sorted_checkpoints(tmp_path / "run") == [ck]
    capsys.readouterr()
    own_file = next(p.name for p in ck.iterdir() if p.suffix == ".safetensors")
    assert main([".", "."]) == 2 and "is the checkpoint being read" in capsys.readouterr().err
    assert main([".", own_file]) == 2 and "exists and is not a directory" in capsys.readouterr().err
    assert {k: v for k, v in _snapshot(ck).items() if not k.startswith("pytorch_model.bin/")} == before
    assert _leftovers(tmp_path) == []


def test_a_checkpoint_carries_a_zero_to_fp32_script_that_consolidates_it(tmp_path):
    """As DeepSpeed drops zero_to_fp32.py into its checkpoints: `python zero_to_fp32.py . OUT` with its arguments."""
    from shardkit.checkpoint.checkpoint_script import SCRIPT_NAME, script_text

    torch.manual_seed(0)
    state = {"a.weight": torch.randn(5, 3), "a.bias": torch.randn(5).half()}
    ck = tmp_path / "checkpoint-1"
    with CheckpointWriter(ck, scripts={SCRIPT_NAME: script_text()}) as w:
        w.write_tensors("model", state)
    assert os.access(ck / SCRIPT_NAME, os.X_OK)
    with CheckpointReader(ck) as r:
        r.verify_all()
    assert SCRIPT_NAME not in json.loads((ck / "shardkit.json").read_text())["files"]  # a tool, not content
    run = subprocess.run([sys.executable, SCRIPT_NAME, ".", "pytorch_model.bin", "--max_shard_size", "5GB",
                          "--safe_serialization"], cwd=ck, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = load_file(ck / "pytorch_model.bin" / "model.safetensors")
    assert set(got) == set(state) and all(torch.equal(got[k], v.float()) for k, v in state.items())
    fake = tmp_path / "elsewhere" / "shardkit"  # a Python where shardkit cannot be imported
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named shardkit')\n")
    run = subprocess.run([sys.executable, SCRIPT_NAME, ".", "out"], cwd=ck, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(fake.parent)})
    assert run.returncode == 1 and "written by shardkit, and converting it needs shardkit" in run.stderr, run.stderr
    assert "shardkit zero-to-fp32 CHECKPOINT OUTPUT_DIR" in run.stderr and not (ck / "out").exists()
