"""DeepSpeed universal checkpoints without DeepSpeed: shardkit -> universal -> shardkit keeps every tensor bit for bit
(in ZeRO-1/2's file layout and in ZeRO-3's), and crafted universal folders are refused by name, leaving nothing at
the destination. Against DeepSpeed's own engine and ds_to_universal: tests/distributed/test_ds_universal_engine.py."""

import os
import shutil

import pytest
import torch
from torch import nn

import shardkit
from shardkit.checkpoint import CheckpointError, CheckpointReader
from shardkit.checkpoint.ds_universal import is_universal_checkpoint, shardkit_to_universal, universal_to_shardkit
from shardkit.checkpoint.safe_unpickle import UnsafePickleError


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.proj = nn.Linear(6, 5)
        self.register_buffer("count", torch.tensor([3], dtype=torch.int64))

    def forward(self, ids):
        return self.proj(self.embed(ids))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A shardkit checkpoint after 2 AdamW steps with two param groups, and its universal conversion."""
    root = tmp_path_factory.mktemp("src")
    torch.manual_seed(0)
    runner = shardkit.Runner(strategy="single", precision="fp32")
    model = Tiny()
    opt = torch.optim.AdamW([{"params": [model.embed.weight], "weight_decay": 0.1},
                             {"params": list(model.proj.parameters()), "weight_decay": 0.0, "lr": 0.003}], lr=0.01)
    model, opt = runner.setup(model, opt)
    for step in range(2):
        runner.backward(model(torch.arange(step, step + 4).view(2, 2)).pow(2).mean())
        runner.step()
    runner.save(root / "sk" / "step-2", {"model": model, "optimizer": opt})
    shardkit_to_universal(root / "sk", root / "ds" / "global_step2_universal")
    return root


def _tensors(path):
    """Every tensor of a shardkit checkpoint's model and optimizer, whatever layout wrote it."""
    with CheckpointReader(path) as r:
        out = {f"model:{k}": v for k, v in r.iter_full_tensors("model")}
        if r.has("optimizer.meta"):
            out.update({f"optimizer:{k}": v for k, v in r.iter_full_tensors("optimizer")})
            meta = r.read_state("optimizer.meta")
            groups, steps = meta["param_groups"], {n: s["step"] for n, s in meta["scalars"].items()}
        else:
            full = r.read_state("optimizer")
            out.update({f"optimizer:{n}/{k}": v for n, st in full["state"].items() for k, v in st.items()
                        if k != "step"})
            groups, steps = full["param_groups"], {n: st["step"] for n, st in full["state"].items()}
    return out, groups, {n: float(s) for n, s in steps.items()}


def _copy(source, tmp_path):
    return shutil.copytree(source / "ds", tmp_path / "ds")


def _as_zero3(ds):
    """ZeRO-3's layout as ds_to_universal writes it: bare flat tensors, the step only in optimizer_state.pt."""
    tag = ds / "global_step2_universal"
    for d in (tag / "zero").iterdir():
        for f in d.glob("*.pt"):
            if f.name == "step.pt":
                f.unlink()
            else:
                torch.save(torch.load(f)["param"].reshape(-1).clone(), f)
    (tag / "mp_rank_00_model_states.pt").unlink()  # ZeRO-3's engine names its model states by rank
    return ds


def _as_zero12(ds):
    """ZeRO-1/2's layout as ds_to_universal writes it: the step only in each parameter's step.pt."""
    f = ds / "global_step2_universal" / "zero" / "optimizer_state.pt"
    torch.save({k: v for k, v in torch.load(f, weights_only=False).items() if k != "optimizer_state_dict"}, f)
    return ds


