"""Settings of the ZeRO strategies and the DeepSpeed engine config built from them and the precision.

Nothing here imports DeepSpeed at module level, so that settings can be built, validated and turned
into a config dict (for inspection, tests and the config engineer's JSON mapping) without it.

The stage number is data here, not a behaviour switch: which offloads a stage allows (validation)
and which keys the ``zero_optimization`` section has (the JSON DeepSpeed reads) depend on it; what
the strategy does differently at stage 3 is the ZeRO3 class (``stage3.py``).
"""

from __future__ import annotations

import copy
import ctypes.util
import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardkit.precision.base import Precision
from shardkit.utils.dtypes import dtype_name

__all__ = ["ZeROSettingsError", "ZeROSettings", "model_hidden_size", "deep_merge", "libaio_available",
           "default_nvme_path", "precision_section", "require_deepspeed", "NVME_PATH_ENV_VAR"]

_OFFLOAD_DEVICES = (None, "cpu", "nvme")
NVME_PATH_ENV_VAR = "SHARDKIT_NVME_PATH"
# DeepSpeed's own defaults (deepspeed/runtime/zero/config.py), kept so that "not set" means the same.
_DEFAULT_ALLGATHER_BUCKET = 500_000_000
_DEFAULT_AIO = {"block_size": 1_048_576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                "overlap_events": True, "use_gds": False}
# Older DeepSpeed releases named the I/O thread count "thread_count"; DeepSpeed >= 0.15 reads only
# "intra_op_parallelism" and silently drops the old name, so it is translated, never passed on.
_AIO_ALIASES = {"thread_count": "intra_op_parallelism"}


class ZeROSettingsError(ValueError):
    """A ZeRO setting or a combination of settings that DeepSpeed does not support; raised before anything starts."""


def _aio_with_current_names(aio: dict[str, Any], name: str) -> dict[str, Any]:
    """``aio`` with DeepSpeed's current key names (``thread_count`` -> ``intra_op_parallelism``), checked."""
    known = sorted({*_DEFAULT_AIO, *_AIO_ALIASES})
    unknown = sorted(set(aio) - set(known))
    if unknown:
        raise ZeROSettingsError(f"{name}.aio has unknown keys {unknown}; known: {known}")
    out = {k: v for k, v in aio.items() if k not in _AIO_ALIASES}
    for old, new in _AIO_ALIASES.items():
        if old in aio:
            if new in aio and aio[new] != aio[old]:
                raise ZeROSettingsError(f"{name}.aio sets {old}={aio[old]!r} and {new}={aio[new]!r}: they are one "
                                        f"setting (DeepSpeed's old and current name); keep {new}")
            out[new] = aio[old]
    return out


def libaio_available() -> bool:
    """Whether libaio (needed by DeepSpeed's async_io op for NVMe offload) can be linked: header and library."""
    headers = ("/usr/include/libaio.h", "/usr/local/include/libaio.h")
    return ctypes.util.find_library("aio") is not None and any(os.path.exists(h) for h in headers)


def default_nvme_path(rank: int) -> tuple[str, bool]:
    """Where NVMe offload swaps when no ``nvme_path`` is given: ``(path, created_here)``.

    ``$SHARDKIT_NVME_PATH`` when set (made if missing; kept at teardown), else a new directory for this
    job and rank under ``tempfile.gettempdir()`` (removed at teardown). The temp dir is often a RAM disk
    or a slow system disk: point the variable at a fast local NVMe drive for real runs.
    """
    env = os.environ.get(NVME_PATH_ENV_VAR)
    if env:
        return os.path.abspath(env), False
    job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT") or "local"
    return tempfile.mkdtemp(prefix=f"shardkit-nvme-{job}-rank{rank}-"), True


