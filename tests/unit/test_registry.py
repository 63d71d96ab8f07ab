"""The strategy and precision registries: every name and alias builds, every class imports by name, unknown
names and bad command-line options fail naming the fix, and the example scripts take their flags from them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is first imported: no GPU here

import pytest  # noqa: E402

import shardkit  # noqa: E402
from shardkit.precision import BF16, FP16, FP32, precision_from_name  # noqa: E402
from shardkit.precision.registry import PRECISIONS  # noqa: E402
from shardkit.strategies import strategy_from_name  # noqa: E402
from shardkit.strategies.base import Strategy  # noqa: E402
from shardkit.strategies.registry import STRATEGIES  # noqa: E402
from shardkit.utils.registry import Registry  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# Sizes, not behaviour: ZeROInfinity's default swap buffers (5 x 1e8 elements) would take 2 GB when used.
SMALL = {"zero_infinity": {"buffer_size": 100_000}}


def _every_spelling() -> list[str]:
    spellings = [*STRATEGIES.names(), *STRATEGIES.aliases(), *STRATEGIES.class_names()]
    return spellings + [s.upper().replace("_", "-") for s in STRATEGIES.names()]


# ---- strategies: names and building -------------------------------------------------------------------


def test_canonical_names_in_registration_order():
    assert STRATEGIES.names() == ["single", "ddp", "fsdp", "tp", "cp", "ep", "pp", "zero1", "zero2", "zero3",
                                  "zero_infinity"]


@pytest.mark.parametrize("spelling", _every_spelling())
def test_every_name_alias_and_class_name_builds_with_defaults(spelling):
    canonical = STRATEGIES.canonical(spelling)
    strategy = STRATEGIES.build(spelling, **SMALL.get(canonical, {}))

    assert isinstance(strategy, Strategy)
    assert type(strategy) is STRATEGIES.get_class(canonical)
    assert type(strategy).__name__ == STRATEGIES.entry(canonical).class_name


def test_defaults_that_need_the_world_are_left_for_setup():
    # tp spans every rank and zero_infinity swaps to the default directory, both chosen once the Runner starts.
    assert STRATEGIES.build("tp").settings.tp_size is None
    infinity = STRATEGIES.build("infinity")
    assert infinity.settings.uses_nvme and infinity.settings.nvme_path is None


def test_aliases_resolve_to_their_entry():
    assert STRATEGIES.canonical("tensor_parallel") == STRATEGIES.canonical("TensorParallel") == "tp"
    assert {STRATEGIES.canonical(n) for n in ("zero_infinity", "zero-infinity", "infinity", "ZeROInfinity")} == \
        {"zero_infinity"}
    assert STRATEGIES.canonical("SingleDevice") == "single"


def test_by_name_functions_are_the_registries_builders_and_the_old_table_is_gone_loudly():
    assert strategy_from_name == STRATEGIES.build and precision_from_name == PRECISIONS.build  # one implementation
    assert type(strategy_from_name("zero-3", offload="cpu")).__name__ == "ZeRO3"  # as the README writes it
    with pytest.raises(AttributeError, match=r"STRATEGY_NAMES was removed .*STRATEGIES.names\(\)"):
        shardkit.strategies.STRATEGY_NAMES


@pytest.mark.parametrize("class_name", sorted(STRATEGIES.class_names()))
def test_every_registered_class_imports_by_name(class_name):
    from shardkit import strategies

    namespace: dict = {}
    exec(f"from shardkit.strategies import {class_name}", namespace)  # the statement users write
    cls = STRATEGIES.get_class(class_name)

    assert namespace[class_name] is cls is getattr(strategies, class_name) is getattr(shardkit, class_name)
    assert class_name in dir(strategies)


def test_import_shardkit_leaves_deepspeed_unimported_until_a_zero_class_is_asked_for():
    code = ("import sys, shardkit, shardkit.strategies as s; s.STRATEGIES.names(); s.STRATEGIES.canonical('ZeRO3'); "
            "assert not {'deepspeed', 'shardkit.strategies.zero'} & set(sys.modules), 'imported early'; "
            "s.ZeRO3; assert 'shardkit.strategies.zero' in sys.modules")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("name, near", [("ddpx", "ddp"), ("zro3", "zero3"), ("zero_infinty", "zero_infinity"),
                                        ("fsdp3", "fsdp")])
def test_unknown_name_suggests_and_lists_the_known_ones(name, near):
    for call in (STRATEGIES.build, STRATEGIES.get_class, STRATEGIES.canonical, strategy_from_name):
        with pytest.raises(ValueError, match=f"unknown strategy '{name}'; did you mean '{near}'") as caught:
            call(name)
        assert all(n in str(caught.value) for n in STRATEGIES.names())


def test_unknown_name_far_from_everything_still_lists_the_names():
    with pytest.raises(ValueError, match=r"unknown strategy 'quantum_annealer'\. Known: single, ddp, fsdp"):
        STRATEGIES.canonical("quantum_annealer")


# ---- strategies: command-line options -----------------------------------------------------------------


def test_options_are_parsed_as_the_constructor_types_them():
    parsed = STRATEGIES.parse_options("zero3", ["offload=cpu", "overlap_comm=false", "reduce_bucket_size=5e8",
                                                "prefetch_bucket_size=auto", "timeout=30", "pin_memory=none",
                                                'extra={"zero_optimization": {"round_robin_gradients": true}}'])

    assert parsed == {"offload": "cpu", "overlap_comm": False, "reduce_bucket_size": 500_000_000,
                      "prefetch_bucket_size": "auto", "timeout": 30.0, "pin_memory": None,
                      "extra": {"zero_optimization": {"round_robin_gradients": True}}}
    assert type(parsed["reduce_bucket_size"]) is int and type(parsed["timeout"]) is float


def test_build_from_cli_sets_the_options_on_the_strategy():
    zero3 = STRATEGIES.build_from_cli("zero3", ["offload=cpu", "overlap_comm=false"])
    tp = STRATEGIES.build_from_cli("tensor_parallel", ["tp_size=2", "sequence-parallel=true"])
    ddp = STRATEGIES.build_from_cli("ddp", ["bucket_cap_mb=50"], bucket_cap_mb=10, static_graph=True)

    assert (zero3.settings.offload_optimizer, zero3.settings.offload_params) == ("cpu", "cpu")
    assert zero3.settings.overlap_comm is False
    assert (tp.settings.tp_size, tp.settings.sequence_parallel) == (2, True)
    assert (ddp.settings.bucket_cap_mb, ddp.settings.static_graph) == (50, True)  # the command line wins
    fsdp = STRATEGIES.build_from_cli("fsdp", ["auto_wrap=LlamaBlock", "activation_checkpointing=LlamaBlock"])
    assert (fsdp.settings.auto_wrap, fsdp.settings.activation_checkpointing) == ("LlamaBlock", "LlamaBlock")
    assert STRATEGIES.build_from_cli("fsdp", ["auto_wrap=100000"]).settings.auto_wrap == 100_000


def test_zero_infinity_offers_zero3_options_it_passes_on():
    options = STRATEGIES.options("zero_infinity")
    strategy = STRATEGIES.build_from_cli("infinity", ["buffer_size=100000", "overlap_comm=false"])

    assert {"nvme_path", "buffer_size", "aio", "overlap_comm", "max_live_parameters"} <= set(options)
    assert strategy.settings.overlap_comm is False and strategy.settings.buffer_size == 100_000


def test_objects_a_command_line_cannot_give_are_not_options():
    assert "plan" not in STRATEGIES.options("tp")  # a dict of ParallelStyle objects
    assert "tp_size" in STRATEGIES.options("tp")


@pytest.mark.parametrize("pairs, message", [
    (["ofload=cpu"], r"unknown option 'ofload' for strategy 'zero3'; did you mean 'offload'\? Valid: offload: "),
    (["offload"], r"strategy option 'offload' for 'zero3' must be key=value"),
    (["overlap_comm=maybe"], r"overlap_comm='maybe' must be none or bool \(overlap_comm: bool \| None = None\)"),
    (["max_live_parameters=1.5"], r"max_live_parameters='1.5' must be int"),
    (["extra={oops"], r"extra='\{oops' is not valid JSON"),
    (["offload=cpu", "offload=nvme"], r"option 'offload' for strategy 'zero3' is given twice"),
])
def test_bad_options_name_the_option_and_the_fix(pairs, message):
    with pytest.raises(ValueError, match=message):
        STRATEGIES.build_from_cli("zero3", pairs)


def test_unknown_option_lists_every_valid_one():
    with pytest.raises(ValueError) as caught:
        STRATEGIES.parse_options("ddp", ["bucket=1"])
    assert all(f"{name}:" in str(caught.value) for name in STRATEGIES.options("ddp"))


# ---- the Registry itself ------------------------------------------------------------------------------


def test_registration_rejects_taken_names_and_bad_targets():
    registry = Registry("widget")
    registry.register("a", "collections:OrderedDict", aliases=("alpha",))

    with pytest.raises(ValueError, match=r"name 'ALPHA' \(for 'b'\) is already registered for 'a'"):
        registry.register("b", "collections:Counter", aliases=("ALPHA",))
    with pytest.raises(ValueError, match="must be 'module.path:ClassName'"):
        registry.register("c", "collections.Counter")
    assert registry.names() == ["a"]


def test_a_new_entry_is_everywhere_at_once():
    registry = Registry("widget")
    registry.register("counter", "collections:Counter", defaults={"x": 1}, description="counts")

    assert registry.entry("counter").target == "collections:Counter" and "counter" in registry and "Counter" in registry
    assert registry.build("counter", y=2) == {"x": 1, "y": 2}
    assert "counter: counts" in registry.describe()


# ---- precisions ---------------------------------------------------------------------------------------


def test_precision_names():
    assert PRECISIONS.names() == ["fp32", "tf32", "fp16", "bf16", "fp8", "bf16-true"]


@pytest.mark.parametrize("name, cls, fields", [
    ("fp32", FP32, {"tf32": False}), ("32", FP32, {"tf32": False}), ("32-true", FP32, {"tf32": False}),
    ("no", FP32, {"tf32": False}), ("tf32", FP32, {"tf32": True}),
    ("fp16", FP16, {}), ("16", FP16, {}), ("16-mixed", FP16, {}), ("fp16_mixed", FP16, {}),
    ("bf16", BF16, {"mode": "mixed"}), ("bf16-mixed", BF16, {"mode": "mixed"}), ("BF16_Mixed", BF16, {"mode": "mixed"}),
    ("bf16-true", BF16, {"mode": "true"}), ("bf16_true", BF16, {"mode": "true"}),
])
def test_precision_names_and_aliases_build(name, cls, fields):
    for precision in (PRECISIONS.build(name), precision_from_name(name)):
        assert type(precision) is cls
        assert all(getattr(precision, k) == v for k, v in fields.items())


def test_precision_defaults_yield_to_arguments_and_options():
    assert PRECISIONS.build("tf32", tf32=False).tf32 is False
    assert PRECISIONS.build_from_cli("fp16", ["initial_scale_power=8"]).initial_scale_power == 8


def test_unknown_precision_suggests():
    with pytest.raises(ValueError, match="unknown precision 'bf61'; did you mean 'bf16'"):
        precision_from_name("bf61")


def test_every_accelerate_mixed_precision_value_is_a_precision():
    from shardkit.config.accelerate import _MIXED

    assert {PRECISIONS.canonical(m) for m in _MIXED} == {"fp32", "fp16", "bf16"}


# ---- the examples' flags ------------------------------------------------------------------------------


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", ["train_llama", "generate"])
def test_examples_take_names_from_the_registries(script):
    example = _example(script)
    args = example.parse_args(["--strategy", "tensor_parallel", "--strategy-opt", "tp_size=1",
                               "--precision", "bf16-mixed"])

    assert (args.strategy, args.precision) == ("tp", "bf16")
    strategy = example.make_strategy(args) if script == "generate" else example.strategy_from_args(args)
    assert strategy.settings.tp_size == 1


@pytest.mark.parametrize("argv, message", [
    (["--strategy", "ddpx"], "unknown strategy 'ddpx'; did you mean 'ddp'"),
    (["--precision", "bf61"], "unknown precision 'bf61'; did you mean 'bf16'"),
    (["--strategy", "zero3", "--strategy-opt", "ofload=cpu"], "did you mean 'offload'"),
    (["--strategy-opt", "offload=cpu"], "--strategy-opt needs a --strategy"),
])
def test_examples_reject_bad_flags_before_starting(argv, message, capsys):
    with pytest.raises(SystemExit) as caught:
        _example("train_llama").parse_args(argv)
    assert caught.value.code == 2 and message in capsys.readouterr().err


def test_the_memory_estimator_speaks_the_registries_names():
    # Its rows are configurations with a formula each (zero3_offload, fsdp_grad_op); each names a registered
    # strategy, or one with a variant suffix, and a registered precision.
    from shardkit.memory import estimate

    assert all(n in STRATEGIES or n.split("_")[0] in STRATEGIES for n in estimate.STRATEGIES)
    assert {PRECISIONS.canonical(p) for p in estimate.PRECISIONS} <= set(PRECISIONS.names())
