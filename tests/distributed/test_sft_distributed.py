"""SFTTrainer on real processes (gloo on CPU): 2 ranks x GA 4 on ragged packed batches give the loss and gradients
of one big batch (shardkit's Llama and an HF Llama); a run stopped mid-epoch on 2 ranks and resumed on 3 and on 1
serves every sequence of the epoch exactly once, from a packed map-style dataset and from a streamed one."""

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed

from shardkit.models import Llama, LlamaConfig
from shardkit.sft import SFTConfig, SFTTokenizer, SFTTrainer, prepare_dataset, train_tokenizer
from shardkit.sft.chat import text_conversations
from shardkit.sft.collator import split_sequences
from shardkit.strategies import strategy_from_name
from shardkit.trainer import TrainerCallback

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

TEXT = Path(__file__).resolve().parents[2] / "examples" / "data" / "public_domain.txt"
MAX_LENGTH = 128
RESUME_BATCH = 2


def _tokenizer():
    return train_tokenizer([TEXT], vocab_size=400)  # deterministic: every rank trains the same one


def _conversations():
    # one-turn exchanges of clauses: 28 to 128 tokens, one or two to a packed row, some with no assistant token left
    # after truncation (a micro-batch without labels must not break the window's loss)
    return text_conversations(TEXT.read_text(), max_turns=1, system=None, split=r"(?<=[,;:.!?])\s+")[:60]


def _model(kind: str, vocab: int):
    torch.manual_seed(0)
    if kind == "llama":
        # fused=False: these runs test the data and the loss, not the kernels (tests/unit/test_sft_packing.py does)
        return Llama(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                                 num_kv_heads=2, max_position=MAX_LENGTH, fused=False))
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=MAX_LENGTH)
    return transformers.LlamaForCausalLM(config)


def _shards(shards, conversations):
    for shard in shards:
        yield from conversations[shard * 5:(shard + 1) * 5]


def _stream(conversations):
    return datasets.IterableDataset.from_generator(_shards, gen_kwargs={"shards": list(range(12)),
                                                                         "conversations": tuple(conversations)})


class Recorder:
    """Wraps the collator: keeps every batch this rank was served."""

    def __init__(self, collator):
        self.collator, self.batches = collator, []

    def __call__(self, examples):
        batch = self.collator(examples)
        self.batches.append({k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})
        return batch


class Grads(TrainerCallback):
    def __init__(self):
        self.grads = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n.removeprefix("module."): p.grad.detach().clone() for n, p in model.named_parameters()}


class StopAtEpochEnd(TrainerCallback):
    def on_epoch_end(self, args, state, control, **kwargs):
        control.should_training_stop = True


def _args(out: Path, **kw):
    base = dict(output_dir=str(out), max_length=MAX_LENGTH, packing=True, assistant_only_loss=True, learning_rate=1e-2,
                lr_scheduler_type="constant", logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
                report_to="none", optim="adamw_torch", max_grad_norm=0.0)
    return SFTConfig(**{**base, **kw})


def _window(kind: str, out: Path) -> dict:
    """One optimizer step of GA 4 on ragged padding-free packed rows (one bin per micro-batch)."""
    tokenizer = _tokenizer()
    trainer = SFTTrainer(_model(kind, len(tokenizer)), _args(out / kind, per_device_train_batch_size=1,
                                                             gradient_accumulation_steps=4, max_steps=1),
                         train_dataset=_conversations(), processing_class=tokenizer, strategy=strategy_from_name("ddp"))
    recorder, grads = Recorder(trainer.data_collator), Grads()
    trainer.data_collator = recorder
    trainer.add_callback(grads)
    trainer.train()
    return {"batches": recorder.batches, "grads": grads.grads, "loss": trainer.state.log_history[0]["loss"]}


def _first_half(kind: str, out: Path, steps: int) -> list:
    """2 ranks train ``steps`` steps of the epoch and save there."""
    tokenizer = _tokenizer()
    data = _conversations() if kind == "map" else _stream(_conversations())
    trainer = SFTTrainer(_model("llama", len(tokenizer)), _args(out / kind, per_device_train_batch_size=RESUME_BATCH,
                                                                max_steps=steps, save_strategy="steps",
                                                                save_steps=steps),
                         train_dataset=data, processing_class=tokenizer, strategy=strategy_from_name("ddp"))
    recorder = trainer.data_collator = Recorder(trainer.data_collator)
    trainer.train()
    # The batches trained, not all those collated: a stream's loader reads one batch ahead (to know its last), and
    # the batch read ahead of the save is the resumed run's first.
    trained = recorder.batches[:trainer.state.global_step * trainer.args.gradient_accumulation_steps]
    return [s for b in trained for s in split_sequences(b)]


