"""apply_fused_kernels on tiny random Hugging Face models built locally (no downloads).

Oracle: a deep copy of the same model left unpatched. The patched forward of the rope lives in the family's
modeling module (global), so these tests also check that the unpatched copy keeps HF's code (no shardkit op in
its dispatch trace) while the patched one calls every fused op it should.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
import types
from collections import Counter
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

from shardkit.nn import apply_fused_kernels  # noqa: E402
from shardkit.nn._hf_loss import fused_causal_lm_loss  # noqa: E402
from shardkit.nn.patching import supported_model_types  # noqa: E402
from shardkit.ops import available_backends, force_backend  # noqa: E402
from shardkit.strategies.zero.stage3 import is_zero3_partitioned  # noqa: E402

_TINY = dict(hidden_size=64, num_hidden_layers=2, vocab_size=160, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
# model_type -> config class name; Gemma 2 gets a softcap small enough (logits are O(5) here) to matter.
_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "phi3": ("Phi3Config", {"pad_token_id": 0}),
    "qwen2": ("Qwen2Config", {}),
    "gemma": ("GemmaConfig", {}),
    "gemma2": ("Gemma2Config", {"final_logit_softcapping": 3.0}),
    "gemma3_text": ("Gemma3TextConfig", {}),
}
_FAMILIES = [t for t in _CONFIGS if t in supported_model_types() and hasattr(transformers, _CONFIGS[t][0])]
_BACKENDS = ["reference", "cpp"]
# B*T = 96 rows > hidden 64 and vocab 160 != intermediate 128: a (rows, vocab) tensor can only be the logits
B, T = 2, 48


def _model(model_type: str, seed: int = 0):
    name, extra = _CONFIGS[model_type]
    cfg = getattr(transformers, name)(**_TINY, **extra)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # Gemma norms start at 0 (scale 1 + 0): randomise so the offset is exercised
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    return model


def _pair(model_type: str):
    ref = _model(model_type)
    return ref, apply_fused_kernels(copy.deepcopy(ref))


def _batch(seed: int = 1, ignore: bool = True):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, _TINY["vocab_size"], (B, T), generator=gen)
    labels = ids.clone()
    if ignore:
        labels[0, :5] = -100  # prompt tokens masked, as in SFT
        labels[1, -7:] = -100
    return ids, labels


@contextmanager
def _backend(name: str):
    if name not in available_backends("cpu"):
        pytest.skip(f"backend {name} not available here")
    with force_backend(name):
        yield


class _Trace(TorchDispatchMode):
    """Records every op name and the largest tensor each op outside the shardkit ops produced."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        self.ops[name] += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append((name, tuple(t.shape)))
        return out


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(ref, fused, rtol=1e-4, atol=2e-5):
    g_ref, g_fused = _grads(ref), _grads(fused)
    assert g_ref.keys() == g_fused.keys()
    for n in g_ref:
        torch.testing.assert_close(g_fused[n], g_ref[n], rtol=rtol, atol=atol, msg=lambda m, n=n: f"grad {n}: {m}")


def test_report_and_unknown_model():
    ref, fused = _pair("llama")
    rep = fused.fused_kernels_report
    assert rep["rms_norm"] == 2 * 2 + 1 and rep["rope"] == 2 and rep["swiglu"] == 2 and rep["cross_entropy"]
    again = apply_fused_kernels(fused).fused_kernels_report  # idempotent
    assert again["rms_norm"] == rep["rms_norm"]
    bert = types.SimpleNamespace(config=types.SimpleNamespace(model_type="bert"))
    with pytest.raises(ValueError, match="'bert'.*supported.*llama"):
        apply_fused_kernels(bert)  # type: ignore[arg-type]


