"""The op registry: every registered op against its reference on every backend, and errors that name the fix."""

from __future__ import annotations

import pytest
import torch

from shardkit.ops.registry import OpSpec, get_op, native, register, registered_ops

_WITH_EXAMPLE = [spec.name for spec in registered_ops() if spec.example is not None]


def _run(fn, args: tuple, seed: int = 7) -> list[torch.Tensor]:
    """Outputs and input gradients of ``fn(*args)`` against fixed random output gradients."""
    leaves = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.requires_grad else a
              for a in args]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs]
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs] + [x.grad for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]


def test_builtin_ops_are_registered():
    names = [spec.name for spec in registered_ops()]
    assert set(names) >= {"adamw", "fused_linear_cross_entropy", "rms_norm", "rope", "swiglu"}
    assert {"fused_linear_cross_entropy", "rms_norm", "rope", "swiglu"} <= set(_WITH_EXAMPLE)


@pytest.mark.parametrize("name", _WITH_EXAMPLE)
def test_every_registered_op_matches_its_reference(name, backend, check_close):
    """A registered op with an example is checked on every backend with no test of its own: outputs and input
    gradients within the 2x rule of the fp32 reference's error against float64."""
    spec = get_op(name)
    args = spec.example(backend.device, torch.float32, "test")
    got = _run(spec.function, args)
    low = _run(spec.reference, args)
    exact = _run(spec.reference, tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                                       for a in args))
    assert len(got) == len(low) == len(exact) >= 2
    for i, (g, lo, ex) in enumerate(zip(got, low, exact)):
        check_close(g, lo, ex, name=f"{name} tensor {i}")


def test_unknown_op_and_backend_name_the_closest():
    with pytest.raises(KeyError, match="unknown op 'rmsnorm'.*did you mean 'rms_norm'"):
        get_op("rmsnorm")
    spec = get_op("rms_norm")
    with pytest.raises(ValueError, match="op 'rms_norm' has no backend 'trition'.*did you mean 'triton'"):
        spec.implementation("rms_norm_fwd", "trition")
    with pytest.raises(KeyError, match="op 'rms_norm' has no kernel 'rms_norm_fw'.*did you mean 'rms_norm_fwd'"):
        spec.backends("rms_norm_fw")


def test_adamw_has_no_example_but_every_backend_table_has_a_reference():
    for spec in registered_ops():
        for kernel in spec.kernels:
            assert spec.backends(kernel)[0] == "reference", (spec.name, kernel)


def test_bad_specs_are_refused_with_the_fix():
    def ref(x):
        return x

    with pytest.raises(ValueError, match="unknown backend 'tritn'.*did you mean 'triton'"):
        OpSpec("bad", ref, ref, kernels={"bad_fwd": {"reference": ref, "tritn": ref}})
    with pytest.raises(ValueError, match="needs a 'reference'"):
        OpSpec("bad", ref, ref, kernels={"bad_fwd": native("bad_fwd")})
    with pytest.raises(ValueError, match="already belong to op 'rms_norm'"):
        register(OpSpec("bad", ref, ref, kernels={"rms_norm_fwd": {"reference": ref}}))
    assert "bad" not in [spec.name for spec in registered_ops()]


def test_a_backend_whose_module_is_missing_names_what_to_install():
    def ref(x):
        return x

    spec = OpSpec("lazy", ref, ref, kernels={"lazy_fwd": {"reference": ref, "triton": "no_such_module:fn"}})
    with pytest.raises(RuntimeError, match="op 'lazy', backend 'triton': cannot import no_such_module.*install"):
        spec.call("lazy_fwd", "triton", torch.ones(1))
    assert spec.call("lazy_fwd", "reference", torch.ones(1)).item() == 1.0
