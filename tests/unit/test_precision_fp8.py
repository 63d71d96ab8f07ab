"""FP8 precision: refused by name where there are no FP8 tensor cores (CPU here, GPUs below 8.9), and the module
conversion (which linears become torchao Float8Linear) checked on CPU."""

from __future__ import annotations

import pytest
import torch

from shardkit.precision import FP8, precision_from_name

torchao = pytest.importorskip("torchao")


def test_fp8_is_registered_with_its_aliases():
    for name in ("fp8", "fp8-mixed", "float8"):
        precision = precision_from_name(name)
        assert isinstance(precision, FP8)
        assert precision.compute_dtype == torch.bfloat16 and precision.param_dtype == torch.float32


def test_fp8_refuses_cpu_by_name():
    with pytest.raises(RuntimeError, match=r"precision FP8: .*compute capability >= 8\.9.*'cpu'.*'bf16'"):
        FP8().setup_environment(torch.device("cpu"))


def test_fp8_refuses_a_gpu_without_fp8_tensor_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(RuntimeError, match=r"A100-SXM4-80GB is 8\.0.*'bf16'"):
        FP8().setup_environment(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    FP8().setup_environment(torch.device("cuda", 0))  # an H100 passes


def test_fp8_converts_aligned_linears_but_not_the_head_or_odd_shapes():
    from torchao.float8.float8_linear import Float8Linear

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(32, 64)
            self.down = torch.nn.Linear(64, 32)
            self.odd = torch.nn.Linear(32, 10)  # 10 is not a multiple of 16: torch._scaled_mm cannot take it
            self.lm_head = torch.nn.Linear(32, 128)

    model = Tiny()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    converted = FP8().convert_module(model)
    kinds = {n: type(m) for n, m in converted.named_children()}
    assert kinds == {"up": Float8Linear, "down": Float8Linear, "odd": torch.nn.Linear, "lm_head": torch.nn.Linear}
    for n, p in converted.named_parameters():  # the master weights are kept as they were (fp32, same values)
        assert p.dtype == torch.float32
        torch.testing.assert_close(p.detach(), weights[n])
    custom = FP8(skip=()).convert_module(Tiny())
    assert isinstance(custom.lm_head, Float8Linear)
