"""The Trainer's model preparation on 2 CPU ranks, under every strategy, in one process group:
use_fused_kernels patches an HF Llama before setup (patched modules in place inside the engine, losses equal to
the unpatched model's), NEFTune finds the embedding inside the engines' wrapping (noise within its bound in
training, eval logits bitwise unchanged, hook gone after train()); FSDP's cpu_ram_efficient_loading (rank 1 starts
from other or meta weights, every rank trains from rank 0's). ZeRO-2 shares ZeRO-3's engine set-up path
minus partitioning and is left out for time; torch_compile under the strategies was checked by hand (see
sdk/trainer/model_prep.py's docstring): its tracing costs ~10 s per strategy on CPU."""

import math

import pytest
import torch
from harness import run_distributed
from torch.utils.data import Dataset

from shardkit.models import Llama, LlamaConfig
from shardkit.strategies import strategy_from_name
from shardkit.trainer import Trainer, TrainerCallback, TrainingArguments
from shardkit.trainer.neftune import find_input_embeddings

VOCAB, SEQ, HIDDEN, ALPHA = 64, 16, 32, 5.0
FUSED_STRATEGIES = ("ddp", "fsdp", "zero3")
NEFTUNE_STRATEGIES = ("fsdp", "zero3", "tp")


class Tokens(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def _hf_llama():
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(HFConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ))


def _llama():  # shardkit's Llama: tensor parallelism has its plan
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_layers=2, num_heads=2,
                             max_position=SEQ))


def _args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=2, learning_rate=1e-2, max_steps=3, logging_steps=1,
                save_strategy="no", disable_tqdm=True, seed=0, optim="adamw_torch")
    return TrainingArguments(**{**base, **kw})


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _fused_case(strategy: str, out: str) -> dict:
    plain = Trainer(_hf_llama(), _args(out), train_dataset=Tokens(), strategy=strategy_from_name(strategy))
    plain.train()
    fused = Trainer(_hf_llama(), _args(out, use_fused_kernels=True), train_dataset=Tokens(),
                    strategy=strategy_from_name(strategy))
    fused.train()
    inner = fused.runner.unwrap_model(fused.model)  # the module the engine trains, after setup
    patched = all("forward" in m.__dict__ for m in (inner, inner.model.norm, inner.model.layers[1].mlp))
    return {"plain": _losses(plain), "fused": _losses(fused), "patched": patched,
            "report": inner.fused_kernels_report}


class Probe(TrainerCallback):
    """At train begin (the NEFTune hook in place): the embedding's output in eval and in training mode, and the
    model's eval logits; at train end the eval logits again (learning rate 0: the weights have not moved)."""

    def __init__(self, ids):
        self.ids, self.seen, self.logits, self.unwrap = ids, [], [], None

    def _logits(self, model):
        model.eval()
        with torch.no_grad():
            out = model(input_ids=self.ids)
        model.train()
        return getattr(out, "logits", out).detach().clone()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        emb = find_input_embeddings(self.unwrap(model))
        handle = emb.register_forward_hook(lambda m, a, o: self.seen.append(_local(o).detach().clone()))
        try:
            self.logits.append(self._logits(model))
            with torch.no_grad():
                model(input_ids=self.ids)
        finally:
            handle.remove()
        self.hooks = len(emb._forward_hooks)
        self.embedding = emb


