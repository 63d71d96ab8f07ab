"""SFT data: loss masks on a hand-checked conversation, the config's TRL names, datasets caching, and exact
mid-epoch resume of packed map-style and streamed data at another world size (ranks simulated in one process)."""

import copy
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from shardkit.data.streaming import ChunkedStream, rebuild_loader
from shardkit.sft import DataCollatorForLanguageModeling, SFTConfig, SFTTokenizer, prepare_dataset, train_tokenizer
from shardkit.sft.chat import text_conversations
from shardkit.sft.collator import split_sequences
from shardkit.sft.packing import IGNORE_INDEX

datasets = pytest.importorskip("datasets")

TEXT = Path(__file__).resolve().parents[2] / "examples" / "data" / "public_domain.txt"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who wrote it?"},
        {"role": "assistant", "content": "Lincoln."}, {"role": "user", "content": "When?"},
        {"role": "assistant", "content": "In 1863."}]
# The FSDP seed's ChatML rendering of CHAT (its DEFAULT_CHATML_CHAT_TEMPLATE), by hand.
CHATML = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho wrote it?<|im_end|>\n"
          "<|im_start|>assistant\nLincoln.<|im_end|>\n<|im_start|>user\nWhen?<|im_end|>\n"
          "<|im_start|>assistant\nIn 1863.<|im_end|>\n")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([TEXT], vocab_size=400)


def _trained_runs(tokenizer, ids, labels):
    """The decoded runs of consecutive trained (label != -100) tokens."""
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label == IGNORE_INDEX:
            if current:
                runs.append(current)
            current = []
        else:
            assert label == token
            current.append(token)
    return [tokenizer.decode(r) for r in runs + ([current] if current else [])]


def test_assistant_only_loss_on_a_hand_checked_conversation(tokenizer):
    full = SFTTokenizer(tokenizer)({"messages": CHAT})
    assert tokenizer.decode(full["input_ids"]) == CHATML and full["labels"] == full["input_ids"]
    masked = SFTTokenizer(tokenizer, assistant_only_loss=True)({"messages": CHAT})
    assert masked["input_ids"] == full["input_ids"]
    assert _trained_runs(tokenizer, masked["input_ids"], masked["labels"]) == ["Lincoln.<|im_end|>",
                                                                                "In 1863.<|im_end|>"]


