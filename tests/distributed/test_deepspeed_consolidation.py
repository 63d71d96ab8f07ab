"""zero-to-fp32 on real DeepSpeed 0.19.8 checkpoints (2 CPU ranks, ZeRO-1/2/3, fp32 and bf16), converted
where DeepSpeed cannot be imported and compared bitwise with DeepSpeed's own consolidation."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from shardkit.checkpoint.zero_to_fp32 import get_fp32_state_dict, main

CONFIGS = [(stage, dtype) for stage in (1, 2, 3) for dtype in ("fp32", "bf16")]
ENV = {"DS_ACCELERATOR": "cpu"}


class Tiny(nn.Module):
    """Odd sizes (77 = 7x10 + 7 forces padding on 2 ranks), a frozen layer, tied embeddings, buffers."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(13, 10)
        self.norm = nn.LayerNorm(10)
        self.proj = nn.Linear(10, 7)
        self.frozen = nn.Linear(7, 5)
        self.frozen.requires_grad_(False)
        self.up = nn.Linear(5, 10, bias=False)
        self.head = nn.Linear(10, 13, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([1.5, 2.5, 3.0]))
        self.register_buffer("count", torch.tensor(3, dtype=torch.int64))

    def forward(self, ids):
        h = self.up(self.frozen(self.proj(self.norm(self.embed(ids)))))
        return self.head(h) * self.scale[0]


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def _train_and_save(model, out, stage, dtype, steps, vocab):
    import deepspeed

    decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith("weight")]
    groups = [{"params": decay, "weight_decay": 0.1}] + ([{"params": rest}] if rest else [])
    opt = torch.optim.SGD(groups, lr=0.1)
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "bf16": {"enabled": dtype == "bf16"}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    for step in range(steps):
        ids = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(step))
        out_ = engine(ids)
        logits = out_.logits if hasattr(out_, "logits") else out_
        engine.backward(logits.float().pow(2).mean())
        engine.step()
        engine.save_checkpoint(out)


def _build(root):
    """Rank worker: every checkpoint of the module, in one process group."""
    from shardkit.distributed.process_group import init_distributed

    init_distributed("cpu")
    for stage, dtype in CONFIGS:
        torch.manual_seed(0)
        # two saves: `latest` names global_step2, global_step1 stays for --tag
        _train_and_save(Tiny(), f"{root}/z{stage}_{dtype}", stage, dtype, steps=2 if stage == 2 else 1, vocab=13)
    torch.manual_seed(0)
    model = _tiny_llama()
    if int(os.environ.get("RANK", "0")) == 0:
        model.config.save_pretrained(f"{root}/llama_config")
    _train_and_save(model, f"{root}/llama_z3", 3, "fp32", steps=1, vocab=37)
    return True


_CONVERT = r"""
import importlib.abc, json, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "deepspeed" or name.startswith("deepspeed."):
            raise ImportError("deepspeed is blocked in this test")
sys.meta_path.insert(0, Block())
from safetensors.torch import save_file
from shardkit.checkpoint.zero_to_fp32 import get_fp32_state_dict, main
jobs = json.loads(sys.argv[1])
for src, out, extra in jobs:
    assert main([src, out, *extra]) == 0, (src, extra)
    if not extra:
        sd = get_fp32_state_dict(src)
        save_file({k: sd[k].clone() for k in sd}, out + "/lazy.safetensors")
assert not [m for m in sys.modules if m.startswith("deepspeed")]
print("converted", len(jobs))
"""


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    run_distributed(_build, world_size=2, timeout=900, args=(str(root),), env=ENV)
    jobs = []
    for stage, dtype in CONFIGS:
        src = str(root / f"z{stage}_{dtype}")
        jobs += [(src, f"{src}_out", []), (src, f"{src}_nofrozen", ["--exclude-frozen-parameters"])]
    jobs += [(str(root / "z2_fp32"), str(root / "z2_fp32_step1"), ["--tag", "global_step1", "--max-shard-size", "300"]),
             (str(root / "llama_z3"), str(root / "llama_out"), ["--max-shard-size", "4KB"])]
    proc = subprocess.run([sys.executable, "-c", _CONVERT, json.dumps(jobs)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **ENV})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def _read_out(out):
    index = out / "model.safetensors.index.json"
    if not index.exists():
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            tied = json.loads(f.metadata().get("tied_weights", "{}"))
        return load_file(out / "model.safetensors"), tied
    meta = json.loads(index.read_text())
    tensors = {}
    for f in sorted(set(meta["weight_map"].values())):
        tensors.update(load_file(out / f))
    assert set(tensors) == set(meta["weight_map"])
    return tensors, meta["metadata"].get("tied_weights", {})


