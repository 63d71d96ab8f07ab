"""Throughput and model FLOPs utilisation (MFU) of a training loop: ``runner.throughput.update(tokens, samples)``.

FLOPs per token follow the PaLM paper's accounting (appendix B), as torchtitan, Lightning and Composer do:
``6 * N`` for the matmul weights (forward 2N, backward 4N) plus ``12 * layers * attention_width * seq_len`` for the
attention scores and their weighted sum. ``N`` counts the weights of the matmuls (``nn.Linear`` and GPT-2's
``Conv1D``, a tied output head included), not the embedding lookups, norms and biases, so that it is the count
``torch.utils.flop_counter`` makes on the same step. Activation checkpointing runs each block's forward again in
backward: that recompute (``2N + 4 * layers * width * seq_len``) is counted apart, as hardware FLOPs (``hfu``),
never in the model FLOPs that MFU divides.

``N`` counts each weight whole however the strategy holds it (a ZeRO-3 partition's placeholder is empty; a DTensor's
``numel`` is already global): the Runner passes its strategy's ``parameter_numel``.

The peak is the one given (``Runner(peak_tflops=...)``, ``TrainingArguments(peak_tflops=...)`` or
:data:`PEAK_ENV_VAR`), else the device's dense peak for the compute dtype from :data:`PEAK_TFLOPS` (vendors' data
sheets, without sparsity); on a CPU (or a device the table does not know) it is measured at start-up with a matmul
in that dtype, which moves with the machine's load: the log says so once, with how to fix it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["PEAK_ENV_VAR", "PEAK_TFLOPS", "FlopsPerToken", "Throughput", "flops_per_token", "measured_peak_tflops",
           "peak_tflops"]

log = logging.getLogger("shardkit.observability")

# Dense TFLOP/s per device that MFU divides by, when no peak is passed: a fixed figure instead of a measured one.
PEAK_ENV_VAR = "SHARDKIT_PEAK_TFLOPS"

# Dense TFLOP/s per device for (bf16, fp16, fp32) from the vendors' data sheets (tensor cores without sparsity; the
# fp32 column is the non-tensor-core fp32 rate). Matched by substring of the device name, the first match wins.
PEAK_TFLOPS: dict[str, tuple[float | None, float, float]] = {
    "H200": (989.0, 989.0, 67.0),
    "H100 NVL": (835.0, 835.0, 60.0),
    "H100 PCIe": (756.0, 756.0, 51.0),
    "H100": (989.0, 989.0, 67.0),  # SXM
    "GH200": (989.0, 989.0, 67.0),
    "B200": (2250.0, 2250.0, 75.0),
    "A100": (312.0, 312.0, 19.5),
    "A800": (312.0, 312.0, 19.5),
    "L40S": (362.0, 362.0, 91.6),
    "L40": (181.0, 181.0, 90.5),
    "L4": (121.0, 121.0, 30.3),
    "A10G": (70.0, 70.0, 31.2),
    "A10": (125.0, 125.0, 31.2),
    "V100": (None, 125.0, 15.7),
    "T4": (None, 65.0, 8.1),
    "MI300X": (1307.4, 1307.4, 163.4),
    "MI250X": (383.0, 383.0, 47.9),
}


@dataclass(frozen=True)
class FlopsPerToken:
    """Training FLOPs per token: ``model`` (what MFU counts) and ``recompute`` (activation checkpointing's extra
    forward, in hardware FLOPs only), with the terms they come from."""

    matmul_params: int
    layers: int
    attention_width: int
    seq_len: int
    checkpointed: bool

    @property
    def attention(self) -> int:
        """``12 * layers * width * seq_len``: QK^T and the weighted sum of V, forward and backward."""
        return 12 * self.layers * self.attention_width * self.seq_len

    @property
    def model(self) -> int:
        """``6N`` plus the attention term."""
        return 6 * self.matmul_params + self.attention

    @property
    def recompute(self) -> int:
        """One more forward per token under activation checkpointing (0 without it)."""
        return (2 * self.matmul_params + self.attention // 3) if self.checkpointed else 0


def _matmul_params(model: nn.Module, numel: Callable[[torch.Tensor], int]) -> int:
    """Weights of the model's matmuls, each module once (a tied head counts: it runs its own matmul)."""
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
            total += numel(module.weight)
    if total:
        return total
    # A model of raw parameters (F.linear on its own): everything but the embedding tables.
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    return sum(numel(p) for p in model.parameters() if id(p) not in embeddings)