def test_completion_only_loss_on_prompt_completion_data(tokenizer):
    text = SFTTokenizer(tokenizer)({"prompt": "Who wrote it?", "completion": " Lincoln."})
    assert tokenizer.decode(text["input_ids"]) == "Who wrote it? Lincoln.<|im_end|>"  # EOS appended
    assert _trained_runs(tokenizer, text["input_ids"], text["labels"]) == [" Lincoln.<|im_end|>"]
    whole = SFTTokenizer(tokenizer, completion_only_loss=False)({"prompt": "Who wrote it?", "completion": " Lincoln."})
    assert whole["labels"] == whole["input_ids"]
    chat = SFTTokenizer(tokenizer)({"prompt": CHAT[:2], "completion": CHAT[2:3]})
    assert _trained_runs(tokenizer, chat["input_ids"], chat["labels"]) == ["Lincoln.<|im_end|>\n"]
    ready = SFTTokenizer(tokenizer)({"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 1, 1]})
    assert ready == {"input_ids": [5, 6, 7, 8], "labels": [IGNORE_INDEX, IGNORE_INDEX, 7, 8]}


def test_text_options_and_truncation(tokenizer):
    plain = SFTTokenizer(tokenizer, text_field="content", append_eos=False, max_length=3)({"content": "Four score"})
    assert len(plain["input_ids"]) == 3 and tokenizer.eos_token_id not in plain["input_ids"]
    formatted = SFTTokenizer(tokenizer, formatting_func=lambda e: f"Q: {e['q']}")({"q": "why"})
    assert tokenizer.decode(formatted["input_ids"]) == "Q: why<|im_end|>"
    with pytest.raises(ValueError, match="set dataset_text_field"):
        SFTTokenizer(tokenizer)({"body": "x"})
    no_marks = train_tokenizer([TEXT], vocab_size=300, chat_template=None)
    no_marks.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="generation"):
        SFTTokenizer(no_marks, assistant_only_loss=True)({"messages": CHAT})


def test_sft_config_takes_trl_and_seed_names():
    config = SFTConfig(output_dir="o", max_seq_length=256, packing=True, dataset_kwargs={"append_concat_token": False,
                                                                                         "add_special_tokens": False})
    assert config.max_length == 256 and config.padding_free and not config.append_concat_token
    assert not SFTConfig(output_dir="o", packing=True, packing_strategy="wrapped").padding_free
    with pytest.raises(ValueError, match="did you mean 'bfd'"):
        SFTConfig(output_dir="o", packing_strategy="bdf")
    with pytest.raises(ValueError, match="did you mean 'append_concat_token'"):
        SFTConfig(output_dir="o", dataset_kwargs={"append_concat_tokens": True})
    with pytest.raises(TypeError, match="did you mean 'dataset_text_field'"):
        SFTConfig.from_training_arguments(SFTConfig(output_dir="o"), dataset_text_fields="content")


def test_map_tokenization_is_cached_on_disk(tokenizer, tmp_path):
    datasets.Dataset.from_list(text_conversations(TEXT.read_text())).save_to_disk(str(tmp_path / "raw"))
    raw = datasets.load_from_disk(str(tmp_path / "raw"))
    tokenize = SFTTokenizer(tokenizer, max_length=128, assistant_only_loss=True)
    first = prepare_dataset(raw, tokenize, packing=True, max_length=128, num_proc=2)
    files = [f["filename"] for f in first.cache_files]
    assert files and all(Path(f).is_relative_to(tmp_path) for f in files)
    stamps = {f: Path(f).stat().st_mtime_ns for f in files}
    again = prepare_dataset(datasets.load_from_disk(str(tmp_path / "raw")), tokenize, packing=True, max_length=128,
                            num_proc=2)
    assert [f["filename"] for f in again.cache_files] == files  # the same fingerprint: read back, not recomputed
    assert {f: Path(f).stat().st_mtime_ns for f in files} == stamps
    assert again["input_ids"] == first["input_ids"]


# ---- exact resume at another world size (ranks simulated: the loader's arithmetic is per rank) -----------------

def _loaders(make_loader, world):
    return [rebuild_loader(make_loader(), r, world, 7, torch.device("cpu")) for r in range(world)]


def _resume_run(make_loader, total_items, batch=2, opened=None):
    """Two ranks read a few batches each and save; 1 and 3 ranks resume from those states. Returns, per new world
    size, the sequences every run saw (and, with ``opened``, the shards the resumed run opened)."""
    steps = next(k for k in (3, 4, 5) if (total_items - 2 * batch * k) % 3 == 0)  # the 3-rank split is even
    first = _loaders(make_loader, 2)
    iterators = [iter(loader) for loader in first]
    seen = [s for _ in range(steps) for it in iterators for s in split_sequences(next(it))]
    states = [loader.state_dict() for loader in first]
    results = {}
    for world in (1, 3):
        if opened is not None:
            opened.clear()
        resumed = _loaders(make_loader, world)
        for rank, loader in enumerate(resumed):
            loader.load_state_dict(states[min(rank, 1)])  # a rank the old run lacked reads rank 0's file
        rest = [s for loader in resumed for b in loader for s in split_sequences(b)]
        results[world] = (seen + rest, list(opened or []))
    return results


def _expected(tokenize, conversations):
    return Counter(tuple(tokenize(c)["input_ids"]) for c in conversations)


def test_packed_map_dataset_resumes_each_sequence_once_at_another_world_size(tokenizer):
    conversations = text_conversations(TEXT.read_text())
    tokenize = SFTTokenizer(tokenizer, max_length=96, assistant_only_loss=True)
    packed = prepare_dataset(datasets.Dataset.from_list(conversations), tokenize, packing=True, max_length=96)
    collate = DataCollatorForLanguageModeling(tokenizer.pad_token_id, padding_free=True)
    runs = _resume_run(lambda: DataLoader(packed, batch_size=2, shuffle=True, collate_fn=collate), len(packed))
    for world, (sequences, _) in runs.items():
        assert Counter(sequences) == _expected(tokenize, conversations), world


OPENED: list[int] = []


def _shards(shards, conversations):
    for shard in shards:
        OPENED.append(shard)
        yield from conversations[shard * 5:(shard + 1) * 5]


def test_streamed_dataset_resumes_each_sequence_once_without_rereading_consumed_shards(tokenizer):
    conversations = text_conversations(TEXT.read_text())[:40]
    source = datasets.IterableDataset.from_generator(_shards, gen_kwargs={"shards": list(range(8)),
                                                                           "conversations": tuple(conversations)})
    tokenize = SFTTokenizer(tokenizer, max_length=96, assistant_only_loss=True)
    stream = prepare_dataset(source, tokenize, packing=True, max_length=96, buffer_size=5)
    assert isinstance(stream, ChunkedStream) and stream.seekable
    collate = DataCollatorForLanguageModeling(tokenizer.pad_token_id, padding_free=True)
    total = sum(1 for _ in stream)
    runs = _resume_run(lambda: DataLoader(stream, batch_size=2, collate_fn=collate), total, opened=OPENED)
    for world, (sequences, opened) in runs.items():
        assert Counter(sequences) == _expected(tokenize, conversations), world
        assert min(opened) >= 1, opened  # shard 0 was consumed before the save: not read again


def test_stream_loader_state_is_checked(tokenizer):
    stream = ChunkedStream(datasets.IterableDataset.from_generator(_shards, gen_kwargs={
        "shards": [0, 1], "conversations": tuple(text_conversations(TEXT.read_text()))}))
    loader = rebuild_loader(DataLoader(stream, batch_size=2, collate_fn=list), 0, 1, 7, torch.device("cpu"))
    with pytest.raises(TypeError, match="max_steps"):
        len(loader)
    good = loader.state_dict()
    bad_states = [({**good, "samples_seen": -1}, "integer >= 0"), ({**good, "seed": 8}, "seed 8"),
                  ({**good, "stream": {"state": {"examples_iterable": {"shard_idx": "x"}}, "index": 0}}, "keys"),
                  ({**good, "stream": {"state": {"examples_iterable": {"shard_idx": "1", "shard_example_idx": 0,
                                                                        "type": "ExamplesIterable"}, "epoch": 0},
                                       "index": 0}}, "integer >= 0"),
                  ({"epoch": 0}, "streamed loader")]
    for state, message in bad_states:
        with pytest.raises(ValueError, match=message):
            loader.load_state_dict(state)


class Numbers(torch.utils.data.IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


@pytest.mark.parametrize("seekable", [False, True])
def test_a_stream_shorter_than_the_saved_position_is_named_not_an_empty_epoch(seekable):
    def loader(n, world=1, rank=0):
        source = (datasets.IterableDataset.from_generator(_numbers, gen_kwargs={"n": n}) if seekable
                  else Numbers(n))
        stream = ChunkedStream(source, chunk_size=3)
        return rebuild_loader(DataLoader(stream, batch_size=2, collate_fn=list), rank, world, 7, torch.device("cpu"))

    first = [loader(20, 2, r) for r in range(2)]
    iterators = [iter(x) for x in first]
    for _ in range(3):
        [next(it) for it in iterators]
    state = first[0].state_dict()  # 12 items consumed by the two ranks
    exact = loader(12)  # the source ends where the checkpoint stopped: the rest of the epoch is empty, no error
    exact.load_state_dict(state)
    assert list(exact) == []
    rest = loader(20)
    rest.load_state_dict(state)
    assert [x["x"] if seekable else x for b in rest for x in b] == list(range(12, 20))
    for n, words in [(10, "ended after 10 items"), (7, "has no item from 9 on")]:  # item 11's chunk starts at 9
        shorter = loader(n)
        shorter.load_state_dict(state)
        with pytest.raises(ValueError, match=rf"item 12 .*{words}: the data changed since the checkpoint"):
            list(shorter)


def _numbers(n):
    for i in range(n):
        yield {"x": i}


# ---- hostile input: a chat template without end, rows that are not conversations --------------------------------

def _with_template(tokenizer, template):
    hostile = copy.deepcopy(tokenizer)
    hostile.chat_template = template
    return SFTTokenizer(hostile)


def test_a_hostile_chat_template_is_stopped_in_time_and_in_output(tokenizer):
    tracer = sys.gettrace()
    # Twenty million empty loop steps (seconds when unbounded; without end with larger ranges): stopped at the limit.
    spin = _with_template(tokenizer, "{% for i in range(100000) %}{% for j in range(200) %}{% endfor %}{% endfor %}")
    spin.render_seconds = 0.2
    with pytest.raises(ValueError, match=r"example 7: the chat template ran over 0.2 s"):
        spin({"messages": CHAT}, 7)
    # Output built piece by piece past the cap (400k characters here; gigabytes with larger ranges).
    flood = _with_template(tokenizer, "{% for i in range(200) %}{% for j in range(200) %}{{ 'xxxxxxxxxx' }}"
                                      "{% endfor %}{% endfor %}")
    flood.max_render_chars = 10_000
    with pytest.raises(ValueError, match=r"example 3: the chat template produced more than 10000 characters"):
        flood({"messages": CHAT}, 3)
    assert sys.gettrace() is tracer  # a debugger's or coverage's trace function is given back
    assert tokenizer.decode(SFTTokenizer(tokenizer)({"messages": CHAT})["input_ids"]) == CHATML


def test_rows_that_are_not_conversations_are_named_with_their_field_and_fix(tokenizer):
    tokenize = SFTTokenizer(tokenizer)
    no_role = [{"messages": CHAT}, {"messages": [{"content": "Who wrote it?"}]}]
    number = [{"messages": CHAT}, {"messages": CHAT}, {"messages": [{"role": "user", "content": 1863}]}]
    # Through datasets.Dataset.map (the row index is the dataset's) and through a list (checked before Arrow).
    with pytest.raises(ValueError, match=r"example 1: messages\[0\] has no 'role': give every message a 'role'"):
        prepare_dataset(datasets.Dataset.from_list(no_role), tokenize, packing=False, max_length=None)
    with pytest.raises(ValueError, match=r"example 2: messages\[0\]\['content'\] is int \(1863\): content must be "
                                         r"text .* convert it with str\(\)"):
        prepare_dataset(number, tokenize, packing=False, max_length=None)
    with pytest.raises(ValueError, match=r"example 1 field 'text' holds number where example 0 holds str"):
        prepare_dataset([{"text": "Who wrote it?"}, {"text": 1863}], tokenize, packing=False, max_length=None)
    stream = prepare_dataset(iter(no_role), tokenize, packing=False, max_length=None)
    with pytest.raises(ValueError, match=r"a streamed example \(\{'messages': \[\{'content': 'Who wrote it\?'\}\]\}\)"
                                         r": messages\[0\] has no 'role'"):
        list(stream)
    broken = _with_template(tokenizer, "{% for m in messages %}{{ m.content }")
    with pytest.raises(ValueError, match=r"does not parse \(template line 1: .*\): fix tokenizer.chat_template") as err:
        prepare_dataset(datasets.Dataset.from_list(number[:1]), broken, packing=False, max_length=None)
    assert type(err.value).__name__ == "ChatTemplateError"  # the template's fault: no example is named


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_rank_gets_as_many_stream_items(drop_last):
    # 5 items on 2 ranks: padded to 3 each, or (drop_last) the short last round dropped on both: never 3 and 2,
    # which would leave one rank stepping alone.
    from shardkit.data.streaming import ChunkedStream, _RankView

    views = [_RankView(ChunkedStream(list(range(5))), rank, 2, drop_last) for rank in range(2)]
    items = [[item for item, _ in view] for view in views]
    assert items == ([[0, 2], [1, 3]] if drop_last else [[0, 2, 4], [1, 3, 4]])
