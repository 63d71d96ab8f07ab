"""push_to_hub=True uploads at each checkpoint save as transformers' hub_strategy says (issue 23), recorded by a fake
HfApi: nothing reaches the Hub. As transformers, "checkpoint" and "all_checkpoints" push the whole checkpoint folder,
and a run resumed from the pushed last-checkpoint continues with the uninterrupted run's losses."""

from __future__ import annotations

import fnmatch
import shutil
from concurrent.futures import Future
from pathlib import Path

import pytest
from trainer_tiny import Tokens, tiny_llama

from shardkit.trainer import Trainer, TrainerCallback, TrainingArguments
from shardkit.trainer.hub_pusher import HubPusher


class RecordingApi:
    """create_repo and upload_folder, recorded with the files each upload would send (as huggingface_hub filters);
    with ``store`` the files are also copied there, as the repository would hold them (a local fake Hub)."""

    def __init__(self, store: Path | None = None):
        self.calls: list[tuple[str, dict]] = []
        self.store = store

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
        for name in files if self.store is not None else ():
            target = self.store / (kwargs.get("path_in_repo") or "") / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / name, target)
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
    expected = []
    for step in (2, 4) if strategy != "end" else ():  # "end": nothing until push_to_hub()
        expected.append((None, "run", MODEL))  # output_dir holds the checkpoint's model files, not checkpoint-*
        if extra:  # the whole folder, resume state (optimizer, RNG, data position) included, as transformers
            folder = tmp_path / "run" / f"checkpoint-{step}"
            files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
            assert {"optimizer.safetensors", "trainer_state.json", "model.safetensors"} <= set(files), files
            expected.append((extra.format(step), f"checkpoint-{step}", files))
    assert api.uploads() == expected and pushes.steps == ([2, 4] if expected else [])
    messages = [kw["commit_message"] for name, kw in api.calls if name == "upload_folder"][:1 + bool(extra)]
    assert messages == (["Training in progress, step 2", "Training in progress, step 2, checkpoint"][:1 + bool(extra)]
                        if expected else [])
    final = f"commit {len(api.calls) + 1 + (strategy == 'end')}"  # "end" creates the repository here
    assert trainer.push_to_hub() == final and api.uploads()[-1][:2] == (None, "run")
    # As transformers, push_to_hub() writes the draft model card (create_model_card) and uploads it with the model.
    card = (tmp_path / "run" / "README.md").read_text()
    assert "README.md" in api.uploads()[-1][2] and "generated_from_trainer" in card and "# run" in card
    assert "- train_batch_size: 2" in card and "- training_steps: 4" in card
    assert [name for name, _ in api.calls].count("create_repo") == 1
    assert all(kw["run_as_future"] and kw["repo_id"] == "me/run" for name, kw in api.calls if name == "upload_folder")
    # The user's patterns choose among the run's files (huggingface_hub's allow/ignore); a dotfile never goes up.
    (tmp_path / "run" / ".env").write_text("HF_TOKEN=secret")
    trainer.push_to_hub(allow_patterns=["*.json", ".*"], ignore_patterns=["generation_*"])
    assert api.uploads()[-1][2] == ["config.json", "tokenizer.json", "tokenizer_config.json", "training_args.json"]


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == self.step


def _losses(trainer):
    return [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]


def test_a_run_resumed_from_the_pushed_last_checkpoint_continues_as_the_uninterrupted_one(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    monkeypatch.setattr(HubPusher, "api", property(lambda self, api=RecordingApi(hub): api))

    def run(out, **kw):
        args = TrainingArguments(output_dir=str(tmp_path / out), per_device_train_batch_size=2, max_steps=6,
                                 save_steps=3, logging_steps=1, learning_rate=1e-2, disable_tqdm=True,
                                 report_to="none", seed=0, optim="adamw_torch", **kw)
        return Trainer(tiny_llama(), args, train_dataset=Tokens(16), callbacks=[StopAt(3)] if kw else [])

    whole = run("whole")
    whole.train()
    stopped = run("stopped", push_to_hub=True, hub_model_id="me/run", hub_strategy="checkpoint")
    stopped.train()
    assert stopped.state.global_step == 3 and (hub / "last-checkpoint" / "trainer_state.json").is_file()
    shutil.rmtree(tmp_path / "stopped")  # the machine is gone: only the Hub holds the run
    resumed = run("resumed")
    resumed.train(resume_from_checkpoint=str(hub / "last-checkpoint"))
    assert _losses(resumed)[-3:] == _losses(whole)[-3:] and resumed.state.global_step == 6
