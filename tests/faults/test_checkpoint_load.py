"""Issue 13 B, D: Runner.load verifies hashes by default (with an explicit opt-out) and refuses dtype changes
other than fp32 <-> fp16/bf16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit import Runner
from shardkit.checkpoint import CheckpointError


class _IntWeight(nn.Module):
    """Holds int64 data under the name a Linear keeps its float weight."""

    def __init__(self):
        super().__init__()
        self.register_buffer("weight", torch.arange(12).reshape(3, 4))
        self.register_buffer("bias", torch.zeros(3))


@pytest.fixture
def runner():
    return Runner(seed=0)


def _linear(dtype=torch.float32):
    torch.manual_seed(1)
    return nn.Linear(4, 3).to(dtype)


def test_flipped_bytes_are_refused_unless_verify_is_off(runner, tmp_path):
    saved = _linear()
    runner.save(tmp_path / "ckpt" / "step-1", {"model": saved})
    f = tmp_path / "ckpt" / "step-1" / "model.safetensors"
    data = bytearray(f.read_bytes())
    for i in range(1, 9):  # 8 flipped low bits: loads as slightly wrong weights without the hash
        data[-4 * i] ^= 0x01
    f.write_bytes(bytes(data))

    target = nn.Linear(4, 3)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"model\.safetensors: sha256 does not match"):
        runner.load(tmp_path / "ckpt", {"model": target})
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())  # nothing half-loaded

    runner.load(tmp_path / "ckpt", {"model": target}, verify=False)  # the explicit opt-out
    assert not torch.equal(target.bias, saved.bias)


def test_int64_data_is_not_loaded_into_a_float_parameter(runner, tmp_path):
    runner.save(tmp_path / "c", {"model": _IntWeight()})
    with pytest.raises(CheckpointError, match=r"'weight' is stored as torch\.int64 but the model holds torch\.float32"):
        runner.load(tmp_path / "c", {"model": nn.Linear(4, 3)})


@pytest.mark.parametrize("saved,loaded,ok", [
    (torch.bfloat16, torch.float32, True), (torch.float32, torch.bfloat16, True),
    (torch.float16, torch.float32, True), (torch.float32, torch.float16, True),
    (torch.float64, torch.float32, False), (torch.float16, torch.bfloat16, False),
    (torch.float32, torch.float64, False),
])
def test_only_documented_casts(runner, tmp_path, saved, loaded, ok):
    src = _linear(saved)
    runner.save(tmp_path / "c", {"model": src})
    dst = nn.Linear(4, 3).to(loaded)
    if ok:
        runner.load(tmp_path / "c", {"model": dst})
        assert torch.equal(dst.weight, src.weight.to(loaded))
    else:
        with pytest.raises(CheckpointError, match="only casts between float32 and float16/bfloat16"):
            runner.load(tmp_path / "c", {"model": dst})
