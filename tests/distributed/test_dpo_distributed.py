"""DPOTrainer on 2 real processes (gloo on CPU) x gradient accumulation 2 over ragged pairs (micro-batches of 2 and
1 pairs of different lengths) gives the loss and gradients of one big batch, padded (HF Llama) and padding-free
(shardkit's Llama); both cases share one process group."""

from pathlib import Path

import pytest
import torch
from harness import run_distributed

from shardkit.models import Llama, LlamaConfig
from shardkit.preference import DPOConfig, DPOTrainer
from shardkit.sft import train_tokenizer
from shardkit.strategies import strategy_from_name
from shardkit.trainer import TrainerCallback

transformers = pytest.importorskip("transformers")

TEXT = Path(__file__).resolve().parents[2] / "examples" / "data" / "public_domain.txt"
PAIRS = [
    ("The old house stood", " on a hill above the town.", " under water."),
    ("She opened the letter and", " read it twice before smiling.", " ate it."),
    ("In the morning the fishermen", " pushed their boats into the grey sea.", " slept."),
    ("He asked the way to", " the station.", " nowhere at all, then left the town for good."),
    ("The river ran", " fast and cold.", " upward into the clouds, singing loudly to the birds."),
    ("When the bell rang", " the children ran out into the yard.", " nothing."),
]


def _model(kind: str, vocab: int):
    torch.manual_seed(0)
    if kind == "llama":
        return Llama(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                                 num_kv_heads=2, max_position=128, fused=False))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128))


class Grads(TrainerCallback):
    def __init__(self):
        self.grads = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n.removeprefix("module."): p.grad.detach().clone() for n, p in model.named_parameters()
                      if p.grad is not None}


def _step(kind: str, out: Path, batch: int, accumulation: int, strategy=None) -> dict:
    """One optimizer step over all the pairs; its loss and the gradients before the optimizer step."""
    tokenizer = train_tokenizer([TEXT], vocab_size=300)
    args = DPOConfig(output_dir=str(out / kind), per_device_train_batch_size=batch,
                     gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=1e-2, logging_steps=1,
                     save_strategy="no", disable_tqdm=True, report_to="none", seed=0, max_grad_norm=0.0,
                     train_sampling_strategy="sequential", beta=0.5, loss_type=["sigmoid", "sft"],
                     loss_weights=[1.0, 0.5], padding_free=kind == "llama", use_cpu=True)
    grads = Grads()
    data = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]
    trainer = DPOTrainer(_model(kind, len(tokenizer)), args=args, train_dataset=data, processing_class=tokenizer,
                         callbacks=[grads], strategy=strategy)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h][0]
    return {"loss": logged["loss"], "margins": logged["rewards/margins"], "grads": grads.grads}


def _worker(out: str) -> dict:
    # 3 pairs per rank: micro-batches of 2 pairs and 1 pair
    return {kind: _step(kind, Path(out), 2, 2, strategy_from_name("ddp")) for kind in ("hf", "llama")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo")
    return run_distributed(_worker, 2, args=(str(out),))


@pytest.mark.parametrize("kind", ["hf", "llama"])
def test_two_ranks_accumulating_ragged_pairs_equal_one_big_batch(runs, kind, tmp_path):
    big = _step(kind, tmp_path, len(PAIRS), 1)
    for rank in runs:
        got = rank[kind]
        assert got["loss"] == pytest.approx(big["loss"], abs=1e-5)
        assert got["margins"] == pytest.approx(big["margins"], abs=1e-6)
        assert set(got["grads"]) == set(big["grads"]) and big["grads"]
        for name, grad in big["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, atol=1e-6, rtol=1e-5, msg=name)