@pytest.mark.parametrize("model_type", _FAMILIES)
def test_ops_are_called_only_in_the_patched_model(model_type):
    ref, fused = _pair(model_type)
    ids, labels = _batch()
    with _Trace() as t_ref:
        ref(input_ids=ids, labels=labels)
    with _Trace() as t_fused:
        out = fused(input_ids=ids, labels=labels)
    assert not [op for op in t_ref.ops if op.startswith("shardkit::")], "unpatched copy must keep HF's code"
    layers = _TINY["num_hidden_layers"]
    norms = sum(1 for m in fused.modules() if type(m).__name__.endswith("RMSNorm"))
    assert t_fused.ops["shardkit::rms_norm"] == norms
    assert t_fused.ops["shardkit::rope"] == layers
    gemma = model_type.startswith("gemma")
    mlps = t_fused.ops["shardkit::geglu" if gemma else "shardkit::swiglu"]  # Gemma's GELU-tanh MLP: geglu
    assert t_fused.ops["shardkit::swiglu" if gemma else "shardkit::geglu"] == 0
    if model_type == "mixtral":  # one call per expert the router sent tokens to
        assert layers <= mlps <= layers * 4
    else:
        assert mlps == layers
    assert t_fused.ops["shardkit::fused_linear_cross_entropy"] == 1
    # the logits are never materialised: no op outside the fused loss yields a (rows, vocab) tensor
    vocab, rows = _TINY["vocab_size"], B * T
    def big(shapes):
        return [(n, s) for n, s in shapes if s and s[-1] == vocab and torch.Size(s).numel() >= rows * vocab]
    assert big(t_ref.shapes), "the check must see the logits of the unpatched model"
    assert not big(t_fused.shapes)
    assert out.logits is None


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("model_type", _FAMILIES)
def test_loss_logits_and_grads_match(model_type, backend):
    with _backend(backend):
        ref, fused = _pair(model_type)
        ids, labels = _batch()
        out_ref, out_fused = ref(input_ids=ids, labels=labels), fused(input_ids=ids, labels=labels)
        assert out_fused.loss.dtype == out_ref.loss.dtype == torch.float32
        torch.testing.assert_close(out_fused.loss, out_ref.loss, rtol=1e-5, atol=1e-5)
        out_ref.loss.backward()
        out_fused.loss.backward()
        _assert_grads_close(ref, fused)
        with torch.no_grad():  # no labels: logits as HF computes them (softcapped for Gemma 2)
            torch.testing.assert_close(fused(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
            keep_ref = ref(input_ids=ids, logits_to_keep=1).logits
            torch.testing.assert_close(fused(input_ids=ids, logits_to_keep=1).logits, keep_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_low_precision_loss_is_hf_loss(model_type, backend, dtype):
    """bf16/fp16 models: the patched loss is HF's fp32 loss (HF upcasts the logits), mean and summed alike.

    With only the loss patched both models see the same hidden states, so the losses agree to fp32 rounding (the
    fused op used to round the loss to the model dtype first: 0.4% off in bf16). The gradients are 16-bit on both
    sides, rounded differently: each within 5% of its own scale (a wrong 1/n would be 33% or more off).
    """
    with _backend(backend):
        ref = _model(model_type).to(dtype)
        fused = apply_fused_kernels(copy.deepcopy(ref), rms_norm=False, rope=False, swiglu=False, geglu=False)
        every_op = apply_fused_kernels(copy.deepcopy(ref))
        ids, labels = _batch()
        n_valid = int((labels[:, 1:] != -100).sum())
        for n_items in (None, torch.tensor(3 * n_valid)):  # None: mean; the HF Trainer's count: sum / n_items
            out_ref = ref(input_ids=ids, labels=labels, num_items_in_batch=n_items)
            out_fused = fused(input_ids=ids, labels=labels, num_items_in_batch=n_items)
            assert out_fused.loss.dtype == out_ref.loss.dtype == torch.float32
            torch.testing.assert_close(out_fused.loss, out_ref.loss, rtol=1e-5, atol=1e-5)
            with torch.no_grad():  # every fused op: 16-bit hidden states differ by their rounding
                loss_all = every_op(input_ids=ids, labels=labels, num_items_in_batch=n_items).loss
            assert loss_all.dtype == torch.float32
            torch.testing.assert_close(loss_all, out_ref.loss, rtol=2e-4, atol=1e-5)
        # a loss scale, as fp16 training uses: unscaled, these tiny models' fp16 gradients are subnormal noise
        (out_ref.loss * 1024).backward()
        (out_fused.loss * 1024).backward()
        g_ref, g_fused = _grads(ref), _grads(fused)
        assert g_ref.keys() == g_fused.keys()
        for name, g in g_ref.items():
            assert g_fused[name].dtype == dtype
            err, scale = (g_fused[name].float() - g.float()).abs().max(), g.float().abs().max()
            assert err <= 0.05 * scale, f"grad {name}: off by {err:.3g}, max |grad| {scale:.3g}"


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_num_items_in_batch_and_logits_to_keep(model_type):
    ref, fused = _pair(model_type)
    ids, labels = _batch()
    n_valid = int((labels[:, 1:] != -100).sum())
    with torch.no_grad():
        mean = fused(input_ids=ids, labels=labels).loss
        for n_items in (torch.tensor(3 * n_valid), 5 * n_valid):  # tensor (HF Trainer) or int (custom loops)
            summed = fused(input_ids=ids, labels=labels, num_items_in_batch=n_items).loss
            torch.testing.assert_close(summed, ref(input_ids=ids, labels=labels, num_items_in_batch=n_items).loss)
            torch.testing.assert_close(summed, mean * n_valid / int(n_items))
        # logits_to_keep with labels for the kept positions, as HF's own loss requires
        k = 20
        kept = fused(input_ids=ids, labels=labels[:, -k:], logits_to_keep=k).loss
        torch.testing.assert_close(kept, ref(input_ids=ids, labels=labels[:, -k:], logits_to_keep=k).loss)
        with pytest.raises(ValueError, match="logits_to_keep"):
            fused(input_ids=ids, labels=labels, logits_to_keep=k)


@pytest.mark.parametrize("model_type", [t for t in _FAMILIES if t != "mixtral"])  # mixtral: grads test above
def test_training_steps_track(model_type):
    ref, fused = _pair(model_type)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (ref, fused)]
    losses = {0: [], 1: []}
    ids, labels = _batch(seed=10)  # one batch, fitted: the loss must fall, so the steps do something
    for _ in range(5):
        for i, (m, opt) in enumerate(zip((ref, fused), opts)):
            opt.zero_grad()
            loss = m(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            losses[i].append(loss.item())
    assert losses[0][-1] < losses[0][0]  # it does train
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=1e-4, atol=1e-4)
    for (n, p_ref), p_fused in zip(ref.named_parameters(), fused.parameters()):
        torch.testing.assert_close(p_fused, p_ref, rtol=1e-4, atol=1e-4, msg=lambda m, n=n: f"param {n}: {m}")


def test_partial_disable_and_base_model():
    ref = _model("qwen2")
    fused = apply_fused_kernels(copy.deepcopy(ref), rope=False, swiglu=False, cross_entropy=False)
    rep = fused.fused_kernels_report
    assert rep["rope"] == rep["swiglu"] == 0 and not rep["cross_entropy"] and rep["rms_norm"] == 5
    ids, labels = _batch()
    out = fused(input_ids=ids, labels=labels)
    assert out.logits is not None
    torch.testing.assert_close(out.loss, ref(input_ids=ids, labels=labels).loss)
    base = apply_fused_kernels(copy.deepcopy(ref.model))  # bare Qwen2Model: no head, no loss to patch
    assert "cross_entropy" in base.fused_kernels_report["skipped"]
    torch.testing.assert_close(base(input_ids=ids).last_hidden_state, ref.model(input_ids=ids).last_hidden_state)


def test_zero3_partitioned_head_is_gathered(monkeypatch):
    """A ZeRO-3 parameter (faked: a ``ds_id`` attribute) is gathered read-only around the fused loss."""
    calls = []

    @contextmanager
    def gathered(params, modifier_rank=-1):
        calls.append((params, modifier_rank))
        yield

    fake = types.SimpleNamespace(zero=types.SimpleNamespace(GatheredParameters=gathered))
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 32, bias=False)
    hidden = torch.randn(2, 6, 16, requires_grad=True)
    labels = torch.randint(0, 32, (2, 6))
    plain = fused_causal_lm_loss(hidden, head, labels)
    assert calls == []  # not partitioned: deepspeed is not touched
    head.weight.ds_id = 3
    loss = fused_causal_lm_loss(hidden, head, labels)
    assert len(calls) == 1 and calls[0][0] is head.weight and calls[0][1] is None
    torch.testing.assert_close(loss, plain)
    loss.backward()
    assert head.weight.grad is not None and head.weight.grad.shape == head.weight.shape
    # already gathered (inside a DeepSpeed engine's forward, which gathers it as an external parameter)
    head.weight.ds_status = types.SimpleNamespace(name="AVAILABLE")
    fused_causal_lm_loss(hidden, head, labels)
    assert len(calls) == 1


def _zero3_engine(model):
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "zero_allow_untested_optimizer": True,
              # threshold 0: partition even these tiny parameters (the default keeps < 1e5-element ones whole)
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)[0]