def _local(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _neftune_case(strategy: str, out: str) -> dict:
    ids = Tokens()[0]["input_ids"][None].repeat(2, 1)
    probe = Probe(ids)
    model = _llama() if strategy == "tp" else _hf_llama()
    trainer = Trainer(model, _args(out, neftune_noise_alpha=ALPHA, learning_rate=0.0, max_steps=1),
                      train_dataset=Tokens(), strategy=strategy_from_name(strategy), callbacks=[probe])
    probe.unwrap = trainer.runner.unwrap_model
    trainer.train()
    after = probe._logits(trainer.model)
    plain, noisy = probe.seen
    return {"noise_max": float((noisy - plain).abs().max()), "eval_equal": torch.equal(after, probe.logits[0]),
            "hooks_during": probe.hooks, "hooks_after": len(probe.embedding._forward_hooks),
            "noise_sum": float((noisy - plain).sum())}


class WeightsAtStart(TrainerCallback):
    """Every parameter's full value once the strategy has set the model up (before the first step)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.weights = {n: _local(p).detach().clone() for n, p in model.named_parameters()}


def _ram_efficient_case(rank1_build: str, out: str) -> dict:
    """fsdp_config cpu_ram_efficient_loading: rank 0 holds the real weights; rank 1's model has other weights
    ("other") or none at all ("meta")."""
    import torch.distributed as dist
    from transformers.integrations import is_fsdp_enabled

    if dist.get_rank() == 0:
        model = _hf_llama()
    elif rank1_build == "meta":
        with torch.device("meta"):
            model = _hf_llama()
    else:
        torch.manual_seed(1)
        model = _hf_llama().apply(lambda m: [p.data.normal_() for p in m.parameters(recurse=False)])
    probe = WeightsAtStart()
    args = _args(out, max_steps=2, fsdp="full_shard", fsdp_config={"cpu_ram_efficient_loading": True})
    trainer = Trainer(model, args, train_dataset=Tokens(), callbacks=[probe])
    trainer.train()
    with trainer.runner.init_module():  # rank 0 alone builds real weights
        built = torch.nn.Linear(4, 4)
    plugin = trainer.accelerator.state.fsdp_plugin  # what scripts written for Accelerate read
    return {"weights": probe.weights, "losses": _losses(trainer), "hf_told": is_fsdp_enabled(),
            "built_meta": built.weight.is_meta, "plugin": (plugin.cpu_ram_efficient_loading, plugin.sync_module_states,
                                                           plugin.sharding_strategy)}


def _rank0_meta_case(out: str) -> str:
    """Rank 0 without weights: every rank stops with the error (none waits for a broadcast that never comes)."""
    with torch.device("meta"):
        model = _hf_llama()
    args = _args(out, max_steps=1, fsdp="full_shard", fsdp_config={"cpu_ram_efficient_loading": True})
    try:
        Trainer(model, args, train_dataset=Tokens()).train()
    except ValueError as err:
        return str(err)
    return "no error"


def _worker(out: str) -> dict:
    return {"fused": {s: _fused_case(s, f"{out}/{s}") for s in FUSED_STRATEGIES},
            "neftune": {s: _neftune_case(s, f"{out}/n{s}") for s in NEFTUNE_STRATEGIES},
            "ram_efficient": {b: _ram_efficient_case(b, f"{out}/r{b}") for b in ("other", "meta")},
            "rank0_meta": _rank0_meta_case(f"{out}/r0meta")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One 2-rank run shared by the tests below (one process group, one import of torch per rank)."""
    return run_distributed(_worker, 2, args=(str(tmp_path_factory.mktemp("prep")),), env={"DS_ACCELERATOR": "cpu"})


def test_fused_kernels_and_neftune_under_every_strategy(results):
    bound = ALPHA / math.sqrt(SEQ * HIDDEN)
    for rank, result in enumerate(results):
        for strategy, case in result["fused"].items():
            assert case["patched"], (rank, strategy)
            assert case["report"]["rms_norm"] == 5 and case["report"]["cross_entropy"], (rank, strategy)
            assert case["fused"] == pytest.approx(case["plain"], rel=1e-5), (rank, strategy)
        for strategy, case in result["neftune"].items():
            assert 0.5 * bound < case["noise_max"] <= bound * (1 + 1e-6), (rank, strategy, case)
            assert case["eval_equal"], (rank, strategy)
            assert case["hooks_during"] == case["hooks_after"] + 1, (rank, strategy, case)
    # Tensor parallelism replicates the embeddings' output: both ranks must have drawn the same noise.
    assert results[0]["neftune"]["tp"]["noise_sum"] == results[1]["neftune"]["tp"]["noise_sum"]


def test_fsdp_cpu_ram_efficient_loading_trains_every_rank_from_rank0s_weights(results):
    rank0 = _hf_llama().state_dict()
    for build in ("other", "meta"):
        cases = [result["ram_efficient"][build] for result in results]
        for rank, case in enumerate(cases):
            assert case["weights"].keys() <= rank0.keys(), build
            for name, value in case["weights"].items():
                assert torch.equal(value, rank0[name]), (build, rank, name)
            assert len(case["losses"]) == 2 and all(math.isfinite(x) for x in case["losses"]), (build, rank, case)
            assert case["hf_told"], (build, rank)  # transformers' from_pretrained sees Accelerate's variables
        assert cases[0]["losses"] == cases[1]["losses"], build
        assert [c["built_meta"] for c in cases] == [False, True], build
        assert all(c["plugin"] == (True, True, "full") for c in cases), build
    assert all("rank 0's model has parameters on the meta device" in r["rank0_meta"] for r in results), results