def _attention_shape(model: nn.Module) -> tuple[int, int]:
    """(layers, heads * head_dim) from a Hugging Face style config (or shardkit.models' LlamaConfig); (0, 0) for a
    model without one."""
    config = getattr(model, "config", None)
    if config is None:
        return 0, 0
    text = getattr(config, "get_text_config", lambda: config)()
    layers = _first(text, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(text, "num_attention_heads", "n_head", "num_heads")
    hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd", None) or 0
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if heads else 0)
    return int(layers), int(heads * head_dim)


def _first(config: Any, *names: str) -> int:
    return next((int(v) for v in (getattr(config, n, None) for n in names) if isinstance(v, int) and v > 0), 0)


def flops_per_token(model: nn.Module, seq_len: int, *, layers: int | None = None, attention_width: int | None = None,
                    checkpointed: bool = False, numel: Callable[[torch.Tensor], int] | None = None) -> FlopsPerToken:
    """Training FLOPs per token of ``model`` at ``seq_len`` tokens a sample.

    Args:
        model: the model (its Hugging Face ``config`` gives the layers and attention width when it has one).
        seq_len: tokens per sample.
        layers: attention layers, for a model without a config.
        attention_width: heads times head dimension, for a model without a config.
        checkpointed: activation checkpointing recomputes each block's forward.
        numel: a weight's whole element count (``Runner.strategy.parameter_numel``: a ZeRO-3 partition counts
            whole); default ``Tensor.numel``.
    """
    found_layers, found_width = _attention_shape(model)
    return FlopsPerToken(_matmul_params(model, numel or torch.Tensor.numel),
                         layers if layers is not None else found_layers,
                         attention_width if attention_width is not None else found_width, int(seq_len), checkpointed)


