"""push_to_hub / hub_strategy through huggingface_hub's upload API (issue 23), recorded by a fake HfApi: nothing
reaches the Hub. Uploads start in the background (run_as_future=True) as in transformers' Trainer."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardkit.hub import HubPusher


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