def zero3_worker() -> tuple[bool, list[list[float]], float, float]:
    """Each rank: unpatched and patched llama under ZeRO-3, 3 SGD steps on rank-dependent batches."""
    import deepspeed

    from shardkit.distributed.process_group import init_distributed

    init_distributed("cpu")
    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, dist_init_required=False,
                                    verbose=False)
    rank = torch.distributed.get_rank()
    ref = _model("llama")
    engines = [_zero3_engine(copy.deepcopy(ref)), _zero3_engine(apply_fused_kernels(copy.deepcopy(ref)))]
    head = engines[1].module.lm_head
    partitioned = is_zero3_partitioned(head.weight) and head.weight.numel() == 0
    # outside the engine's forward nothing gathers the head but the loss itself
    h = torch.randn(B, 8, _TINY["hidden_size"], generator=torch.Generator().manual_seed(rank), requires_grad=True)
    lab = torch.randint(0, _TINY["vocab_size"], (B, 8), generator=torch.Generator().manual_seed(rank))
    direct = fused_causal_lm_loss(h, head, lab)
    with deepspeed.zero.GatheredParameters(head.weight, modifier_rank=None):
        logits = torch.nn.functional.linear(h, head.weight.detach())
        expect = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1))
    direct_err = (direct - expect).abs().item()
    losses: list[list[float]] = [[], []]
    for step in range(3):
        ids, labels = _batch(seed=100 * step + rank)
        for i, engine in enumerate(engines):
            loss = engine(input_ids=ids, labels=labels).loss
            engine.backward(loss)
            engine.step()
            losses[i].append(loss.item())
    diff = 0.0
    for p_ref, p_fused in zip(engines[0].module.parameters(), engines[1].module.parameters()):
        with deepspeed.zero.GatheredParameters([p_ref, p_fused], modifier_rank=None):
            diff = max(diff, (p_fused.detach() - p_ref.detach()).abs().max().item())
    return partitioned, losses, diff, direct_err


