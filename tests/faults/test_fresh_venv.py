"""A new user's first hour, end to end: a fresh virtual environment, the README's first command, every example.

The environment is new (``python -m venv``) with shardkit installed into it from a wheel (``pip wheel .`` of a copy
of the packaging files: a non-editable install, the way ``pip install shardkit`` users get it; the editable one
of ``make demo`` is what every other test runs) and so is the user's cache (``XDG_CACHE_HOME``: no C++ ops built
yet). Third-party packages are not downloaded again: a ``.pth`` line lends the test environment's site-packages
(the CI budget cannot pay for installing torch, ~1 GB). Then ``make demo``'s command (``examples/train_llama.py``
on the shipped text, with fewer steps), a resumed run, and each example run as a user pastes them. Every run must
exit 0 with no traceback on the user's screen, and the C++ ops must be built exactly once, in one place, for all
of them, from the sources the wheel ships (``shardkit/ops/csrc``); a C++ op then matches its reference there.

Not run here: ``examples/generate.py``'s default ZeRO-3 (its DeepSpeed op build alone takes ~3 min on 2 cores;
the DeepSpeed build path has its own tests in test_build_lock.py); it runs with ``--strategy single``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]
_BUILD_LINE = "building C++ ops"
# What `pip wheel .` reads: copied so that the build is hermetic (no stale build/ of the checkout in the wheel)
_PACKAGING = ["setup.py", "pyproject.toml", "README.md", "MANIFEST.in", "CMakeLists.txt", "sdk", "csrc"]
# One C++ op against its reference, in the user's environment, away from the checkout (cwd is a temporary folder)
# (fp32: the kernels' dtype; float64 goes to the reference whatever the backend)
_OP_CHECK = """
import torch
from shardkit.ops import BUILDER, force_backend, rms_norm, rms_norm_reference
print("library", BUILDER.load())
print("sources", BUILDER.csrc)
x, w = torch.randn(5, 96), torch.randn(96)
expected = rms_norm_reference(x.double(), w.double()).float()
raw, _ = torch.ops.shardkit_C.rms_norm_fwd(x, w, 1e-6, 0.0)
with force_backend("cpp"):
    out = rms_norm(x, w)
torch.testing.assert_close(raw, expected)
torch.testing.assert_close(out, expected)
print("rms_norm cpp == reference")
"""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _wheel(tmp: Path) -> Path:
    """``pip wheel .`` of a copy of the packaging files; returns the wheel."""
    source = tmp / "source"
    source.mkdir(parents=True)
    for name in _PACKAGING:
        if (_REPO / name).is_dir():
            shutil.copytree(_REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
        else:
            shutil.copy2(_REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp / "dist"), str(source)], check=True, timeout=300, capture_output=True)
    (wheel,) = (tmp / "dist").glob("shardkit-*.whl")
    return wheel


def _fresh_venv(root: Path, wheel: Path) -> tuple[Path, Path]:
    """A new venv with shardkit installed from ``wheel``; returns its python and its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # the lent site-packages holds the checkout's editable finder too; .pth files in a lent folder are not run
    Path(site, "lent_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, timeout=300, capture_output=True)
    return python, Path(site)


def _user_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCH_EXTENSIONS_DIR", "SHARDKIT_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                "MASTER_", "TRITON_INTERPRET", "PYTEST", "PYTHONPATH"))}  # a fresh user's
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), HF_HOME=str(home / "hf"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="default")
    return env


def test_fresh_venv_readme_first_command_then_every_example(tmp_path):
    python, site = _fresh_venv(tmp_path / "venv", _wheel(tmp_path / "wheel"))
    home = tmp_path / "home"
    home.mkdir()
    env = _user_env(home)
    runs = {
        "make demo": ["examples/train_llama.py", "--out", str(tmp_path / "runs/demo"), "--steps", "12",
                      "--save-every", "6", "--log-every", "6"],
        "resume": ["examples/train_llama.py", "--out", str(tmp_path / "runs/demo"), "--steps", "16", "--resume",
                   "--save-every", "0", "--log-every", "4"],
        "generate": ["examples/generate.py", "--strategy", "single", "--checkpoint", str(tmp_path / "runs/demo"),
                     "--prompt", "To be", "--max-new-tokens", "8"],
        "trainer_causal_lm": ["examples/trainer_causal_lm.py", "--output_dir", str(tmp_path / "out/clm"),
                              "--max_steps", "4", "--logging_steps", "2", "--save_strategy", "no"],
        "trainer_classification": ["examples/trainer_classification.py", "--output_dir", str(tmp_path / "out/cls"),
                                   "--max_steps", "4", "--logging_steps", "2", "--save_strategy", "no"],
        "grpo": ["examples/grpo.py", "--max_steps", "2", "--output_dir", str(tmp_path / "out/grpo")],
        "sft tiny": ["examples/sft.py", "--make_tiny", str(tmp_path / "sft/tiny")],
        "sft": ["examples/sft.py", "--model_name_or_path", str(tmp_path / "sft/tiny"), "--dataset_name",
                str(tmp_path / "sft/tiny/chat"), "--chat_template_format", "chatml", "--splits", "train,test",
                "--max_seq_len", "128", "--max_steps", "2", "--logging_steps", "1", "--save_strategy", "no",
                "--output_dir", str(tmp_path / "sft/out"), "--per_device_train_batch_size", "2", "--packing", "True",
                "--dataset_text_field", "content", "--use_peft_lora", "True", "--lora_target_modules", "all-linear"],
    }
    shipped = {p.name for p in (_REPO / "examples").glob("*.py")}
    assert shipped == {Path(argv[0]).name for argv in runs.values()}, "an example is not run here: add it"
    builds = 0
    for name, argv in runs.items():
        done = subprocess.run([str(python), *argv], cwd=_REPO, env=env, capture_output=True, text=True, timeout=600)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{name} failed:\n{output[-4000:]}"
        assert "Traceback" not in output, f"{name} showed a traceback:\n{output[-4000:]}"
        builds += output.count(_BUILD_LINE)
        print(f"{name}: ok ({output.count(_BUILD_LINE)} C++ builds)")
    assert builds == 1, f"the C++ ops were built {builds} times; once is enough"
    built = list((home / ".cache" / "torch_extensions").glob("*/shardkit_C/shardkit_C.so"))
    assert len(built) == 1, built  # one location: torch's per-user cache, where DeepSpeed's ops go too
    shipped_sources = (site / "shardkit" / "ops" / "csrc").resolve()
    ninja = (built[0].parent / "build.ninja").read_text()
    assert str(shipped_sources / "rms_norm" / "rms_norm.cpp") in ninja and str(_REPO / "csrc") not in ninja
    done = subprocess.run([str(python), "-c", _OP_CHECK], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert f"library {built[0]}" in done.stdout and f"sources {shipped_sources}" in done.stdout, done.stdout
    assert "rms_norm cpp == reference" in done.stdout, done.stdout
