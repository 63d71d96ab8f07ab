"""NEFTune (TrainingArguments.neftune_noise_alpha): the noise's bound and spread, training mode only (eval logits
and generation bitwise unchanged), the hook gone after train() and after a failed train(), bad alphas refused."""

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Subset

from shardkit.models import ByteTextDataset, Llama, LlamaConfig
from shardkit.trainer import Trainer, TrainerCallback, TrainingArguments
from shardkit.trainer.neftune import NEFTuneHook, find_input_embeddings, neftune

TEXT = Path(__file__).resolve().parents[2] / "examples" / "data" / "public_domain.txt"
TINY = LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, max_position=16)
SEQ, ALPHA = 16, 5.0


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, learning_rate=1e-2, max_steps=2,
                logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, optim="adamw_torch")
    return TrainingArguments(**{**base, **kw})


def _data(n=16):
    return Subset(ByteTextDataset(TEXT, seq_len=SEQ, stride=SEQ), range(n))


def test_noise_is_bounded_by_alpha_over_sqrt_ld_and_uniform():
    torch.manual_seed(0)
    emb = nn.Embedding(50, 512)
    ids = torch.randint(0, 50, (8, 128))
    handle = emb.register_forward_hook(NEFTuneHook(ALPHA))
    noise = (emb(ids) - emb.weight[ids]).detach()
    handle.remove()
    bound = ALPHA / math.sqrt(128 * 512)
    assert noise.abs().max() <= bound * (1 + 1e-6)
    assert noise.abs().max() > 0.99 * bound  # 524288 draws reach the edges of U(-bound, bound)
    assert noise.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.01)
    assert abs(noise.mean().item()) < bound * 0.01
    emb.eval()  # eval mode: the hook leaves the output alone
    with neftune(emb, ALPHA):
        assert torch.equal(emb(ids), emb.weight[ids])


class Probe(TrainerCallback):
    """At train begin (the hook is in place): eval logits, a generation, and the noise of a training forward."""

    def __init__(self, ids):
        self.ids, self.noise, self.eval_logits, self.generated = ids, [], None, None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        emb = find_input_embeddings(model)
        model.eval()
        with torch.no_grad():
            self.eval_logits = model(self.ids)
            self.generated = model.generate(self.ids[:, :4], max_new_tokens=6)
        model.train()
        handle = emb.register_forward_hook(lambda m, a, out: self.noise.append((out - m.weight[a[0]]).detach()))
        try:
            with torch.no_grad():
                model(self.ids)
        finally:
            handle.remove()


class Boom(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        raise RuntimeError("boom")


def test_trainer_adds_noise_in_training_only_and_removes_the_hook(tmp_path):
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    model = Llama(TINY)
    hooks_before = len(model.embed_tokens._forward_hooks)
    with torch.no_grad():
        plain_logits = model.eval()(ids)
        plain_generated = model.generate(ids[:, :4], max_new_tokens=6)
    model.train()
    probe = Probe(ids)
    trainer = Trainer(model, _args(tmp_path, neftune_noise_alpha=ALPHA), train_dataset=_data(), callbacks=[probe])
    trainer.train()
    bound = ALPHA / math.sqrt(SEQ * TINY.hidden_size)
    noise = probe.noise[0]
    assert 0.5 * bound < noise.abs().max() <= bound * (1 + 1e-6)  # the training forward had the noise
    assert torch.equal(probe.eval_logits, plain_logits)  # eval: bitwise the logits without NEFTune
    assert torch.equal(probe.generated, plain_generated)
    assert len(model.embed_tokens._forward_hooks) == hooks_before  # gone after train()
    # A train() that fails half-way removes it too.
    failing = Trainer(Llama(TINY), _args(tmp_path / "b", neftune_noise_alpha=ALPHA), train_dataset=_data(),
                      callbacks=[Boom()])
    with pytest.raises(RuntimeError, match="boom"):
        failing.train()
    assert not failing.model.embed_tokens._forward_hooks


def test_the_trainers_own_forward_gets_the_noise(tmp_path):
    def first_loss(alpha):
        torch.manual_seed(1)
        trainer = Trainer(Llama(TINY), _args(tmp_path / str(alpha), neftune_noise_alpha=alpha, max_steps=1),
                          train_dataset=_data())
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h][0]

    assert first_loss(None) != first_loss(50.0)  # same weights and batch: only the noise differs


def test_hugging_face_embeddings_are_found_and_bad_alphas_refused(tmp_path):
    class TwoTables(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Embedding(4, 4), nn.Embedding(4, 4)

    class HFLike(TwoTables):
        def get_input_embeddings(self):
            return self.b

    model = HFLike()
    assert find_input_embeddings(model) is model.b
    with pytest.raises(ValueError, match="get_input_embeddings"):
        find_input_embeddings(TwoTables())
    for bad in (-1.0, 0, "5", True):
        with pytest.raises(ValueError, match="neftune_noise_alpha"):
            _args(tmp_path, neftune_noise_alpha=bad)
