"""push_to_hub / hub_strategy through huggingface_hub's upload API (issue 23), recorded by a fake HfApi: nothing
reaches the Hub. Uploads start in the background (run_as_future=True) as in transformers' Trainer."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardkit.trainer.hub_pusher import HubPusher


class RecordingApi:
    """The two HfApi calls the pusher makes; every upload returns a future the test completes (or leaves running)."""

    def __init__(self, finish: bool = True):
        self.calls: list[tuple[str, dict]] = []
        self.finish = finish

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
        return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"me/{repo_id}")

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))
        future: Future = Future()
        if self.finish:
            future.set_result(f"commit {len(self.calls)}")
        return future

    def uploads(self) -> list[dict]:
        return [kw for name, kw in self.calls if name == "upload_folder"]


def _args(tmp_path, **kwargs):
    return SimpleNamespace(output_dir=str(tmp_path / "llama-sft"), hub_model_id=None, hub_strategy="every_save",
                           hub_token="tok", hub_private_repo=True, hub_revision=None, hub_always_push=False,
                           **kwargs)


@pytest.mark.parametrize("strategy, extra", [
    ("every_save", None), ("checkpoint", "last-checkpoint"), ("all_checkpoints", "checkpoint-2"), ("end", "none"),
])
def test_each_hub_strategy_uploads_what_transformers_uploads(tmp_path, strategy, extra):
    api = RecordingApi()
    args = _args(tmp_path)
    args.hub_strategy = strategy
    pusher = HubPusher.from_args(args, api=api)
    pusher.push_save(args.output_dir, f"{args.output_dir}/checkpoint-2")
    uploads = api.uploads()
    if extra == "none":
        assert api.calls == []
    else:
        assert api.calls[0] == ("create_repo", {"repo_id": "llama-sft", "token": "tok", "private": True,
                                                "exist_ok": True})
        assert uploads[0]["folder_path"] == args.output_dir and uploads[0]["repo_id"] == "me/llama-sft"
        assert uploads[0]["ignore_patterns"] == ["_*", "checkpoint-*"] and uploads[0]["path_in_repo"] is None
        assert uploads[0]["allow_patterns"] == []  # the exact list of files to send: output_dir is empty
        assert [u["path_in_repo"] for u in uploads[1:]] == ([extra] if extra else [])
        assert all(u["run_as_future"] for u in uploads)  # in the background
    pusher.push_final(args.output_dir)
    assert api.uploads()[-1]["commit_message"] == "End of training"
    assert sum(1 for name, _ in api.calls if name == "create_repo") == 1


def test_a_save_while_an_upload_runs_is_skipped_unless_always_push_and_the_final_push_waits(tmp_path):
    api = RecordingApi(finish=False)
    pusher = HubPusher.from_args(_args(tmp_path), api=api)
    first = pusher.push_save(tmp_path, tmp_path / "checkpoint-1")
    assert pusher.push_save(tmp_path, tmp_path / "checkpoint-2") == [] and len(api.uploads()) == 1
    pusher.always_push = True
    third = pusher.push_save(tmp_path, tmp_path / "checkpoint-3")
    assert len(third) == 1
    api.finish = True
    done = threading.Timer(0.2, lambda: [f.set_result("ok") for f in (*first, *third)])
    done.start()
    assert pusher.push_final(tmp_path) == "commit 4"  # create, two uploads, then this one once they finished
    assert all(f.done() for f in (*first, *third))
    done.join()


def test_bad_settings_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"hub_strategy='every-save'.*every_save"):
        HubPusher("me/x", strategy="every-save", api=RecordingApi())
    with pytest.raises(ValueError, match="hub_model_id"):
        HubPusher("", api=RecordingApi())


def test_a_rotation_waits_for_the_upload_still_reading_the_folder_it_deletes(tmp_path):
    """The next save's rotation may delete a checkpoint whose background upload still reads it: wait_for_folder
    blocks until that upload is done, and returns at once for a folder no upload reads."""
    class SlowApi:
        def __init__(self):
            self.finished: list[str] = []

        def create_repo(self, repo_id, **kwargs):
            pass

        def upload_folder(self, folder_path, **kwargs):
            future: Future = Future()

            def later():
                time.sleep(0.5)
                self.finished.append(Path(folder_path).name)
                future.set_result("commit")
            threading.Thread(target=later, daemon=True).start()
            return future

    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-1" / "model.safetensors").write_bytes(b"0" * 8)
    api = SlowApi()
    pusher = HubPusher("me/run", strategy="checkpoint", api=api)
    pusher.push_save(tmp_path, tmp_path / "checkpoint-1", "Training in progress, step 1")
    pusher.wait_for_folder(tmp_path / "elsewhere")
    assert "checkpoint-1" not in api.finished
    pusher.wait_for_folder(tmp_path / "checkpoint-1")
    assert "checkpoint-1" in api.finished
    pusher.wait()


class HubLikeApi:
    """upload_folder as huggingface_hub 2.4 lists and reads a folder (its glob, its pattern filter, its default
    ignores): records each file's path in the repository and the bytes that would be sent."""

    def __init__(self):
        self.sent: dict[str, bytes] = {}

    def create_repo(self, repo_id, **kwargs):
        pass

    def upload_folder(self, folder_path, path_in_repo=None, allow_patterns=None, ignore_patterns=None, **kwargs):
        from huggingface_hub.utils import filter_repo_objects
        from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS

        root = Path(folder_path).resolve()
        listed = {p.relative_to(root).as_posix(): p for p in sorted(root.glob("**/*")) if p.is_file()}
        kept = filter_repo_objects(listed, allow_patterns=allow_patterns,
                                   ignore_patterns=[*(ignore_patterns or []), *DEFAULT_IGNORE_PATTERNS])
        prefix = f"{path_in_repo}/" if path_in_repo else ""
        self.sent.update({prefix + name: listed[name].read_bytes() for name in kept})
        future: Future = Future()
        future.set_result("commit")
        return future