@pytest.mark.distributed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_zero3_two_processes():
    """2 ranks (gloo, DeepSpeed's CPU accelerator): patched and unpatched ZeRO-3 models train identically."""
    from shardkit.distributed.launcher import LaunchError, launch

    env = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": os.environ.get(
        "TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(__file__), "..", "..", ".torch_extensions"))}
    try:  # ~30 s on 2 loaded cores (spawn, import deepspeed, two engines)
        results = launch(zero3_worker, num_processes=2, timeout=400, env=env, in_process=False)
    except LaunchError as err:
        pytest.fail(f"zero3_worker failed on 2 processes:\n{err}", pytrace=False)
    for rank, (partitioned, losses, diff, direct_err) in enumerate(results):
        assert partitioned, f"rank {rank}: lm_head.weight was not partitioned: the test would not test ZeRO-3"
        assert direct_err < 1e-5, f"rank {rank}: loss with the gathered head off by {direct_err}"
        torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=1e-5, atol=1e-5)
        assert diff < 1e-5, f"rank {rank}: parameters after 3 steps differ by {diff}"


def test_geglu_and_swiglu_switches_are_separate():
    ref = _model("gemma")
    off = apply_fused_kernels(copy.deepcopy(ref), geglu=False, rope=False, cross_entropy=False)
    assert off.fused_kernels_report["geglu"] == 0 and "forward" not in off.model.layers[0].mlp.__dict__
    on = apply_fused_kernels(copy.deepcopy(ref), swiglu=False, rope=False, cross_entropy=False)
    assert on.fused_kernels_report["geglu"] == _TINY["num_hidden_layers"] and on.fused_kernels_report["swiglu"] == 0
    ids, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(on(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
