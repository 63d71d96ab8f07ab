"""``shardkit estimate-memory`` prints only the parallel activation rows that apply to ``--strategy``."""

import json

import pytest

from shardkit.cli import main


@pytest.fixture
def config(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
                               "num_hidden_layers": 8, "num_attention_heads": 8, "vocab_size": 1000}))
    return str(cfg)


def _rows(capsys, config, *args):
    assert main(["estimate-memory", "--config", config, "--batch-size", "2", "--seq-len", "1024", *args]) == 0
    out = capsys.readouterr().out
    return "Activations per rank under cp" in out, "per pipeline stage" in out, out


@pytest.mark.parametrize("args, cp_row, pp_row", [
    # the reported case: cp over 2 GPUs showed the pipeline row (pp defaulted to --num-gpus) and no cp row
    (("--strategy", "cp", "--num-gpus", "2"), True, False),
    (("--strategy", "cp", "--num-gpus", "4", "--cp-size", "2"), True, False),
    (("--strategy", "pp", "--num-gpus", "2"), False, True),
    (("--strategy", "fsdp", "--num-gpus", "2"), False, False),
    (("--num-gpus", "2",), False, True),  # all: pp defaults to the GPUs; cp only when sized
    (("--num-gpus", "4", "--cp-size", "2"), True, True),
    (("--strategy", "pp", "--num-gpus", "4", "--cp-size", "2"), True, True),  # sized explicitly: shown
])
def test_only_the_rows_that_apply(capsys, config, args, cp_row, pp_row):
    assert _rows(capsys, config, *args)[:2] == (cp_row, pp_row)


def test_cp_without_cp_size_splits_over_every_device_as_context_parallel_does(capsys, config):
    out = _rows(capsys, config, "--strategy", "cp", "--num-gpus", "4")[2]
    assert "Activations per rank under cp 4 (sequence split" in out
    out = _rows(capsys, config, "--strategy", "cp", "--num-gpus", "4", "--tp-size", "2")[2]
    assert "Activations per rank under cp 2 x tp 2" in out



def _tp_params(capsys, *args: str) -> float:
    assert main(["estimate-memory", "--params", "1B", "--strategy", "tp", "--num-gpus", "4", *args]) == 0
    return float(next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tp ")).split()[1])


def test_tp_row_uses_tp_size_as_the_activation_row_does(capsys):
    """--tp-size sized the cp x tp activations but the tp model-states row kept a node's tp (here 4)."""
    node, two = _tp_params(capsys), _tp_params(capsys, "--tp-size", "2")
    assert two == pytest.approx(2 * node, rel=0.01), (two, node)  # split 2 ways instead of 4