def peak_tflops(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """The device's dense peak for ``dtype`` from :data:`PEAK_TFLOPS` and where it came from; None if unknown."""
    if device.type != "cuda":
        return None, ""
    name = torch.cuda.get_device_name(device)
    column = {torch.bfloat16: 0, torch.float16: 1}.get(dtype, 2)
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks[column], f"{name}, data sheet"
    return None, name


def measured_peak_tflops(device: torch.device, dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    """TFLOP/s of the best of ``repeats`` square matmuls of ``size`` in ``dtype`` on ``device`` (after a warm-up)."""
    # Its own generator: drawing from the global one would shift the training's dropout masks and data order.
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=generator).to(dtype)
    b = torch.randn(size, size, device=device, generator=generator).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / max(best, 1e-9) / 1e12


class Throughput:
    """Per-step tokens/s, samples/s, model TFLOP/s, MFU (and HFU under activation checkpointing).

    Call :meth:`update` after each optimizer step with the tokens and samples this rank trained in it; the time is
    measured from the previous call (from :meth:`reset` for the first). Rates are for the whole job (this rank's
    count times the data-parallel ranks); TFLOP/s and MFU are per device.

    Args:
        model: the model trained (its matmul weights and attention shape give the FLOPs per token).
        device: the device it runs on.
        dtype: the compute dtype (which column of the peak table, or the dtype of the measured matmul).
        data_parallel_size: ranks that train different samples.
        world_size: every rank (FLOPs are shared by all of them).
        checkpointed: activation checkpointing is on.
        peak: dense TFLOP/s per device, to use instead of :data:`PEAK_ENV_VAR`, the table or the measurement.
        numel: a weight's whole element count (see :func:`flops_per_token`).
        announce: log the peak used once (the main process; the others stay quiet).
    """

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, *, data_parallel_size: int = 1,
                 world_size: int = 1, checkpointed: bool = False, peak: float | None = None,
                 numel: Callable[[torch.Tensor], int] | None = None, announce: bool = True) -> None:
        self.model, self.device, self.dtype = model, torch.device(device), dtype
        self.data_parallel_size, self.world_size, self.checkpointed = data_parallel_size, world_size, checkpointed
        self._peak, self.peak_source = _given_peak(peak)
        self.numel = numel or torch.Tensor.numel
        self.peak_measured = False
        self._flops: FlopsPerToken | None = None
        self._last = time.perf_counter()
        self._shown = not announce

    @property
    def peak(self) -> float:
        """Dense TFLOP/s per device: given, from the table, or measured here once."""
        if self._peak is None:
            self._peak, self.peak_source = peak_tflops(self.device, self.dtype)
            if self._peak is None:
                name = self.peak_source or self.device.type
                self._peak = measured_peak_tflops(self.device, self.dtype)
                self.peak_measured = True
                self.peak_source = (f"{name}, measured here at start-up with a {str(self.dtype).replace('torch.', '')} "
                                    "matmul, not a data-sheet figure")
        return self._peak

    def reset(self) -> None:
        """Start timing the next step now (after set-up, an evaluation, a save)."""
        self._last = time.perf_counter()

    def flops(self, seq_len: int) -> FlopsPerToken:
        """FLOPs per token at ``seq_len`` (computed once per sequence length)."""
        if self._flops is None or self._flops.seq_len != seq_len:
            self._flops = flops_per_token(self.model, seq_len, checkpointed=self.checkpointed, numel=self.numel)
        return self._flops

    def update(self, tokens: float, samples: float, seconds: float | None = None) -> dict[str, float]:
        """The rates of the step that ended now, in which this rank trained ``tokens`` tokens in ``samples`` samples
        (over ``seconds``, when the caller timed it: a logging window of several steps).

        Returns:
            ``tokens_per_s``, ``samples_per_s``, ``tflops`` (model TFLOP/s per device), ``mfu``, and under
            activation checkpointing ``hfu`` (with the recompute).
        """
        now = time.perf_counter()
        seconds, self._last = max(now - self._last if seconds is None else seconds, 1e-9), now
        flops = self.flops(max(1, round(tokens / max(samples, 1))))
        total_tokens = tokens * self.data_parallel_size
        tflops = flops.model * total_tokens / self.world_size / seconds / 1e12
        out = {"tokens_per_s": total_tokens / seconds, "samples_per_s": samples * self.data_parallel_size / seconds,
               "tflops": tflops, "mfu": tflops / self.peak, "step_time_s": seconds}
        if flops.recompute:
            out["hfu"] = (flops.model + flops.recompute) * total_tokens / self.world_size / seconds / 1e12 / self.peak
        if not self._shown:
            self._shown = True
            log.info("throughput: %s, peak %.3g TFLOP/s per device (%s); %.4g model FLOPs per token at %d tokens a "
                     "sample%s", self.device, self.peak, self.peak_source, flops.model, flops.seq_len,
                     f", +{flops.recompute:.4g} recomputed" if flops.recompute else "")
            if self.peak_measured:
                log.warning("shardkit: mfu divides by a peak of %.3g TFLOP/s measured on this %s at start-up (not a "
                            "data-sheet figure), so it moves with the machine's load; pass Runner(peak_tflops=...), "
                            "TrainingArguments(peak_tflops=...) or set %s for a fixed one", self.peak, self.device.type,
                            PEAK_ENV_VAR)
        return out

    def describe(self) -> dict[str, Any]:
        """The device, the peak used and where it came from (logged once by :meth:`update`)."""
        return {"device": str(self.device), "peak_tflops": self.peak, "peak_source": self.peak_source}


def _given_peak(peak: float | None) -> tuple[float | None, str]:
    """The peak passed, else the one :data:`PEAK_ENV_VAR` sets, with where it came from; (None, "") for neither."""
    source = "given"
    if peak is None:
        raw = os.environ.get(PEAK_ENV_VAR, "").strip()
        if not raw:
            return None, ""
        try:
            peak = float(raw)
        except ValueError:
            peak = math.nan
        source = PEAK_ENV_VAR
    if not (math.isfinite(peak) and peak > 0):
        where = f"{PEAK_ENV_VAR}={os.environ.get(PEAK_ENV_VAR)!r}" if source != "given" else f"peak_tflops={peak!r}"
        raise ValueError(f"{where} is not a positive number of TFLOP/s per device (e.g. 989 for an H100 in bf16)")
    return float(peak), source