@pytest.mark.parametrize("layout", ["zero12", "zero3"])
def test_round_trip_keeps_every_tensor_the_groups_and_the_step(source, tmp_path, layout):
    ds = (_as_zero12 if layout == "zero12" else _as_zero3)(_copy(source, tmp_path))
    assert is_universal_checkpoint(ds) and is_universal_checkpoint(ds / "global_step2_universal")
    seen = []
    out = universal_to_shardkit(ds, tmp_path / "back", progress=lambda done, total: seen.append((done, total)))
    want, want_groups, want_steps = _tensors(source / "sk")
    got, groups, steps = _tensors(out)
    assert sorted(got) == sorted(want) and seen[-1] == (len(want), len(want)) and len(seen) == len(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert steps == want_steps == dict.fromkeys(["embed.weight", "proj.weight", "proj.bias"], 2.0)
    assert [g["params"] for g in groups] == [g["params"] for g in want_groups]
    assert [(g["lr"], g["weight_decay"], tuple(g["betas"])) for g in groups] == \
        [(g["lr"], g["weight_decay"], tuple(g["betas"])) for g in want_groups] == [(0.01, 0.1, (0.9, 0.999)),
                                                                                   (0.003, 0.0, (0.9, 0.999))]


def test_opening_a_universal_checkpoint_directly_names_the_conversion_that_reads_it(source):
    # zero-to-fp32 (the advice for a ZeRO checkpoint) refuses a universal folder, and would drop the optimizer
    for path in (source / "ds", source / "ds" / "global_step2_universal"):
        with pytest.raises(CheckpointError, match="DeepSpeed universal checkpoint.*shardkit convert .* --to shardkit"):
            CheckpointReader(path)


def test_tied_names_read_their_parameter(source, tmp_path):
    ds = _copy(source, tmp_path)
    _edit_model_states(ds, lambda s: s.update(shared_params={"head.weight": "embed.weight", "gone": "missing"}))
    with CheckpointReader(universal_to_shardkit(ds, tmp_path / "back")) as r:
        assert torch.equal(r.read_full("model", "head.weight"), r.read_full("model", "embed.weight"))
        assert "gone" not in r.sharded_keys("model")


def test_a_converted_checkpoint_resumes_a_runner(source, tmp_path):
    universal_to_shardkit(source / "ds", tmp_path / "back")
    torch.manual_seed(5)
    runner = shardkit.Runner(strategy="single", precision="fp32")
    model = Tiny()
    opt = torch.optim.AdamW([{"params": [model.embed.weight]}, {"params": list(model.proj.parameters())}], lr=1.0)
    model, opt = runner.setup(model, opt)
    runner.load(tmp_path / "back", {"model": model, "optimizer": opt})
    with CheckpointReader(source / "sk") as r:
        assert torch.equal(model.proj.weight.detach(), r.read_full("model", "proj.weight"))
    assert runner.optimizer_steps == 2 and [g["lr"] for g in opt.param_groups] == [0.01, 0.003]
    assert int(model.count) == 3
    # resumed as after a step, as the Runner's own saves are: no window is open, so step() before a backward
    # neither steps nor counts one
    weight = model.proj.weight.detach().clone()
    assert runner.step() is False and runner.optimizer_steps == 2
    assert torch.equal(model.proj.weight.detach(), weight)


def test_convert_refuses_a_destination_before_converting_anything(source, tmp_path):
    from shardkit.checkpoint.convert import Progress, convert

    bar = Progress("test", enabled=False)
    with pytest.raises(CheckpointError, match="is a checkpoint directory"):
        convert(source / "ds", source / "sk" / "step-2", "shardkit", progress=bar)
    assert bar.tensors == 0, "the whole source was converted before the destination was refused"


def _model_states(ds):
    return ds / "global_step2_universal" / "mp_rank_00_model_states.pt"


def _edit_model_states(ds, edit):
    f = _model_states(ds)
    state = torch.load(f, weights_only=False)
    edit(state)
    torch.save(state, f)


class _Payload:
    def __reduce__(self):
        return os.system, ("touch pwned",)


def _tag_file(ds, name):
    return ds / "global_step2_universal" / "zero" / name


def _escaping_name(ds):
    def rename(state):
        state["param_shapes"][0] = {"../../escape": state["param_shapes"][0]["embed.weight"]}
    _edit_model_states(ds, rename)


def _symlinked_parameter(ds):
    shutil.move(_tag_file(ds, "proj.bias"), ds / "elsewhere")
    os.symlink(ds / "elsewhere", _tag_file(ds, "proj.bias"))


def _truncated(ds):
    f = _tag_file(ds, "proj.weight/exp_avg.pt")
    f.write_bytes(f.read_bytes()[:200])


def _larger_than_the_bytes(ds):
    _edit_model_states(ds, lambda s: s["param_shapes"][1].update({"proj.weight": torch.Size([1 << 20, 1 << 20])}))


def _pickle_payload(ds):
    torch.save({"param": _Payload()}, _tag_file(ds, "proj.bias/fp32.pt"))


def _edit_optimizer_state(ds, **fields):
    f = _tag_file(ds, "optimizer_state.pt")
    torch.save({**torch.load(f, weights_only=False), **fields}, f)


CASES = {
    "escaping name": (_escaping_name, "'../../escape' is not a plain file name"),
    "symlinked parameter": (_symlinked_parameter, "is a symlink"),
    "truncated tensor file": (_truncated, "proj.weight/exp_avg.pt: not a complete torch.save"),
    "size larger than the bytes": (_larger_than_the_bytes, "but parameter 'proj.weight' has shape [1048576, 1048576]"),
    "pickle payload": (_pickle_payload, "refuses to load global 'posix.system'"),
    "group naming no flat group": (lambda ds: _edit_optimizer_state(ds, param_groups=[{"lr": 0.1, "params": [0, 7]}]),
                                   "names flat group 7"),
    "steps that disagree": (lambda ds: _edit_optimizer_state(
        ds, optimizer_state_dict={"state": {0: {"step": 2}, 1: {"step": 9}}}), "the step counts disagree"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_universal_folders_are_refused_by_name_and_leave_nothing(source, tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    ds = _copy(source, tmp_path)
    craft, named = CASES[case]
    craft(ds)
    with pytest.raises(CheckpointError) as err:
        universal_to_shardkit(ds, tmp_path / "out" / "ckpt")
    assert named in str(err.value)
    assert case != "pickle payload" or isinstance(err.value, UnsafePickleError)
    assert not (tmp_path / "pwned").exists()
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_shardkit_to_universal_failures_leave_no_destination(source, tmp_path):
    def boom(done, total):
        if done == 3:
            raise RuntimeError("disk pulled")

    with pytest.raises(RuntimeError, match="disk pulled"):
        shardkit_to_universal(source / "sk", tmp_path / "ds" / "global_step2_universal", progress=boom)
    assert not (tmp_path / "ds").exists() or not list((tmp_path / "ds").iterdir())
    (tmp_path / "taken").mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        shardkit_to_universal(source / "sk", tmp_path / "taken")
    with pytest.raises(CheckpointError, match="lies inside the checkpoint"):
        shardkit_to_universal(source / "sk", source / "sk" / "step-2" / "inside")
    out = shardkit_to_universal(source / "sk", tmp_path / "plain" / "tag", point_latest=False)
    assert sorted(p.name for p in out.parent.iterdir()) == ["tag"] and is_universal_checkpoint(out)
