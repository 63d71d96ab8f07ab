"""SFTTrainer on one process: the seed's keyword spelling, errors that name the fix, a stream trained by steps
over several passes, and a plain iterable dataset resumed exactly by re-reading it."""

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from shardkit.data.streaming import rebuild_loader
from shardkit.models import Llama, LlamaConfig
from shardkit.sft import DataCollatorForLanguageModeling, SFTConfig, SFTTrainer, train_tokenizer
from shardkit.sft.chat import text_conversations
from shardkit.sft.collator import split_sequences
from shardkit.trainer import TrainingArguments

datasets = pytest.importorskip("datasets")

TEXT = Path(__file__).resolve().parents[2] / "examples" / "data" / "public_domain.txt"


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([TEXT], vocab_size=300)


def _llama(vocab, max_position=64):
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                             max_position=max_position, fused=False))


def _chats(n=12):
    return text_conversations(TEXT.read_text(), max_turns=1, system=None, split=r"(?<=[,;:.!?])\s+")[:n]


def test_the_seeds_keywords_on_training_arguments(tokenizer, tmp_path):
    texts = [{"content": tokenizer.apply_chat_template(c["messages"], tokenize=False)} for c in _chats()]
    args = TrainingArguments(str(tmp_path), max_steps=2, per_device_train_batch_size=2, report_to="none",
                             learning_rate=1e-3, save_strategy="no", disable_tqdm=True)
    trainer = SFTTrainer(model=_llama(len(tokenizer)), tokenizer=tokenizer, args=args, train_dataset=texts,
                         packing=True, dataset_kwargs={"append_concat_token": False, "add_special_tokens": False},
                         dataset_text_field="content", max_seq_length=64)
    assert isinstance(trainer.args, SFTConfig) and trainer.args.max_length == 64 and trainer.args.learning_rate == 1e-3
    assert trainer.args.padding_free and set(trainer.train_dataset.column_names) == {"input_ids", "labels",
                                                                                      "position_ids"}
    assert trainer.train().global_step == 2


def test_errors_name_the_fix(tokenizer, tmp_path):
    args = dict(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(ValueError, match="max_position=64"):
        SFTTrainer(_llama(len(tokenizer)), SFTConfig(**args, max_length=128), train_dataset=_chats(),
                   processing_class=tokenizer)
    with pytest.raises(ValueError, match="embeds 100"):
        SFTTrainer(_llama(100), SFTConfig(**args, max_length=64), train_dataset=_chats(), processing_class=tokenizer)
    with pytest.raises(ValueError, match="eos_token='<eot>' is not a token"):
        SFTTrainer(_llama(len(tokenizer)), SFTConfig(**args, max_length=64, eos_token="<eot>"),
                   train_dataset=_chats(), processing_class=tokenizer)
    with pytest.raises(TypeError, match="did you mean 'packing'"):
        SFTTrainer(_llama(len(tokenizer)), SFTConfig(**args, max_length=64), train_dataset=_chats(),
                   processing_class=tokenizer, packin=True)
    with pytest.raises(ValueError, match="streamed"):
        SFTTrainer(_llama(len(tokenizer)), SFTConfig(**args, max_length=64), train_dataset=_chats(),
                   eval_dataset=datasets.IterableDataset.from_generator(_gen), processing_class=tokenizer)


def _gen():
    yield from _chats(4)


def test_a_stream_trains_by_steps_over_several_passes(tokenizer, tmp_path):
    stream = datasets.IterableDataset.from_generator(_gen)
    trainer = SFTTrainer(_llama(len(tokenizer)), SFTConfig(str(tmp_path), max_length=64, packing=True, max_steps=7,
                                                           per_device_train_batch_size=2, report_to="none",
                                                           save_strategy="no", disable_tqdm=True, logging_steps=1),
                         train_dataset=stream, processing_class=tokenizer)
    rows = sum(1 for _ in trainer.train_dataset)
    assert 2 <= rows <= 4  # a pass takes 1 or 2 steps: 7 steps make several passes
    result = trainer.train()
    assert result.global_step == 7 and trainer.state.epoch >= 2
    with pytest.raises(ValueError, match="max_steps"):
        SFTTrainer(_llama(len(tokenizer)), SFTConfig(str(tmp_path), max_length=64, report_to="none"),
                   train_dataset=stream, processing_class=tokenizer).train()


class Rows(IterableDataset):
    """A plain torch IterableDataset (no state_dict): resumed by re-reading and skipping."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def test_a_plain_iterable_dataset_resumes_exactly_at_another_world_size():
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 50, (int(n),), generator=generator).tolist()}
            for n in torch.randint(2, 9, (29,), generator=generator)]
    collate = DataCollatorForLanguageModeling(0, padding_free=True)

    def loaders(world):
        return [rebuild_loader(DataLoader(Rows(rows), batch_size=2, collate_fn=collate), r, world, 0,
                                   torch.device("cpu")) for r in range(world)]

    first = loaders(2)
    iterators = [iter(loader) for loader in first]
    seen = [s for _ in range(3) for it in iterators for s in split_sequences(next(it))]
    states = [loader.state_dict() for loader in first]
    resumed = loaders(3)
    for rank, loader in enumerate(resumed):
        loader.load_state_dict(states[min(rank, 1)])
    rest = [s for loader in resumed for b in loader for s in split_sequences(b)]
    expected = Counter(tuple(r["input_ids"]) for r in rows)
    # 29 - 12 = 17 rows over 3 ranks: the last round of 2 is padded with one repeat of its own rows
    got = Counter(seen + rest)
    assert expected - got == Counter() and sum((got - expected).values()) == 1
