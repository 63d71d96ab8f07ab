"""torch.distributed.checkpoint (DCP) directories in one process: read as hostile input (crafted metadata refused by
name), resumed by a Runner with the uninterrupted losses in both of torch's layouts, written for torch's own
``dcp.load``, and ``shardkit convert`` between the formats with an atomic destination."""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from shardkit import Runner
from shardkit.checkpoint.convert import Progress, convert
from shardkit.checkpoint.dcp_metadata import read_dcp_index
from shardkit.checkpoint.dcp_reader import DCPCheckpointView
from shardkit.checkpoint.format import CheckpointError
from shardkit.checkpoint.formats import detect_format
from shardkit.checkpoint.safe_unpickle import UnsafePickleError
from shardkit.cli.commands import main as cli
from shardkit.strategies import SingleDevice

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
X = torch.randn(6, 8, 4, generator=torch.Generator().manual_seed(1))
Y = torch.randn(6, 8, 2, generator=torch.Generator().manual_seed(2))
SAVE_AT = 3


def _make():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return m, torch.optim.AdamW(m.parameters(), lr=0.05)


def _torch_steps(m, o, steps):
    out = []
    for i in steps:
        loss = ((m(X[i]) - Y[i]) ** 2).mean()
        loss.backward()
        o.step()
        o.zero_grad()
        out.append(loss.item())
    return out


def _runner_steps(r, m, steps):
    out = []
    for i in steps:
        loss = ((m(X[i]) - Y[i]) ** 2).mean()
        r.backward(loss)
        r.step()
        out.append(loss.item())
    return out


def _torch_save(path: Path, layout: str = "torch") -> list[float]:
    """Trains SAVE_AT steps with torch alone, saves with ``dcp.save`` in ``layout``, returns the next losses."""
    m, o = _make()
    _torch_steps(m, o, range(SAVE_AT))
    titan = layout == "torchtitan"
    msd, osd = get_state_dict(m, o, options=StateDictOptions(flatten_optimizer_state_dict=titan))
    state = {**msd, "optimizer": osd, "train_state": {"step": SAVE_AT}, "dataloader": {"dp_rank_0": io.BytesIO(b"x")}} \
        if titan else {"model": msd, "optimizer": osd}
    dcp.save(state, checkpoint_id=str(path))
    return _torch_steps(m, o, range(SAVE_AT, 6))


def _resumed(path: Path) -> tuple[list[float], int]:
    m, o = _make()
    r = Runner(SingleDevice("cpu"))
    m, o = r.setup(m, o)
    r.load(path, {"model": m, "optimizer": o})
    steps = r.optimizer_steps
    return _runner_steps(r, m, range(SAVE_AT, 6)), steps


@pytest.mark.parametrize("layout", ["torch", "torchtitan"])
def test_runner_resumes_a_dcp_save_with_the_uninterrupted_losses(tmp_path, layout):
    want = _torch_save(tmp_path / "dcp", layout)
    got, steps = _resumed(tmp_path / "dcp")
    assert got == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert steps == SAVE_AT
    view = DCPCheckpointView(tmp_path / "dcp")
    assert view.layout.style == layout
    assert set(view.unread) == ({"dataloader"} if layout == "torchtitan" else set())  # logged, not loaded
    # through shardkit's format, and back to DCP read by torch's own dcp.load
    convert(tmp_path / "dcp", tmp_path / "sk", "shardkit")
    assert detect_format(tmp_path / "sk") == "shardkit"
    assert _resumed(tmp_path / "sk")[0] == pytest.approx(want, rel=1e-6, abs=1e-7)
    convert(tmp_path / "sk", tmp_path / "back", "dcp", layout=layout)
    m, o = _make()
    _torch_steps(m, o, range(1))  # a state for dcp.load to fill in place
    titan = layout == "torchtitan"
    opts = StateDictOptions(flatten_optimizer_state_dict=titan)
    msd, osd = get_state_dict(m, o, options=opts)
    state = {**msd, "optimizer": osd} if titan else {"model": msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=str(tmp_path / "back"))
    msd = {k: state[k] for k in msd} if titan else state["model"]
    set_state_dict(m, o, model_state_dict=msd, optim_state_dict=state["optimizer"], options=opts)
    assert _torch_steps(m, o, range(SAVE_AT, 6)) == pytest.approx(want, rel=1e-6, abs=1e-7)


