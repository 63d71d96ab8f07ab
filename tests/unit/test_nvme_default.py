"""NVMe offload without an nvme_path: the card's one-liner works, the default directory is chosen, logged
once, used by the engine config and removed at teardown (only when shardkit made it)."""

from __future__ import annotations

import logging
import os
import tempfile

import pytest

from shardkit.strategies import strategy_from_name
from shardkit.strategies.zero.config import NVME_PATH_ENV_VAR, default_nvme_path, libaio_available

pytestmark = pytest.mark.skipif(not libaio_available(), reason="NVMe offload needs libaio (apt-get install libaio-dev)")


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """The system temp dir, redirected into this test's directory, with no SHARDKIT_NVME_PATH set."""
    monkeypatch.delenv(NVME_PATH_ENV_VAR, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_default_is_a_new_directory_under_the_temp_dir(temp_root):
    path, created = default_nvme_path(rank=1)
    other, _ = default_nvme_path(rank=1)

    assert created and os.path.isdir(path) and os.path.dirname(path) == str(temp_root)
    assert "rank1" in os.path.basename(path) and other != path  # one per job and rank, never reused


def test_environment_variable_wins(temp_root, monkeypatch):
    monkeypatch.setenv(NVME_PATH_ENV_VAR, str(temp_root / "fast"))

    assert default_nvme_path(rank=0) == (str(temp_root / "fast"), False)


def test_names_build_working_strategies_without_required_arguments():
    infinity = strategy_from_name("zero_infinity")
    tp = strategy_from_name("tp")

    assert infinity.settings.uses_nvme and infinity.settings.nvme_path is None
    assert tp.settings.tp_size is None  # the world size, once the Runner starts


def test_runner_one_liner_uses_logs_and_removes_the_default(temp_root, caplog):
    from shardkit import Runner
    from shardkit.precision import BF16
    from shardkit.strategies.zero import ZeRO3

    with caplog.at_level(logging.WARNING, logger="shardkit"):
        runner = Runner(strategy=ZeRO3(offload="nvme"), precision=BF16())
    try:
        path = runner.strategy.settings.nvme_path
        zero = runner.strategy.deepspeed_config()["zero_optimization"]
        notes = [r.getMessage() for r in caplog.records if "NVMe" in r.getMessage()]
        assert os.path.isdir(path) and os.path.dirname(path) == str(temp_root)
        assert zero["offload_param"]["nvme_path"] == path == zero["offload_optimizer"]["nvme_path"]
        assert len(notes) == 1 and path in notes[0] and NVME_PATH_ENV_VAR in notes[0]
    finally:
        runner.teardown()
    assert not os.path.exists(path)


def test_runner_keeps_a_directory_it_did_not_make(temp_root, monkeypatch):
    from shardkit import Runner
    from shardkit.strategies.zero import ZeROInfinity

    given = temp_root / "mine"
    monkeypatch.setenv(NVME_PATH_ENV_VAR, str(given))
    runner = Runner(strategy=ZeROInfinity())
    try:
        assert runner.strategy.settings.nvme_path == str(given)
    finally:
        runner.teardown()
    assert given.is_dir()
