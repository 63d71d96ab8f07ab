"""push_to_hub=True uploads at each checkpoint save as transformers' hub_strategy says (issue 23), recorded by a fake
HfApi: nothing reaches the Hub. Only the checkpoint's Hugging Face files go up, never shardkit's resume state."""

from __future__ import annotations

import fnmatch
from concurrent.futures import Future
from pathlib import Path

import pytest
from trainer_tiny import Tokens, tiny_llama

from shardkit.hub import HubPusher
from shardkit.trainer import Trainer, TrainerCallback, TrainingArguments


class RecordingApi:
    """create_repo and upload_folder, recorded with the files each upload would send (as huggingface_hub filters)."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", {"repo_id": repo_id}))

    def upload_folder(self, folder_path, allow_patterns=None, ignore_patterns=None, **kwargs):
        root = Path(folder_path)
        files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
        if allow_patterns:
            files = [f for f in files if any(fnmatch.fnmatch(f, pat) for pat in allow_patterns)]
        files = [f for f in files if not any(fnmatch.fnmatch(f, pat) or fnmatch.fnmatch(f.split("/")[0], pat)
                                             for pat in ignore_patterns or [])]
        self.calls.append(("upload_folder", {"folder": root.name, "files": files, **kwargs}))
        done: Future = Future()
        done.set_result(f"commit {len(self.calls)}")
        return done

    def uploads(self) -> list[tuple[str | None, str, list[str]]]:
        return [(kw["path_in_repo"], kw["folder"], kw["files"]) for name, kw in self.calls if name == "upload_folder"]


def _tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(64)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")),
                                   unk_token="w0", pad_token="w1")


class Pushes(TrainerCallback):
    def __init__(self):
        self.steps: list[int] = []

    def on_push_begin(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


MODEL = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
CHECKPOINT = sorted([*MODEL, "trainer_state.json", "training_args.json"])


@pytest.mark.parametrize("strategy, extra", [("end", None), ("every_save", None), ("checkpoint", "last-checkpoint"),
                                             ("all_checkpoints", "checkpoint-{}")])
def test_each_hub_strategy_uploads_the_checkpoints_hf_files_at_each_save(tmp_path, monkeypatch, strategy, extra):
    api = RecordingApi()
    monkeypatch.setattr(HubPusher, "api", property(lambda self: api))
    pushes = Pushes()
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=4,
                             save_steps=2, push_to_hub=True, hub_model_id="me/run", hub_strategy=strategy,
                             disable_tqdm=True, report_to="none")
    trainer = Trainer(tiny_llama(), args, train_dataset=Tokens(8), processing_class=_tokenizer(), callbacks=[pushes])
    trainer.train()
    assert (tmp_path / "run" / "checkpoint-4" / "optimizer.safetensors").is_file()  # resume state stays local
    expected = []
    for step in (2, 4) if strategy != "end" else ():  # "end": nothing until push_to_hub()
        expected.append((None, "run", MODEL))  # output_dir holds the checkpoint's model files, not checkpoint-*
        if extra:
            expected.append((extra.format(step), f"checkpoint-{step}", CHECKPOINT))
    assert api.uploads() == expected and pushes.steps == ([2, 4] if expected else [])
    assert [kw["commit_message"] for name, kw in api.calls if name == "upload_folder"][:1] == (
        ["Training in progress, checkpoint-2"] if expected else [])
    final = f"commit {len(api.calls) + 1 + (strategy == 'end')}"  # "end" creates the repository here
    assert trainer.push_to_hub() == final and api.uploads()[-1][:2] == (None, "run")
    assert [name for name, _ in api.calls].count("create_repo") == 1
    assert all(kw["run_as_future"] and kw["repo_id"] == "me/run" for name, kw in api.calls if name == "upload_folder")