def model_hidden_size(model: nn.Module) -> int:
    """The hidden size the "auto" bucket formulas use.

    ``model.config.hidden_size`` when the model has a Hugging Face-style config, else the largest
    dimension of the largest 2-D weight (for a transformer that is the hidden or the MLP size; the
    formulas only size buckets, so an overestimate costs memory, not correctness). 0 for a model
    without 2-D weights. A wrapper (a DeepSpeed engine, DDP) is looked through to the user's module.
    """
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if isinstance(hidden, int) and hidden > 0:
        return hidden
    best: tuple[int, int] = (0, 0)
    for p in model.parameters():
        shape = getattr(p, "ds_shape", p.shape)  # zero.Init leaves p.shape empty; ds_shape is the real one
        if len(shape) == 2:
            best = max(best, (shape[0] * shape[1], max(shape)))
    return best[1]


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` merged in recursively (``extra`` wins); neither input is modified."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def precision_section(precision: Precision) -> dict[str, Any]:
    """The DeepSpeed config sections a precision implies: ``bf16``/``fp16`` and the communication dtype.

    Built from the precision's plain attributes (its dtypes and, where it scales the loss, its
    ``loss_scaling``), so precisions know nothing of DeepSpeed and no precision class is switched on.
    """
    bf16 = torch.bfloat16 in (precision.param_dtype, precision.compute_dtype)
    config: dict[str, Any] = {"communication_data_type": dtype_name(precision.comm_dtype),
                              "bf16": {"enabled": bf16},
                              "fp16": {"enabled": precision.compute_dtype == torch.float16}}
    scaling = precision.loss_scaling
    if scaling is not None:  # DeepSpeed's own scaler runs with the precision's settings (same names and meaning)
        config["fp16"] = {"enabled": True, "loss_scale": scaling.loss_scale,
                          "initial_scale_power": scaling.initial_scale_power,
                          "loss_scale_window": scaling.loss_scale_window, "hysteresis": scaling.hysteresis,
                          "min_loss_scale": scaling.min_loss_scale}
    return config


def _check_size(name: str, value: Any, allow_auto: bool = True) -> None:
    if allow_auto and value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        what = '"auto" or ' if allow_auto else ""
        raise ZeROSettingsError(f"{name}={value!r} must be {what}a number >= 0")


@dataclass(frozen=True)
class ZeROSettings:
    """Everything that configures one ZeRO strategy; validated on construction (see the strategy classes)."""

    stage: int
    reduce_bucket_size: int | float | str = "auto"
    allgather_bucket_size: int | float = _DEFAULT_ALLGATHER_BUCKET
    overlap_comm: bool | None = None
    contiguous_gradients: bool = True
    offload_optimizer: str | None = None
    offload_params: str | None = None
    nvme_path: str | None = None
    pin_memory: bool | None = None
    prefetch_bucket_size: int | float | str = "auto"
    param_persistence_threshold: int | float | str = "auto"
    max_live_parameters: int | float = 1_000_000_000
    max_reuse_distance: int | float = 1_000_000_000
    gather_16bit_weights_on_model_save: bool = False
    aio: dict[str, Any] = field(default_factory=dict)
    buffer_count: int = 5
    buffer_size: int | float = 100_000_000
    timeout: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        name = f"ZeRO{self.stage}"
        if self.stage not in (1, 2, 3):
            raise ZeROSettingsError(f"ZeRO stage={self.stage} does not exist; use 1, 2 or 3")
        for key in ("offload_optimizer", "offload_params"):
            value = getattr(self, key)
            if value not in _OFFLOAD_DEVICES:
                raise ZeROSettingsError(f"{name}({key}={value!r}): use one of {_OFFLOAD_DEVICES}")
        if self.stage == 1 and self.offload_optimizer is not None:
            raise ZeROSettingsError(f"ZeRO1(offload_optimizer={self.offload_optimizer!r}): DeepSpeed offloads the "
                                    "optimizer only with partitioned gradients; use ZeRO2 or ZeRO3")
        if self.stage < 3 and self.offload_params is not None:
            raise ZeROSettingsError(f"{name}(offload_params={self.offload_params!r}): parameters are partitioned, "
                                    "and so can be offloaded, only in stage 3; use ZeRO3 or ZeROInfinity")
        if self.stage < 3 and self.offload_optimizer == "nvme":
            raise ZeROSettingsError(f"{name}(offload_optimizer='nvme'): NVMe offload needs stage 3; use ZeROInfinity")
        for key in ("reduce_bucket_size", "prefetch_bucket_size", "param_persistence_threshold"):
            _check_size(f"{name}.{key}", getattr(self, key))
        for key in ("allgather_bucket_size", "max_live_parameters", "max_reuse_distance", "buffer_size"):
            _check_size(f"{name}.{key}", getattr(self, key), allow_auto=False)
        if self.buffer_count < 1:
            raise ZeROSettingsError(f"{name}.buffer_count={self.buffer_count} must be >= 1")
        if self.timeout is not None and not self.timeout > 0:
            raise ZeROSettingsError(f"{name}.timeout={self.timeout} must be > 0 seconds")
        object.__setattr__(self, "aio", _aio_with_current_names(self.aio, name))  # frozen: set once, here
        if self.pin_memory and not torch.cuda.is_available():
            raise ZeROSettingsError(f"{name}(pin_memory=True) needs a GPU (DeepSpeed fails with 'Cannot access "
                                    "accelerator device when none is available'); leave pin_memory=None")
        if self.uses_nvme:
            self._check_nvme(name)

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.offload_optimizer, self.offload_params)

    def _check_nvme(self, name: str) -> None:
        if not libaio_available():
            raise ZeROSettingsError(f"{name}: NVMe offload needs libaio for DeepSpeed's async_io op and it is "
                                    "missing; install it (`apt-get install -y libaio-dev`) or use offload='cpu'")
        if not self.nvme_path:
            return  # the default (see default_nvme_path) is chosen, and checked, when the Runner starts
        path = os.path.abspath(self.nvme_path)
        try:
            os.makedirs(path, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path):
                pass
        except OSError as err:
            raise ZeROSettingsError(f"{name}(nvme_path={self.nvme_path!r}) is not a writable directory ({err}); "
                                    "point it at a directory this process can write") from None

    # ---- the engine config ---------------------------------------------------------------------

    def zero_section(self, hidden: int, on_gpu: bool) -> dict[str, Any]:
        """The ``zero_optimization`` section with "auto" sizes resolved from ``hidden``."""
        auto = {"reduce_bucket_size": hidden * hidden, "prefetch_bucket_size": int(0.9 * hidden * hidden),
                "param_persistence_threshold": 10 * hidden}
        resolved = {k: int(auto[k] if getattr(self, k) == "auto" else getattr(self, k)) for k in auto}
        # NOTE: a 0-element bucket (a model without 2-D weights) cannot hold a gradient; 1 is the floor.
        for key in ("reduce_bucket_size", "prefetch_bucket_size"):
            resolved[key] = max(1, resolved[key])
        section: dict[str, Any] = {
            "stage": self.stage,
            "contiguous_gradients": self.contiguous_gradients,
            "overlap_comm": self.overlap_comm if self.overlap_comm is not None else self.stage == 3,
            "reduce_bucket_size": resolved["reduce_bucket_size"],
            "allgather_bucket_size": int(self.allgather_bucket_size),
        }
        pin = bool(self.pin_memory) if self.pin_memory is not None else on_gpu
        if self.offload_optimizer:
            section["offload_optimizer"] = self._offload("offload_optimizer", pin)
        if self.stage == 3:
            section.update({
                "stage3_prefetch_bucket_size": resolved["prefetch_bucket_size"],
                "stage3_param_persistence_threshold": resolved["param_persistence_threshold"],
                "stage3_max_live_parameters": int(self.max_live_parameters),
                "stage3_max_reuse_distance": int(self.max_reuse_distance),
                "stage3_gather_16bit_weights_on_model_save": self.gather_16bit_weights_on_model_save,
            })
            if self.offload_params:
                section["offload_param"] = self._offload("offload_params", pin)
        return section

    def _offload(self, key: str, pin: bool) -> dict[str, Any]:
        device = getattr(self, key)
        out: dict[str, Any] = {"device": device, "pin_memory": pin}
        if device == "nvme":
            if not self.nvme_path:
                raise ZeROSettingsError("nvme_path is chosen when the Runner starts (SHARDKIT_NVME_PATH or a "
                                        "directory under the system temp dir); build the config after that, or "
                                        "pass nvme_path=")
            out["nvme_path"] = os.path.abspath(self.nvme_path)
            out["buffer_count"] = self.buffer_count if key == "offload_optimizer" else max(self.buffer_count, 5)
            if key == "offload_params":
                out["buffer_size"] = int(self.buffer_size)
        return out

    def engine_config(self, hidden: int, precision_section: dict[str, Any], *, micro_batch_size: int,
                      gradient_accumulation_steps: int, world_size: int, gradient_clipping: float,
                      on_gpu: bool) -> dict[str, Any]:
        """The whole DeepSpeed config: batch sizes, zero section, precision sections, then ``extra`` merged last."""
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "train_batch_size": micro_batch_size * gradient_accumulation_steps * world_size,
            "gradient_clipping": gradient_clipping,
            "zero_optimization": self.zero_section(hidden, on_gpu),
            # The Runner steps the optimizer we hand in; DeepSpeed only refuses untested ones out of caution.
            "zero_allow_untested_optimizer": True,
            # DeepSpeed prints a progress line every 10 steps by default; shardkit's loggers own that.
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
            **precision_section,
        }
        if self.uses_nvme:
            config["aio"] = {**_DEFAULT_AIO, **self.aio}
        return deep_merge(config, self.extra)


def require_deepspeed(what: str) -> None:
    """ImportError naming the extra to install when DeepSpeed is missing (``what``: the strategy or the config)."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ImportError(f"{what} runs on DeepSpeed, which is not installed in this environment "
                          f"({sys.executable}): pip install 'shardkit[deepspeed]'")
