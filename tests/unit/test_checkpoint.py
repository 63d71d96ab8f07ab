"""Round-trips, `latest`, keep_last and error messages of shardkit.checkpoint (single process)."""

import json
import random

import numpy as np
import pytest
import torch

from shardkit.checkpoint import (
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
    capture_rng_state,
    load_optimizer_state_by_name,
    optimizer_state_by_name,
    resolve_checkpoint,
    restore_rng_state,
)


def _save(path, **entries):
    with CheckpointWriter(path, info={"step": 1}) as w:
        for name, (kind, obj) in entries.items():
            getattr(w, f"write_{kind}")(name, obj)


def test_tensors_roundtrip_bf16_noncontiguous_tied(tmp_path):
    emb = torch.randn(5, 3)
    tensors = {
        "emb.weight": emb,
        "head.weight": emb,  # tied
        "bf": torch.randn(4, 6).to(torch.bfloat16),
        "half": torch.randn(7).half(),
        "t": torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous
        "sliced": torch.arange(20).reshape(4, 5)[:, 1:3],
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "mask": torch.tensor([True, False]),
    }
    assert not tensors["t"].is_contiguous()
    with CheckpointWriter(tmp_path / "step-1", info={"step": 1}) as w:
        w.write_tensors("model", tensors, metadata={"note": "x"})
    r = CheckpointReader(tmp_path / "step-1", verify=True)
    got = r.read_tensors("model")
    assert list(got) == list(tensors)
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    assert got["emb.weight"] is got["head.weight"]
    assert r.aliases("model") == {"head.weight": "emb.weight"}
    assert r.read_metadata("model")["note"] == "x"
    assert r.info == {"step": 1} and r.world_size == 1 and r.has("model") and not r.has("nope")
    # a view of a tied tensor with a different shape is not an alias
    assert "sliced" not in r.aliases("model")
    assert dict(r.iter_full_tensors("model"))["t"].equal(tensors["t"])


def test_state_roundtrip_exact(tmp_path):
    shared = torch.ones(3)
    nested = {
        "a": (1, 2.5, "s", None, True),
        3: {"int_key": torch.arange(4)},
        (1, "x"): [shared, shared, {"deep": (torch.tensor(1.0),)}],
        "np": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "np_f16": np.ones(2, dtype=np.float16),
        "npscalar": np.float64(0.1),
        "npint": np.int64(-7),
        "floats": [float("nan"), float("inf"), -0.0, 1e-300],
        "big": 2**80,
        "dtype": torch.bfloat16,
        "empty": {},
        "empty_t": (),
    }
    with CheckpointWriter(tmp_path / "c") as w:
        w.write_state("state", nested)
    got = CheckpointReader(tmp_path / "c", verify=True).read_state("state")
    assert got["a"] == (1, 2.5, "s", None, True) and type(got["a"]) is tuple
    assert torch.equal(got[3]["int_key"], torch.arange(4))
    lst = got[(1, "x")]
    assert lst[0] is lst[1] and torch.equal(lst[0], shared) and isinstance(lst[2]["deep"], tuple)
    assert got["np"].dtype == np.uint32 and np.array_equal(got["np"], nested["np"])
    assert got["np_f16"].dtype == np.float16
    assert type(got["npscalar"]) is np.float64 and got["npscalar"] == np.float64(0.1)
    assert type(got["npint"]) is np.int64 and got["npint"] == -7
    f = got["floats"]
    assert np.isnan(f[0]) and f[1] == float("inf") and str(f[2]) == "-0.0" and f[3] == 1e-300
    assert got["big"] == 2**80 and got["dtype"] is torch.bfloat16
    assert got["empty"] == {} and got["empty_t"] == ()


def test_state_rejects_unknown_types(tmp_path):
    with pytest.raises(CheckpointError, match="opt.*object"):
        with CheckpointWriter(tmp_path / "c") as w:
            w.write_state("opt", {"x": object()})
    assert not (tmp_path / "c").exists() and not (tmp_path / ".c.tmp").exists()