def _resume(kind: str, out: Path, steps: int, world: int) -> list:
    """Resume the 2-rank checkpoint on this world size and train to the end of the epoch."""
    tokenizer = _tokenizer()
    data = _conversations() if kind == "map" else _stream(_conversations())
    strategy = strategy_from_name("ddp") if world > 1 else None
    trainer = SFTTrainer(_model("llama", len(tokenizer)), _args(out / f"{kind}-{world}", max_steps=1000,
                                                                per_device_train_batch_size=RESUME_BATCH),
                         train_dataset=data, processing_class=tokenizer, callbacks=[StopAtEpochEnd],
                         strategy=strategy)
    recorder = trainer.data_collator = Recorder(trainer.data_collator)
    trainer.train(resume_from_checkpoint=str(out / kind / f"checkpoint-{steps}"))
    return [s for b in recorder.batches for s in split_sequences(b)]


def _worker(out: str, plan: dict) -> dict:
    # One process group per world size for every case: starting ranks costs more than these runs.
    out, results = Path(out), {}
    for case, call in plan.items():
        name, *args = call
        results[case] = {"window": _window, "first": _first_half, "resume": _resume}[name](*args[:1], out, *args[1:])
    return results


def _rows(kind: str) -> int:
    """Packed rows in the epoch (map-style) or in the stream, as the trainer builds them."""
    tokenizer = _tokenizer()
    tokenize = SFTTokenizer(tokenizer, max_length=MAX_LENGTH, assistant_only_loss=True)
    data = _conversations() if kind == "map" else _stream(_conversations())
    prepared = prepare_dataset(data if kind != "map" else datasets.Dataset.from_list(data), tokenize, True, MAX_LENGTH)
    return sum(1 for _ in prepared) if kind != "map" else len(prepared)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    # steps before the save: the 3-rank run then splits the rest evenly (no padding repeats to tell apart)
    steps = {kind: next(k for k in (2, 3, 4) if (_rows(kind) - 2 * RESUME_BATCH * k) % 3 == 0)
             for kind in ("map", "stream")}
    two = run_distributed(_worker, 2, args=(str(out), {
        "window-llama": ("window", "llama"), "window-hf": ("window", "hf"),
        "first-map": ("first", "map", steps["map"]), "first-stream": ("first", "stream", steps["stream"])}))
    resumed = {world: run_distributed(_worker, world, args=(str(out), {
        f"resume-{kind}": ("resume", kind, steps[kind], world) for kind in ("map", "stream")})) for world in (3, 1)}
    return two, resumed


def _reference(kind: str, batches: list) -> tuple[float, dict]:
    """The loss and gradients of all the micro-batches as one batch: summed token CE over all label tokens."""
    tokenizer = _tokenizer()
    model = _model(kind, len(tokenizer))
    if kind == "hf":
        from shardkit.sft.hf_attention import use_varlen_attention

        model.config.use_cache = False
        use_varlen_attention(model)
    total, items = 0.0, 0
    for batch in batches:
        features = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids")}
        out = model(**features)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        labels = batch["labels"]
        total = total + F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                                        reduction="sum")
        items += int((labels[:, 1:] != -100).sum())
    loss = total / items
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["llama", "hf"])
def test_two_ranks_times_four_micro_batches_equal_one_batch(runs, kind):
    results = [r[f"window-{kind}"] for r in runs[0]]
    batches = [b for r in results for b in r["batches"]]
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    assert len(batches) == 8 and len(set(counts)) > 4 and min(counts) < max(counts) / 2, counts  # ragged windows
    loss, grads = _reference(kind, batches)
    assert results[0]["loss"] == pytest.approx(loss, rel=1e-5)
    for r in results:  # DDP: every rank holds the averaged gradient
        assert r["grads"].keys() == grads.keys()
        for name, expected in grads.items():
            torch.testing.assert_close(r["grads"][name], expected, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", ["map", "stream"])
@pytest.mark.parametrize("world", [3, 1])
def test_resume_at_another_world_size_serves_every_sequence_once(runs, kind, world):
    two, resumed = runs
    tokenize = SFTTokenizer(_tokenizer(), max_length=MAX_LENGTH, assistant_only_loss=True)
    expected = Counter(tuple(tokenize(c)["input_ids"]) for c in _conversations())
    before = [s for r in two for s in r[f"first-{kind}"]]
    after = [s for r in resumed[world] for s in r[f"resume-{kind}"]]
    assert before and after
    assert Counter(before + after) == expected
