"""The one reader of time limits from the environment, as both its callers use it."""

from __future__ import annotations

import pytest

from shardkit.inference.sync import ENTRY_TIMEOUT_ENV_VAR, entry_timeout
from shardkit.ops.build_lock import build_timeout_s


@pytest.mark.parametrize("name, read, default", [("SHARDKIT_BUILD_TIMEOUT_S", build_timeout_s, 1800.0),
                                                 (ENTRY_TIMEOUT_ENV_VAR, entry_timeout, 60.0)])
def test_time_limits_from_the_environment_are_read_and_checked_alike(monkeypatch, name, read, default):
    monkeypatch.setenv(name, " ")
    assert read() == default
    monkeypatch.setenv(name, "2.5")
    assert read() == 2.5
    for bad, problem in [("soon", "is not a number of seconds"), ("0", "must be a positive, finite"),
                         ("inf", "must be a positive, finite"), ("nan", "must be a positive, finite")]:
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}='{bad}' {problem}.*e.g. {default:.0f}"):
            read()