def test_only_the_runs_own_files_leave_the_machine_and_the_list_is_logged(tmp_path, caplog):
    """Hidden files and folders, links leading out of the folder (their content would be sent) and links to folders
    stay; a link to a file inside is sent; the list sent and each file left out are logged."""
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0")
    run = tmp_path / "run"
    (run / ".ssh").mkdir(parents=True)
    (run / ".ssh" / "id_rsa").write_text("PRIVATE KEY")
    (run / ".env").write_text("HF_TOKEN=hf_secret")
    (run / "runs" / ".cache").mkdir(parents=True)
    (run / "runs" / ".cache" / "token").write_text("cached")
    (run / "runs" / "events.out").write_text("scalars")
    (run / "config.json").write_text("{}")
    (run / "model.safetensors").write_bytes(b"weights")
    (run / "_private.staging").write_text("staged")
    (run / "checkpoint-2").mkdir()
    (run / "checkpoint-2" / "model.safetensors").write_bytes(b"weights")
    (run / "passwd.txt").symlink_to(secret)  # a link leading out of the folder
    (run / "etc").symlink_to(tmp_path, target_is_directory=True)  # a link to a folder outside
    (run / "key.txt").symlink_to(run / ".env")  # a link to a hidden file inside
    (run / "weights-link.safetensors").symlink_to(run / "model.safetensors")  # a link inside: sent
    (run / "odd[1].json").write_text("[]")  # a name with a pattern character matches only itself
    api = HubLikeApi()
    pusher = HubPusher("me/run", strategy="checkpoint", api=api)
    with caplog.at_level(logging.INFO, logger="shardkit.trainer.hub_pusher"):
        pusher.push_save(run, run / "checkpoint-2")
        pusher.push_final(run)
    sent = {"config.json", "model.safetensors", "odd[1].json", "runs/events.out", "weights-link.safetensors"}
    assert set(api.sent) == sent | {"last-checkpoint/model.safetensors"}
    assert api.sent["weights-link.safetensors"] == b"weights"
    assert not any(b"secret" in v or b"root:" in v or b"PRIVATE" in v for v in api.sent.values())
    text = caplog.text
    assert "config.json, model.safetensors, odd[1].json, runs/events.out, weights-link.safetensors" in text
    for name in (".env (a hidden file)", ".ssh/ (a hidden folder)", "runs/.cache/ (a hidden folder)",
                 f"passwd.txt (a link to {secret.resolve()}, outside", "etc/ (a link to the folder",
                 "key.txt (a link to the hidden"):
        assert name in text, name


def test_push_final_honours_allow_and_ignore_patterns_but_never_sends_hidden_files(tmp_path):
    run = tmp_path / "run"
    (run / "runs").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "notes.txt", "runs/events.out", ".env"):
        (run / name).write_text(name)
    api = HubLikeApi()
    HubPusher("me/run", api=api).push_final(run, allow_patterns=["*.json", "*.safetensors", ".*"],
                                            ignore_patterns="config.*")
    assert set(api.sent) == {"model.safetensors"}
    api.sent.clear()
    HubPusher("me/run", api=api).push_final(run, ignore_patterns=["runs/"])
    assert set(api.sent) == {"config.json", "model.safetensors", "notes.txt"}
