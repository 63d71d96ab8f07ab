"""Where the builder finds the C++ sources: an installed wheel's package data first, the source checkout second.

The end-to-end case (a wheel installed in a fresh venv builds and runs the ops) is tests/faults/test_fresh_venv.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from shardkit.ops import _builder
from shardkit.ops._builder import ExtensionBuilder, ExtensionUnavailable, find_csrc

_REPO = Path(__file__).resolve().parents[2]


def _sources(root: Path) -> Path:
    (root / "include").mkdir(parents=True)
    (root / "op").mkdir()
    (root / "op" / "op.cpp").write_text("int f() { return 1; }\n")
    return root


def test_installed_package_data_first_then_checkout_then_none(tmp_path, monkeypatch):
    shipped, checkout = tmp_path / "site" / "shardkit" / "ops" / "csrc", _sources(tmp_path / "repo" / "csrc")
    monkeypatch.setattr(_builder, "CSRC_PLACES", (shipped, checkout))
    assert find_csrc(_builder.CSRC_PLACES) == checkout and ExtensionBuilder().csrc == checkout
    _sources(shipped)
    assert find_csrc(_builder.CSRC_PLACES) == shipped and ExtensionBuilder().csrc == shipped
    assert ExtensionBuilder().sources(cuda=False) == [str(shipped / "op" / "op.cpp")]
    assert find_csrc([tmp_path / "none", tmp_path / "neither"]) is None


def test_checkout_sources_when_not_installed_as_wheel():
    # the checkout has no sdk/ops/csrc (setup.py copies csrc/ there only inside a wheel)
    assert not _builder.CSRC_PLACES[0].exists()
    assert _builder.BUILDER.csrc == _REPO / "csrc"


def test_no_sources_anywhere_names_every_place_searched(tmp_path, monkeypatch):
    monkeypatch.setattr(_builder, "CSRC_PLACES", (tmp_path / "shipped", tmp_path / "checkout"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    builder = ExtensionBuilder(name="shardkit_nosources_test")
    with warnings.catch_warnings(record=True), pytest.raises(ExtensionUnavailable) as caught:
        warnings.simplefilter("always")
        builder.load()
    message = str(caught.value)
    assert f"no C++ sources under {tmp_path / 'shipped'} or {tmp_path / 'checkout'}" in message
    assert "Reinstall shardkit" in message and "pip install -e ." in message


def test_the_builder_loads_by_path_before_shardkit_is_installed():
    """setup.py's ahead-of-time build loads sdk/ops/_builder.py by path while shardkit is not importable yet; its
    build lock read its time limits through `shardkit.utils` and broke that (ImportError) until it fell back."""
    import subprocess
    import sys

    code = ("import sys, importlib.util as u; sys.modules['shardkit'] = None; "  # None: `import shardkit` fails
            f"s = u.spec_from_file_location('_b', {str(_REPO / 'sdk' / 'ops' / '_builder.py')!r}); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); print(m.find_csrc(m.CSRC_PLACES))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("csrc")
