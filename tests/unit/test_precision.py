import pytest
import torch

from shardkit import BF16, FP16, FP32
from shardkit.precision import precision_from_name
from shardkit.precision.fp16 import LossScaler


def _opt_with_grad(value: float) -> torch.optim.Optimizer:
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), value)
    return torch.optim.SGD([p], lr=0.1)


def test_fp16_overflow_skips_step_and_halves_scale():
    precision = FP16(hysteresis=1, initial_scale_power=4)
    opt = _opt_with_grad(float("inf"))
    before = opt.param_groups[0]["params"][0].detach().clone()
    assert precision.optimizer_step(opt) is False
    assert torch.equal(opt.param_groups[0]["params"][0], before)
    assert precision.current_loss_scale == 8.0
    assert precision.skipped_steps == 1


def test_fp16_hysteresis_delays_the_halving():
    precision = FP16(hysteresis=2, initial_scale_power=4)
    assert precision.optimizer_step(_opt_with_grad(float("nan"))) is False
    assert precision.current_loss_scale == 16.0  # first overflow uses up the hysteresis budget
    assert precision.optimizer_step(_opt_with_grad(float("nan"))) is False
    assert precision.current_loss_scale == 8.0


def test_fp16_scale_grows_after_a_clean_window_and_unscales_gradients():
    precision = FP16(initial_scale_power=3, loss_scale_window=2)
    for _ in range(2):
        opt = _opt_with_grad(8.0)  # a scaled gradient of 1.0 at scale 8
        p = opt.param_groups[0]["params"][0]
        assert precision.optimizer_step(opt) is True
    assert torch.allclose(p.grad, torch.ones(3))  # divided by the scale before the step
    assert precision.current_loss_scale == 16.0


def test_fp16_static_scale_never_changes():
    precision = FP16(loss_scale=128.0)
    precision.optimizer_step(_opt_with_grad(float("inf")))
    assert precision.current_loss_scale == 128.0


def test_loss_scaler_state_round_trip():
    scaler = LossScaler(2.0**16, 1000, 2, 1.0, dynamic=True)
    scaler.update(True)
    scaler.update(True)
    other = LossScaler(2.0**16, 1000, 2, 1.0, dynamic=True)
    other.load_state_dict(scaler.state_dict())
    assert other.state_dict() == scaler.state_dict() and other.scale == 2.0**15


def test_dtypes_and_names():
    # The DeepSpeed sections these precisions imply are built by the ZeRO strategy: tests/unit/test_zero_settings.py
    assert BF16().param_dtype == torch.float32 and BF16().compute_dtype == torch.bfloat16
    assert BF16(mode="true").param_dtype == torch.bfloat16 and not BF16(mode="true").uses_autocast
    assert BF16(comm_dtype="bf16").comm_dtype == torch.bfloat16
    assert isinstance(precision_from_name("bf16-true"), BF16)


@pytest.mark.parametrize("bad", [lambda: BF16(mode="half"), lambda: FP32(comm_dtype="int8"),
                                 lambda: FP16(loss_scale=-1), lambda: FP16(hysteresis=0)])
def test_bad_settings_are_named(bad):
    with pytest.raises(ValueError, match=r"BF16|FP32|FP16"):
        bad()


def test_autocast_on_cpu_runs_matmul_in_bf16():
    with BF16().autocast(torch.device("cpu")):
        out = torch.randn(4, 4) @ torch.randn(4, 4)
    assert out.dtype == torch.bfloat16