def test_torchtitans_layout_resumes_an_optimizer_whose_groups_share_their_hyperparameters(tmp_path):
    """The flattened layout keeps hyperparameters per parameter, not the groups: two groups with equal ones."""
    def make(wd=0.01):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        groups = [{"params": m[0].parameters()}, {"params": m[2].parameters(), "weight_decay": wd}]
        return m, torch.optim.AdamW(groups, lr=0.05)

    m, o = make()
    _torch_steps(m, o, range(SAVE_AT))
    msd, osd = get_state_dict(m, o, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({**msd, "optimizer": osd, "train_state": {"step": SAVE_AT}}, checkpoint_id=str(tmp_path / "dcp"))
    want = _torch_steps(m, o, range(SAVE_AT, 6))
    m, o = make()
    r = Runner(SingleDevice("cpu"))
    m, o = r.setup(m, o)
    r.load(tmp_path / "dcp", {"model": m, "optimizer": o})
    assert _runner_steps(r, m, range(SAVE_AT, 6)) == pytest.approx(want, rel=1e-6, abs=1e-7)
    # groups that differ: a parameter moved into a group whose saved hyperparameters are not its own is refused
    m, o = make(wd=0.1)
    _torch_steps(m, o, range(1))
    msd, osd = get_state_dict(m, o, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({**msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "dcp2"))
    m, o = make(wd=0.1)
    o.param_groups[1]["params"].append(o.param_groups[0]["params"].pop())  # 0.bias beside 2.weight
    r = Runner(SingleDevice("cpu"))
    m, o = r.setup(m, o)
    with pytest.raises(CheckpointError, match=r"'2\.weight' and '0\.bias' are in param group 1 .* different "
                       "hyperparameters"):
        r.load(tmp_path / "dcp2", {"model": m, "optimizer": o})


def test_convert_to_hf_writes_the_model_weights_and_the_cli_runs(tmp_path):
    _torch_save(tmp_path / "dcp")
    assert cli(["convert", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    from safetensors.torch import load_file

    m, o = _make()
    _torch_steps(m, o, range(SAVE_AT))
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert weights.keys() == m.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in m.state_dict().items())
    # DeepSpeed universal out, and back in: the same weights, the parent's latest_universal naming the tag
    assert cli(["convert", str(tmp_path / "dcp"), str(tmp_path / "ds" / "step3_universal"), "--to",
                "ds-universal"]) == 0
    assert (tmp_path / "ds" / "latest_universal").read_text() == "step3_universal"
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == ["latest_universal", "step3_universal"]
    assert cli(["convert", str(tmp_path / "ds" / "step3_universal"), str(tmp_path / "hf2"), "--to", "hf"]) == 0
    again = load_file(tmp_path / "hf2" / "model.safetensors")
    assert all(torch.equal(again[k], v) for k, v in m.state_dict().items())


def test_convert_keeps_dtypes_when_asked_and_refuses_options_its_target_ignores(tmp_path, capsys):
    from safetensors.torch import load_file

    w = torch.randn(3, 5).to(torch.bfloat16)
    dcp.save({"model": {"w": w}}, checkpoint_id=str(tmp_path / "dcp"))
    assert cli(["convert", str(tmp_path / "dcp"), str(tmp_path / "keep"), "--to", "hf", "--dtype", "keep"]) == 0
    kept = load_file(tmp_path / "keep" / "model.safetensors")["w"]
    assert kept.dtype == torch.bfloat16 and torch.equal(kept, w)
    assert load_file(convert(tmp_path / "dcp", tmp_path / "fp32", "hf")[0])["w"].dtype == torch.float32
    for args in (["--to", "shardkit", "--dtype", "bf16"], ["--to", "hf", "--layout", "torchtitan"]):
        assert cli(["convert", str(tmp_path / "dcp"), str(tmp_path / "x"), *args]) == 2
        assert f"{args[2]} applies to --to" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_failed_conversion_leaves_no_destination(tmp_path, monkeypatch):
    _torch_save(tmp_path / "dcp")
    calls = []

    def fail_on_third(t):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return t

    bar = Progress("test", enabled=False)
    monkeypatch.setattr(bar, "tick", fail_on_third)
    with pytest.raises(CheckpointError, match="No space left on device"):
        convert(tmp_path / "dcp", tmp_path / "out", "shardkit", progress=bar)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["dcp"], "staging directories were left behind"


def test_a_conversion_into_an_existing_dcp_directory_is_refused_and_leaves_it_alone(tmp_path):
    _torch_save(tmp_path / "a")
    _torch_save(tmp_path / "b")
    before = sorted(p.name for p in (tmp_path / "b").iterdir())
    for to in ("shardkit", "hf"):  # its files would sit beside the old checkpoint's, one directory holding two
        with pytest.raises(CheckpointError, match=r"\.metadata exists.*choose another output directory"):
            convert(tmp_path / "a", tmp_path / "b", to)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == before
    convert(tmp_path / "a", tmp_path / "b" / "hf", "hf")  # a directory of its own inside it is fine
    assert (tmp_path / "b" / "hf" / "model.safetensors").is_file()


def test_a_shardkit_conversion_keeps_the_users_values_and_scheduler(tmp_path):
    def state(runner_setup):
        m, o = runner_setup
        return {"model": m, "optimizer": o, "sched": torch.optim.lr_scheduler.StepLR(o, step_size=2), "epoch": 0}

    r = Runner(SingleDevice("cpu"))
    saved = state(r.setup(*_make()))
    _runner_steps(r, saved["model"], range(SAVE_AT))
    for _ in range(SAVE_AT):
        saved["sched"].step()
    r.save(tmp_path / "ck", {**saved, "epoch": 7})
    r.wait_for_save()
    convert(tmp_path / "ck", tmp_path / "sk", "shardkit")
    r2 = Runner(SingleDevice("cpu"))
    loaded = state(r2.setup(*_make()))
    values = r2.load(tmp_path / "sk", {k: v for k, v in loaded.items() if k != "epoch"})
    assert values == {"epoch": 7} and r2.optimizer_steps == SAVE_AT
    assert loaded["sched"].state_dict() == saved["sched"].state_dict()


def test_progress_draws_only_on_a_terminal(tmp_path):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    quiet, loud = io.StringIO(), Tty()
    for stream in (quiet, loud):
        bar = Progress("dcp -> hf", stream)
        bar._shown = -1.0
        bar.tick(torch.zeros(256))
        bar.close()
    assert quiet.getvalue() == ""
    assert "1 tensors, 1.0 KB" in loud.getvalue()


# ---- hostile metadata ------------------------------------------------------------------------------------------


def _edit_metadata(path: Path, edit) -> None:
    """Rewrites ``path/.metadata`` after ``edit(metadata)`` (the test trusts its own file)."""
    md = pickle.loads((path / ".metadata").read_bytes())
    edit(md)
    (path / ".metadata").write_bytes(pickle.dumps(md))


def _first_tensor(md):
    return next(k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks") and v.size)


def test_a_data_file_outside_the_directory_is_refused(tmp_path):
    _torch_save(tmp_path / "dcp")
    (tmp_path / "evil.distcp").write_bytes((tmp_path / "dcp" / "__0_0.distcp").read_bytes())

    def outside(md):
        for info in md.storage_data.values():
            info.relative_path = "../evil.distcp"

    _edit_metadata(tmp_path / "dcp", outside)
    with pytest.raises(CheckpointError, match=r"'\.\./evil\.distcp' is not a plain file name"):
        read_dcp_index(tmp_path / "dcp")


def test_a_data_file_that_is_a_symlink_is_refused(tmp_path):
    _torch_save(tmp_path / "dcp")
    data = tmp_path / "dcp" / "__0_0.distcp"
    os.rename(data, tmp_path / "real.distcp")
    os.symlink(tmp_path / "real.distcp", data)
    with pytest.raises(CheckpointError, match="is a symlink"):
        read_dcp_index(tmp_path / "dcp")


def test_a_size_larger_than_the_bytes_stored_is_refused(tmp_path):
    _torch_save(tmp_path / "dcp")

    def huge(md):
        meta = md.state_dict_metadata[_first_tensor(md)]  # a 2-D weight saved whole: one chunk at [0, 0]
        big = torch.Size([1 << 20, 1 << 20])
        meta.size, meta.chunks[0].sizes = big, big

    _edit_metadata(tmp_path / "dcp", huge)
    with pytest.raises(CheckpointError, match=r"claims 1099511627776 x 4 bytes but is stored in \d+ bytes"):
        read_dcp_index(tmp_path / "dcp")


def test_a_byte_range_past_the_end_of_its_file_is_refused(tmp_path):
    _torch_save(tmp_path / "dcp")

    def past_end(md):
        next(iter(md.storage_data.values())).length = 1 << 40

    _edit_metadata(tmp_path / "dcp", past_end)
    with pytest.raises(CheckpointError, match="are not inside .*truncated or the metadata forged"):
        read_dcp_index(tmp_path / "dcp")


def test_a_pickle_payload_is_refused_by_name_and_never_runs(tmp_path):
    _torch_save(tmp_path / "dcp")
    marker = tmp_path / "ran"
    (tmp_path / "dcp" / ".metadata").write_bytes(f"cos\nsystem\n(S'touch {marker}'\ntR.".encode())
    with pytest.raises(UnsafePickleError, match="refuses to load global 'os.system'"):
        read_dcp_index(tmp_path / "dcp")
    with pytest.raises(UnsafePickleError, match="'os.system'"):
        _resumed(tmp_path / "dcp")
    assert not marker.exists()


def test_a_value_record_with_a_payload_is_refused_by_name(tmp_path):
    """A non-tensor value (a param group's lr) is a torch.save record: it goes through the allowlist too."""
    _torch_save(tmp_path / "dcp")
    index = read_dcp_index(tmp_path / "dcp")
    assert "optimizer.param_groups.0.lr" in index.items

    class Payload:
        def __reduce__(self):
            return (os.system, ("true",))

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(Payload(), buf)
    (tmp_path / "dcp" / "__1_0.distcp").write_bytes(buf.getvalue())

    def point(md):
        for key, info in md.storage_data.items():
            if key.fqn == "optimizer.param_groups.0.lr":
                info.relative_path, info.offset, info.length = "__1_0.distcp", 0, len(buf.getvalue())

    _edit_metadata(tmp_path / "dcp", point)
    with pytest.raises(UnsafePickleError, match="'(posix|os).system'"):
        _resumed(tmp_path / "dcp")


def test_a_chunk_whose_shape_is_not_the_models_is_refused_before_anything_is_loaded(tmp_path):
    _torch_save(tmp_path / "dcp")
    torch.manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))  # the head differs
    before = m[0].weight.detach().clone()
    r = Runner(SingleDevice("cpu"))
    m, o = r.setup(m, torch.optim.AdamW(m.parameters()))
    with pytest.raises(CheckpointError, match=r"'2\.weight' was saved with shape \[2, 8\], the model has \[3, 8\]"):
        r.load(tmp_path / "dcp", {"model": m, "optimizer": o})
    assert torch.equal(m[0].weight, before), "a layer whose shape matched was loaded before the refusal"
