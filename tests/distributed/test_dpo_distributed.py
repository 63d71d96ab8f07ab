"""DPOTrainer on 2 real processes (gloo on CPU) gives the loss, metrics, gradients and weights after a step of one
big batch in one process, padded (HF Llama) and padding-free (shardkit's Llama), under:

- DDP, 2 ranks x gradient accumulation 2 over ragged pairs (micro-batches of 2 and 1 pairs of different lengths);
- FSDP, the same: the completions are scored inside the model's forward, where FSDP2 has the head whole, and the
  reference model is sharded alike;
- ZeRO-3 (HF Llama) and TensorParallel (shardkit's Llama, the head split on the vocabulary; both ranks see every
  pair): the reference model set up by the Runner and sharded like the policy.

KTO (unpaired rows, no KL term), ORPO and CPO (SimPO) under FSDP, HF Llama, 2 ranks x accumulation 2: the loss and
the weights after a step equal one big batch's in one process (scored inside the forward like DPO).

Every case shares one process group (one launch)."""

from pathlib import Path

import pytest
import torch
from harness import run_distributed

from shardkit.models import Llama, LlamaConfig
from shardkit.preference import (
    CPOConfig,
    CPOTrainer,
    DPOConfig,
    DPOTrainer,
    KTOConfig,
    KTOTrainer,
    ORPOConfig,
    ORPOTrainer,
)
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


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


class Grads(TrainerCallback):
    """The gradients before the optimizer step, whole (FSDP's and TP's DTensor shards gathered); none under ZeRO-3,
    whose engine holds them: the weights after the SGD step (lr 1) hold them there."""

    def __init__(self):
        self.grads = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n.removeprefix("module."): _full(p.grad) for n, p in model.named_parameters()
                      if p.grad is not None}


def _weights(trainer) -> dict:
    from shardkit.utils.partitioned import gathered_for_read

    model = trainer.runner.unwrap_model(trainer.model_wrapped)
    params = dict(model.named_parameters())
    with gathered_for_read(*params.values()):  # ZeRO-3's partitions; a no-op elsewhere
        return {n.removeprefix("module."): _full(p) for n, p in params.items()}


def _step(kind: str, out: Path, batch: int, accumulation: int, strategy=None) -> dict:
    """One SGD step (lr 1: the weights move by the gradient) over all the pairs; its loss, margins, the gradients
    before the optimizer step and the weights after it."""
    tokenizer = train_tokenizer([TEXT], vocab_size=300)
    args = DPOConfig(output_dir=str(out / kind), per_device_train_batch_size=batch,
                     gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=1.0, optim="sgd",
                     logging_steps=1,
                     save_strategy="no", disable_tqdm=True, report_to="none", seed=0, max_grad_norm=0.0,
                     train_sampling_strategy="sequential", beta=0.5, loss_type=["sigmoid", "sft"],
                     loss_weights=[1.0, 0.5], padding_free=kind == "llama", use_cpu=True)
    grads = Grads()
    data = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]
    trainer = DPOTrainer(_model(kind, len(tokenizer)), args=args, train_dataset=data, processing_class=tokenizer,
                         callbacks=[grads], strategy=strategy)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h][0]
    return {"loss": logged["loss"], "grads": grads.grads, "weights": _weights(trainer),
            "metrics": {k: logged[k] for k in ("rewards/margins", "entropy", "mean_token_accuracy", "num_tokens")}}


# (strategy, model kind, per-device pairs, accumulation): 6 pairs a step. Data-parallel ranks see 3 pairs each,
# micro-batches of 2 pairs and 1 pair; TP's ranks (one data-parallel rank) see every pair.
CASES = [("ddp", "hf", 2, 2), ("ddp", "llama", 2, 2), ("fsdp", "hf", 2, 2), ("fsdp", "llama", 2, 2),
         ("zero3", "hf", 2, 2), ("tp", "llama", 3, 2)]


FAMILY = {"kto": (KTOTrainer, KTOConfig, dict(loss_type="apo_zero_unpaired", max_length=48)),
          "orpo": (ORPOTrainer, ORPOConfig, dict(max_length=48)),
          "cpo": (CPOTrainer, CPOConfig, dict(loss_type="simpo", cpo_alpha=0.5, max_length=48))}


def _family_step(name: str, out: Path, batch: int, accumulation: int, strategy=None) -> dict:
    """One SGD step (lr 1) of KTO, ORPO or CPO over all the pairs (KTO: each pair as a desirable and an undesirable
    row, every second one kept); its loss and the weights after it."""
    tokenizer = train_tokenizer([TEXT], vocab_size=300)
    trainer_cls, config_cls, settings = FAMILY[name]
    args = config_cls(output_dir=str(out / name), per_device_train_batch_size=batch,
                      gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=1.0, optim="sgd",
                      logging_steps=1, save_strategy="no", disable_tqdm=True, report_to="none", seed=0,
                      max_grad_norm=0.0, train_sampling_strategy="sequential", beta=0.5, use_cpu=True, **settings)
    if name == "kto":
        data = [{"prompt": p, "completion": c if i % 2 else r, "label": bool(i % 2)}
                for i, (p, c, r) in enumerate(PAIRS)]
    else:
        data = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]
    trainer = trainer_cls(_model("hf", len(tokenizer)), args=args, train_dataset=data, processing_class=tokenizer,
                          strategy=strategy)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h][0]
    return {"loss": logged["loss"], "weights": _weights(trainer)}


def _worker(out: str) -> dict:
    results = {(name, kind): _step(kind, Path(out) / name, batch, accumulation, strategy_from_name(name))
               for name, kind, batch, accumulation in CASES}
    for family in FAMILY:
        results[("fsdp", family)] = _family_step(family, Path(out) / "fsdp", 2, 2, strategy_from_name("fsdp"))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo")
    return run_distributed(_worker, 2, args=(str(out),))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo_one")
    return {**{kind: _step(kind, out, len(PAIRS), 1) for kind in ("hf", "llama")},
            **{family: _family_step(family, out, len(PAIRS), 1) for family in FAMILY}}


@pytest.mark.parametrize("name, kind", [case[:2] for case in CASES], ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_two_ranks_equal_one_big_batch(runs, one_process, name, kind):
    big = one_process[kind]
    for rank in runs:
        got = rank[(name, kind)]
        assert got["loss"] == pytest.approx(big["loss"], abs=1e-5)  # TP's ranks share one batch: counted once
        # TRL's metrics over every rank: num_tokens counts TP's shared batch once
        assert got["metrics"] == pytest.approx(big["metrics"], abs=1e-6)
        if name != "zero3":  # the engine holds ZeRO-3's gradients: its weights below hold them
            assert set(got["grads"]) == set(big["grads"]) and big["grads"]
            for param, grad in big["grads"].items():
                torch.testing.assert_close(got["grads"][param], grad, atol=1e-6, rtol=1e-5, msg=param)
        assert set(got["weights"]) == set(big["weights"]) and big["weights"]
        for param, weight in big["weights"].items():
            torch.testing.assert_close(got["weights"][param], weight, atol=1e-6, rtol=1e-5, msg=param)


@pytest.mark.parametrize("family", list(FAMILY))
def test_the_family_under_fsdp_equals_one_big_batch(runs, one_process, family):
    big = one_process[family]
    for rank in runs:
        got = rank[("fsdp", family)]
        assert got["loss"] == pytest.approx(big["loss"], abs=1e-5)
        assert set(got["weights"]) == set(big["weights"]) and big["weights"]
        for param, weight in big["weights"].items():
            torch.testing.assert_close(got["weights"][param], weight, atol=1e-6, rtol=1e-5, msg=param)
