"""consolidate() and the zero-to-fp32 command on full and sharded checkpoints."""

import json
import threading

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from shardkit.checkpoint import CheckpointWriter, ShardPiece, consolidate, parse_size
from shardkit.checkpoint.zero_to_fp32 import main

torch.manual_seed(0)
EMB = torch.randn(10, 4)
STATE = {
    "embed.weight": EMB,
    "layers.0.weight": torch.randn(6, 4).to(torch.bfloat16),
    "layers.0.bias": torch.randn(6),
    "layers.1.weight": torch.randn(3, 6).half(),
    "steps": torch.tensor([7, 8], dtype=torch.int64),
    "head.weight": EMB,  # tied to embed.weight
}


def _load_hf_dir(out):
    """Reads model.safetensors or the index + shards, the way a Hugging Face loader does."""
    index = out / "model.safetensors.index.json"
    if not index.exists():
        return load_file(out / "model.safetensors")
    weight_map = json.loads(index.read_text())["weight_map"]
    tensors = {}
    for file in sorted(set(weight_map.values())):
        part = load_file(out / file)
        assert {k for k, f in weight_map.items() if f == file} == set(part)
        tensors.update(part)
    return tensors


def _expected(dtype=torch.float32):
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in STATE.items() if k != "head.weight"}


def _assert_same(got, want):
    assert list(got) == list(want) or set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_full_checkpoint_single_file(tmp_path):
    with CheckpointWriter(tmp_path / "ckpt" / "step-1") as w:
        w.write_tensors("model", STATE)
    paths = consolidate(tmp_path / "ckpt", tmp_path / "out")
    assert paths == [tmp_path / "out" / "model.safetensors"]
    _assert_same(_load_hf_dir(tmp_path / "out"), _expected())
    with safe_open(str(paths[0]), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and json.loads(meta["tied_weights"]) == {"head.weight": "embed.weight"}


def test_full_checkpoint_sharded_output_with_index(tmp_path):
    with CheckpointWriter(tmp_path / "ckpt" / "step-1") as w:
        w.write_tensors("model", STATE)
    # 100 bytes per file: embed.weight (160 B in fp32) gets a file of its own, the rest pack greedily
    paths = consolidate(tmp_path / "ckpt", tmp_path / "out", max_shard_size=100)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    n = len(paths) - 1
    assert n >= 3 and paths[-1].name == "model.safetensors.index.json"
    assert [p.name for p in paths[:-1]] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    want = _expected()
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in want.values())
    assert index["metadata"]["tied_weights"] == {"head.weight": "embed.weight"}
    _assert_same(_load_hf_dir(tmp_path / "out"), want)
    # re-running with one file replaces the old shards instead of leaving them behind
    consolidate(tmp_path / "ckpt", tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]


