"""`shardkit env`: the versions and devices a bug report needs, as a block ready to paste."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

__all__ = ["collect_environment", "format_environment", "register"]

NOT_INSTALLED = "not installed"
_PACKAGES = ("deepspeed", "triton", "transformers", "accelerate", "peft", "bitsandbytes", "safetensors", "numpy")
_ENV_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "TORCH_EXTENSIONS_DIR", "OMP_NUM_THREADS", "CUDA_HOME")


def _version(distribution: str) -> str:
    # NOTE: package metadata, not `import`: importing deepspeed takes seconds and prints; a report
    # must work even when the package it describes is broken.
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return NOT_INSTALLED


def _first_line(command: list[str], pick: str | None = None) -> str:
    """First output line of `command` (or the first containing `pick`), or "not found"."""
    exe = shutil.which(command[0]) or shutil.which(command[0], path=str(Path(sys.executable).parent))
    if exe is None:
        return "not found"
    try:
        out = subprocess.run([exe, *command[1:]], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return f"failed: {err}"
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    if pick is not None:
        lines = [line for line in lines if pick in line] or lines
    return lines[0] if lines else "no output"


def _torch_facts() -> dict[str, str]:
    try:
        import torch
    except ImportError as err:
        return {"torch": f"{NOT_INSTALLED} ({err})"}
    facts = {"torch": torch.__version__,
             "torch CUDA build (runtime)": torch.version.cuda or "none",
             "torch HIP build": getattr(torch.version, "hip", None) or "none"}
    cuda = torch.cuda.is_available()
    facts["CUDA available"] = str(cuda)
    # The driver matters even to a CPU-only torch build: it is the first question on a GPU machine.
    facts["CUDA driver"] = _first_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if cuda:
        facts["cuDNN"] = str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "none"
        try:
            facts["NCCL"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as err:  # noqa: BLE001 - a report never fails on one fact.
            facts["NCCL"] = f"unavailable ({err})"
        names = []
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            names.append(f"{index}: {props.name} ({props.total_memory / 2**30:.1f} GiB)")
        facts["devices"] = f"{len(names)} x CUDA: " + "; ".join(names)
    else:
        mps = getattr(torch.backends, "mps", None)
        facts["devices"] = "MPS" if mps is not None and mps.is_available() else "CPU only"
    return facts


def _ops_facts() -> dict[str, str]:
    """Whether the C++ ops are built (without building them), the CPU kernel backend that runs, libaio."""
    try:
        from shardkit.ops import BUILDER, forced_backend
        from shardkit.strategies.zero.config import libaio_available
    except Exception as err:  # noqa: BLE001 - a report never fails on one fact.
        return {"C++ ops": f"unknown ({type(err).__name__}: {err})"}
    root = BUILDER.build_root()
    if BUILDER._aot_library() is not None:
        built = f"built ahead of time ({BUILDER._aot_library()})"
    else:
        try:
            marker = root / f".built-{BUILDER.fingerprint()}"
            state = marker.read_text().strip() if marker.is_file() else ""
        except OSError:
            state = ""
        built = (f"built ({root})" if state == "ok" else f"build failed ({state[5:].strip()})"
                 if state.startswith("fail:") else f"not built yet: built on first use into {root} (or ahead: "
                 "shardkit build-ops)")
    facts = {"C++ ops": built}
    try:
        forced = forced_backend()
    except ValueError as err:
        forced, facts["kernel backend (CPU)"] = None, str(err)
    if "kernel backend (CPU)" not in facts:
        facts["kernel backend (CPU)"] = (f"{forced} (forced by SHARDKIT_KERNEL_BACKEND)" if forced else
                                         "cpp" if built.startswith("built") else "reference until the C++ ops build")
    facts["libaio (NVMe offload)"] = "found" if libaio_available() else "not found (apt-get install libaio-dev)"
    return facts


def collect_environment() -> dict[str, str]:
    """Every fact of the report as name -> value; absent packages and tools say so."""
    from shardkit.distributed.process_group import cpu_budget

    given = {name: os.environ.get(name, "unset") for name in _ENV_VARS}  # as the user set them, before shardkit does
    facts = {"shardkit": _version("shardkit"),
             "Python": f"{platform.python_version()} ({sys.executable})",
             "platform": platform.platform()}
    facts.update(_torch_facts())
    facts.update({name: _version(name) for name in _PACKAGES})
    facts.update(_ops_facts())
    facts["C++ compiler"] = _first_line([os.environ.get("CXX", "g++"), "--version"])
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = str(Path(cuda_home, "bin", "nvcc")) if cuda_home and Path(cuda_home, "bin", "nvcc").exists() else "nvcc"
    facts["nvcc"] = _first_line([nvcc, "--version"], pick="release")
    facts["ninja"] = _first_line(["ninja", "--version"])
    facts["CPUs"] = f"{os.cpu_count()} (usable by this process: {cpu_budget()})"
    names = sorted({*_ENV_VARS, *(k for k in os.environ if k.startswith("SHARDKIT_"))})
    for name in names:
        facts[f"${name}"] = given.get(name) or os.environ.get(name, "unset")
    return facts


def format_environment(facts: dict[str, str] | None = None) -> str:
    """The report as a Markdown list inside a heading, ready to paste into an issue."""
    facts = collect_environment() if facts is None else facts
    width = max(len(name) for name in facts)
    lines = ["### shardkit environment", "", "```text"]
    lines += [f"{name + ':':<{width + 1}} {value}" for name, value in facts.items()]
    lines.append("```")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    if args.json:
        import json

        print(json.dumps(collect_environment(), indent=2))
    else:
        print(format_environment())
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `shardkit env`."""
    parser = subparsers.add_parser("env", help="print versions and devices for a bug report",
                                   description="Print versions of shardkit, Python, torch, CUDA, deepspeed, "
                                               "triton, accelerate, peft, bitsandbytes, the compilers, whether the "
                                               "C++ ops are built and which kernel backend runs, libaio and the "
                                               "visible devices.")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of the Markdown block")
    parser.set_defaults(func=_run)