def test_json_roundtrip_and_rejects_non_json(tmp_path):
    with CheckpointWriter(tmp_path / "c") as w:
        w.write_json("trainer_state", {"step": 3, "loss": [1.5, 2.0]})
        with pytest.raises(CheckpointError, match="write_state"):
            w.write_json("bad", {"t": torch.ones(1)})
    assert CheckpointReader(tmp_path / "c").read_json("trainer_state") == {"step": 3, "loss": [1.5, 2.0]}


def _adam_model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam([{"params": m[0].parameters(), "lr": 1e-2}, {"params": m[2].parameters(), "lr": 3e-3}])
    return m, opt


def _steps(m, opt, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(16, 4, generator=g)
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()


def test_optimizer_by_name_resumes_identically(tmp_path):
    m, opt = _adam_model()
    _steps(m, opt, 3, seed=1)
    with CheckpointWriter(tmp_path / "c") as w:
        w.write_tensors("model", m.state_dict())
        w.write_state("optimizer", optimizer_state_by_name(opt, m))
    saved = optimizer_state_by_name(opt, m)
    assert set(saved["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert saved["param_groups"][1]["params"] == ["2.weight", "2.bias"]
    _steps(m, opt, 2, seed=2)

    m2, _ = _adam_model()
    # the fresh optimizer lists its groups in the opposite order inside each group: names, not positions, match
    opt2 = torch.optim.Adam([{"params": [m2[0].bias, m2[0].weight], "lr": 0.5},
                             {"params": [m2[2].bias, m2[2].weight], "lr": 0.5}])
    r = CheckpointReader(tmp_path / "c")
    m2.load_state_dict(r.read_tensors("model"))
    load_optimizer_state_by_name(opt2, m2, r.read_state("optimizer"))
    assert opt2.param_groups[0]["lr"] == 1e-2 and opt2.param_groups[1]["lr"] == 3e-3
    _steps(m2, opt2, 2, seed=2)
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_optimizer_by_name_errors():
    m, opt = _adam_model()
    _steps(m, opt, 1, seed=1)
    other = torch.nn.Linear(4, 8)
    with pytest.raises(CheckpointError, match="not in"):
        optimizer_state_by_name(opt, other)
    saved = optimizer_state_by_name(opt, m)
    saved["param_groups"][0]["params"][0] = "renamed.weight"
    saved["state"]["renamed.weight"] = saved["state"].pop("0.weight")
    with pytest.raises(CheckpointError, match="renamed.weight"):
        load_optimizer_state_by_name(opt, m, saved)
    one_group = torch.optim.Adam(m.parameters())
    with pytest.raises(CheckpointError, match="2 param groups"):
        load_optimizer_state_by_name(one_group, m, optimizer_state_by_name(opt, m))


def test_rng_roundtrip_gives_identical_draws(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    with CheckpointWriter(tmp_path / "c") as w:
        w.write_state("rng", capture_rng_state())

    def draws():
        return random.random(), np.random.randn(3).tolist(), torch.rand(3).tolist()

    first = draws()
    draws()
    restore_rng_state(CheckpointReader(tmp_path / "c").read_state("rng"))
    assert draws() == first


def test_latest_and_keep_last(tmp_path):
    (tmp_path / "notes").mkdir()  # not a checkpoint: never pruned
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "shardkit.json").write_text('{"format": "other"}')
    for step in range(1, 5):
        with CheckpointWriter(tmp_path / f"step-{step}", keep_last=2, info={"step": step}) as w:
            w.write_json("s", {"step": step})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign", "latest", "notes",
                                                          "step-3", "step-4"]
    assert (tmp_path / "latest").read_text().strip() == "step-4"
    assert resolve_checkpoint(tmp_path) == tmp_path / "step-4"
    assert CheckpointReader(tmp_path).info == {"step": 4}


def test_resave_same_name_replaces(tmp_path):
    for v in (1, 2):
        with CheckpointWriter(tmp_path / "final") as w:
            w.write_tensors("model", {"w": torch.full((2,), float(v))})
    assert torch.equal(CheckpointReader(tmp_path).read_full("model", "w"), torch.full((2,), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "latest"]


def test_exception_inside_save_publishes_nothing(tmp_path):
    _save(tmp_path / "step-1", model=("tensors", {"w": torch.ones(2)}))
    with pytest.raises(ValueError, match="boom"):
        with CheckpointWriter(tmp_path / "step-2") as w:
            w.write_tensors("model", {"w": torch.zeros(2)})
            raise ValueError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1"]
    assert resolve_checkpoint(tmp_path).name == "step-1"


def test_stale_tmp_dir_is_removed(tmp_path):
    stale = tmp_path / ".step-1.tmp"
    stale.mkdir()
    (stale / "junk.safetensors").write_bytes(b"x" * 10)
    _save(tmp_path / "step-1", model=("tensors", {"w": torch.ones(2)}))
    assert not stale.exists()
    assert sorted(CheckpointReader(tmp_path).manifest["files"]) == ["model.safetensors"]


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "step-1"
    _save(path, model=("tensors", {"w": torch.arange(64.0)}), trainer_state=("json", {"step": 1}))
    return path


def test_flipped_byte_caught_by_verify(ckpt):
    f = ckpt / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    r = CheckpointReader(ckpt)  # sizes still match: the hash is checked as the file is read
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*sha256"):
        r.read_tensors("model")
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*sha256"):
        CheckpointReader(ckpt).verify_all()
    # the explicit opt-out reads the flipped byte as data
    assert not torch.equal(CheckpointReader(ckpt, verify=False).read_tensors("model")["w"], torch.arange(64.0))


def test_truncated_file(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        CheckpointReader(ckpt)


def test_bad_json_entry_and_manifest(ckpt):
    f = ckpt / "trainer_state.json"
    f.write_bytes(b"{" * f.stat().st_size)
    with pytest.raises(CheckpointError, match=r"trainer_state\.json.*sha256"):
        CheckpointReader(ckpt).read_json("trainer_state")
    with pytest.raises(CheckpointError, match=r"trainer_state\.json.*not valid JSON"):
        CheckpointReader(ckpt, verify=False).read_json("trainer_state")
    (ckpt / "shardkit.json").write_text('{"format": "shardkit-checkpoint", "vers')
    with pytest.raises(CheckpointError, match=r"shardkit\.json.*not valid JSON"):
        CheckpointReader(ckpt)


def test_corrupt_safetensors_header(ckpt):
    f = ckpt / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:12] = b"XXXX"
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*safetensors"):
        CheckpointReader(ckpt, verify=False).read_tensors("model")


def test_unknown_version(ckpt):
    m = json.loads((ckpt / "shardkit.json").read_text())
    m["version"] = 99
    (ckpt / "shardkit.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=r"shardkit\.json.*version 99"):
        CheckpointReader(ckpt)


def test_missing_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*missing"):
        CheckpointReader(ckpt)


def test_foreign_torch_save_dir(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match=r"shardkit\.json.*torch\.save.*model\.pt"):
        CheckpointReader(tmp_path)


def test_foreign_deepspeed_dir(tmp_path):
    (tmp_path / "latest").write_text("global_step10")
    step = tmp_path / "global_step10"
    step.mkdir()
    (step / "mp_rank_00_model_states.pt").write_bytes(b"\x80")
    (step / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"\x80")
    with pytest.raises(CheckpointError, match=r"global_step10.*shardkit\.json.*DeepSpeed.*mp_rank_00"):
        CheckpointReader(tmp_path)


def test_nothing_there(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        resolve_checkpoint(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="not a shardkit checkpoint"):
        resolve_checkpoint(tmp_path)
