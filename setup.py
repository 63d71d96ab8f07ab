"""Packaging glue that pyproject.toml cannot express.

The repository folder ``sdk/`` is the package ``shardkit`` (``sdk/kernels/`` is ``shardkit.kernels``) and ``csrc/``
ships as the package data ``shardkit/ops/csrc``;
the subpackage list is computed here so that a new folder needs no edit. Setting
``SHARDKIT_BUILD_OPS=1`` builds the C++/CUDA extension ahead of time instead of on first import.
"""

import importlib.util
import os
from pathlib import Path

from setuptools import find_namespace_packages, find_packages, setup


def _packages() -> list[str]:
    found = ["shardkit"] + [f"shardkit.{name}" for name in find_packages("sdk")]
    csrc = ["shardkit.ops.csrc"] + [f"shardkit.ops.csrc.{name}" for name in _csrc_folders()]
    return found + csrc


def _csrc_folders() -> list[str]:
    """csrc/'s folders as (data-only) packages, so that setuptools ships their files without a warning.

    The C++/CUDA sources are package data so that a wheel (non-editable) install can JIT-build the ops from
    shardkit/ops/csrc (sdk/ops/_builder.py looks there first, then in the checkout's csrc/). The torch-free
    ctest sources (csrc/tests/) stay out: only CMakeLists.txt builds them, from a checkout.
    """
    return find_namespace_packages("csrc", exclude=["tests", "tests.*", "build", "build.*"])


def _ops_build_args() -> dict:
    """With SHARDKIT_BUILD_OPS=1: the one ``shardkit.ops._C`` extension from the same builder the JIT path uses.

    The builder is loaded from its file (not through ``import shardkit``) so that only torch is needed here;
    its AOT flags leave out -march=native, since a wheel runs on other CPUs than the one that built it.
    """
    if os.environ.get("SHARDKIT_BUILD_OPS") != "1":
        return {}
    from torch.utils.cpp_extension import BuildExtension

    path = Path(__file__).resolve().parent / "sdk" / "ops" / "_builder.py"
    spec = importlib.util.spec_from_file_location("_shardkit_builder", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {
        "ext_modules": [module.BUILDER.aot_extension()],
        "cmdclass": {"build_ext": BuildExtension.with_options(use_ninja=True)},
    }


_SOURCES = ["*.cpp", "*.cu", "*.h", "*.cuh"]
_CSRC_DATA = {package: _SOURCES for package in _packages() if package.startswith("shardkit.ops.csrc")}
setup(packages=_packages(), package_data={"shardkit": ["py.typed"], **_CSRC_DATA}, **_ops_build_args())