def _save_two_rank_sharded(path):
    barrier = threading.Barrier(2, timeout=30)

    def rank_fn(rank):
        pieces = {}
        for k, t in STATE.items():
            if k == "head.weight":
                continue
            n = t.numel()
            a, b = (0, n // 2) if rank == 0 else (n // 2, n)
            pieces[k] = ShardPiece(t.reshape(-1)[a:b].clone(), global_shape=tuple(t.shape), flat_range=(a, b))
        with CheckpointWriter(path, rank=rank, world_size=2, barrier=barrier.wait) as w:
            w.write_shard("model", pieces)

    threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert (path / "shardkit.json").exists()


def test_sharded_checkpoint_sharded_output(tmp_path):
    _save_two_rank_sharded(tmp_path / "ckpt" / "step-1")
    paths = consolidate(tmp_path / "ckpt" / "step-1", tmp_path / "out", max_shard_size="0.0001MB", dtype=None)
    assert len(paths) > 2
    _assert_same(_load_hf_dir(tmp_path / "out"), {k: v for k, v in STATE.items() if k != "head.weight"})


def test_cli_main(tmp_path, capsys):
    _save_two_rank_sharded(tmp_path / "ckpt" / "step-1")
    rc = main([str(tmp_path / "ckpt"), str(tmp_path / "out"), "--dtype", "bf16", "--max-shard-size", "150B"])
    assert rc == 0
    printed = capsys.readouterr().out.split()
    assert printed[-1].endswith("model.safetensors.index.json")
    _assert_same(_load_hf_dir(tmp_path / "out"), _expected(torch.bfloat16))


def test_without_a_config_json_the_tool_says_what_the_output_lacks_and_how_to_add_it(tmp_path, capsys):
    _save_two_rank_sharded(tmp_path / "ckpt" / "step-1")
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "no config.json was found beside the checkpoint" in err and "holds the weights only" in err, err
    assert "copy the model's config.json there" in err and "model.config.save_pretrained(" in err
    (tmp_path / "ckpt" / "config.json").write_text('{"model_type": "llama"}')
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    assert "no config.json" not in capsys.readouterr().err


def test_cli_errors_name_the_problem(tmp_path, capsys):
    torch.save({"w": torch.ones(1)}, tmp_path / "pytorch_model.pt")
    assert main([str(tmp_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "shardkit.json" in err and "torch.save" in err
    with CheckpointWriter(tmp_path / "ckpt" / "a") as w:
        w.write_json("x", {})
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    assert "no entry 'model'" in capsys.readouterr().err


def test_register_adds_subcommand():
    import argparse

    from shardkit.checkpoint.zero_to_fp32 import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["zero-to-fp32", "a", "b", "--dtype", "fp16"])
    assert args.dtype == "fp16" and callable(args.func)


@pytest.mark.parametrize("text,n", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30),
                                    (123, 123), ("1.5KB", 1500)])
def test_parse_size(text, n):
    assert parse_size(text) == n


# --- DeepSpeed-format inputs read through the allowlist unpickler (no DeepSpeed needed) ---


class _RunsCommand:
    """Unpickling this with a plain pickle loader would run `touch <marker>`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_pickle_that_would_run_a_command_is_refused_and_nothing_runs(tmp_path, capsys):
    from shardkit.checkpoint.safe_unpickle import UnsafePickleError, load_torch_zip

    marker = tmp_path / "pwned"
    step = tmp_path / "ckpt" / "global_step1"
    step.mkdir(parents=True)
    (tmp_path / "ckpt" / "latest").write_text("global_step1")
    payload = {"optimizer_state_dict": {"zero_stage": 2, "partition_count": 1, "x": _RunsCommand(marker)}}
    torch.save(payload, step / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({"module": {}, "buffer_names": [], "param_shapes": []}, step / "mp_rank_00_model_states.pt")
    with pytest.raises(UnsafePickleError, match=r"'posix\.system'"):
        load_torch_zip(step / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "posix.system" in err and "zero_pp_rank_0_mp_rank_00_optim_states.pt" in err
    assert not marker.exists() and not (tmp_path / "out").exists()
    # the same file through an unrestricted loader does run it: the test can fail
    torch.load(step / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    assert marker.exists()


def test_allowlisted_tensors_are_mapped_lazily_and_equal(tmp_path):
    from shardkit.checkpoint.safe_unpickle import TorchZipFile

    state = {"a": torch.arange(10, dtype=torch.float32), "b": torch.randn(3, 4).to(torch.bfloat16).t(),
             "n": torch.tensor(7), "shape": torch.Size([2, 3]), "s": {1, 2}, "empty": torch.empty(0, 5)}
    state["view"] = state["a"][3:7]  # shares a's storage
    torch.save(state, tmp_path / "x.pt")
    f = TorchZipFile(tmp_path / "x.pt")
    got = f.load()
    for k in ("a", "b", "n", "view", "empty"):
        assert got[k].dtype == state[k].dtype and torch.equal(got[k], state[k]), k
    assert got["shape"] == torch.Size([2, 3]) and got["s"] == {1, 2}
    assert got["view"].untyped_storage().data_ptr() == got["a"].untyped_storage().data_ptr()
    f.release()  # pages dropped, re-read on the next touch
    assert torch.equal(got["b"], state["b"])


def test_truncated_torch_file_is_a_named_error(tmp_path):
    from shardkit.checkpoint.format import CheckpointError
    from shardkit.checkpoint.safe_unpickle import load_torch_zip

    torch.save({"w": torch.randn(100)}, tmp_path / "x.pt")
    data = (tmp_path / "x.pt").read_bytes()
    (tmp_path / "x.pt").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"x\.pt: not a complete torch.save zip file"):
        load_torch_zip(tmp_path / "x.pt")