def _deepspeed(src, **kw):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(src), **kw)


def _assert_equal(got, ref):
    assert sorted(got) == sorted(ref)
    for k, want in ref.items():
        want = want.float() if want.is_floating_point() else want
        assert got[k].dtype == want.dtype and got[k].shape == want.shape, k
        assert torch.equal(got[k], want), k


@pytest.mark.parametrize("stage,dtype", CONFIGS)
def test_matches_deepspeed_bitwise(converted, stage, dtype):
    src = converted / f"z{stage}_{dtype}"
    ref = _deepspeed(src)
    files, tied = _read_out(Path(f"{src}_out"))
    lazy = load_file(Path(f"{src}_out") / "lazy.safetensors")
    if stage == 1:  # DeepSpeed's converter drops ZeRO-1's frozen parameters; ours reads them from the module state
        assert "frozen.weight" not in ref
        torch.manual_seed(0)
        want = {k: v.to(torch.bfloat16 if dtype == "bf16" else torch.float32).float()
                for k, v in Tiny().frozen.state_dict().items()}
        for k, v in want.items():
            assert torch.equal(lazy.pop(f"frozen.{k}"), v) and torch.equal(files.pop(f"frozen.{k}"), v)
    assert "head.weight" in ref and "count" in ref and (stage == 1 or "frozen.weight" in ref)
    assert tied == {"head.weight": "embed.weight"}
    _assert_equal({**files, **{a: files[t] for a, t in tied.items()}}, ref)
    _assert_equal(lazy, ref)
    sd = get_fp32_state_dict(src)  # the lazy mapping keeps DeepSpeed's order: buffers, frozen, trained, aliases
    assert [k for k in sd if k in ref] == list(ref)
    no_frozen, _ = _read_out(Path(f"{src}_nofrozen"))
    ref = _deepspeed(src, exclude_frozen_parameters=True)
    assert "frozen.weight" not in ref and "frozen.weight" not in no_frozen
    _assert_equal({**no_frozen, "head.weight": no_frozen["embed.weight"]}, ref)


def test_tag_picks_an_older_save_and_shards_with_an_index(converted):
    src = converted / "z2_fp32"
    assert (src / "latest").read_text().strip() == "global_step2"
    files, tied = _read_out(converted / "z2_fp32_step1")
    assert len(list((converted / "z2_fp32_step1").glob("model-*-of-*.safetensors"))) > 1
    ref = _deepspeed(src, tag="global_step1")
    _assert_equal({**files, "head.weight": files["embed.weight"]}, ref)
    assert not torch.equal(ref["proj.weight"], _deepspeed(src)["proj.weight"])


def test_hf_model_loads_with_from_pretrained(converted):
    from transformers import LlamaForCausalLM

    out = converted / "llama_out"
    shutil.copy(converted / "llama_config" / "config.json", out / "config.json")
    assert (out / "model.safetensors.index.json").exists()
    model = LlamaForCausalLM.from_pretrained(out)
    ref = _deepspeed(converted / "llama_z3")
    own = model.state_dict()
    for k, v in ref.items():
        if k in own:
            assert torch.equal(own[k], v), k
    assert torch.equal(model.lm_head.weight, ref["model.embed_tokens.weight"])


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_truncated_missing_and_foreign_give_named_errors_and_write_nothing(converted, tmp_path, capsys):
    bad = _copy(converted / "z3_fp32", tmp_path / "trunc")
    rank1 = bad / "global_step1" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rank1.write_bytes(rank1.read_bytes()[: rank1.stat().st_size // 2])
    missing = _copy(converted / "z2_bf16", tmp_path / "missing")
    (missing / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("hello")
    cases = [(bad, "zero_pp_rank_1_mp_rank_00_optim_states.pt"), (missing, "zero_pp_rank_1_mp_rank_00_optim_states"),
             (foreign, str(foreign))]
    for src, named in cases:
        out = tmp_path / f"out_{src.name}"
        assert main([str(src), str(out)]) == 2
        err = capsys.readouterr().err
        assert named in err, err
        assert not out.exists()
