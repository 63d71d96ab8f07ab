"""The Trainer's Hugging Face files under sharding strategies, 2 CPU ranks: checkpoint-N and save_model() are
streamed from the shards into model.safetensors that from_pretrained loads, equal to the trained weights; under
ZeRO-3 trainer.deepspeed is the engine and get_num_trainable_parameters() counts whole parameters (issue 23 item 1)."""

from pathlib import Path

import pytest
from harness import run_distributed, transformers_without_zero3
from trainer_tiny import Tokens, tiny_llama

from shardkit.trainer import Trainer, TrainingArguments
from shardkit.trainer.export import full_state_dict


def _hf_files_worker(out: str, strategy_name: str):
    from transformers import LlamaForCausalLM

    from shardkit.strategies import strategy_from_name

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=2, save_steps=2,
                             optim="adamw_torch", disable_tqdm=True, report_to="none")
    trainer = Trainer(tiny_llama(), args, train_dataset=Tokens(length=8), strategy=strategy_from_name(strategy_name))
    trainer.train()
    trainer.save_model(f"{out}/export")
    engine = trainer.deepspeed
    if engine is not None:
        engine.save_checkpoint(f"{out}/ds")
    state = full_state_dict(trainer.runner, trainer.model_wrapped)
    if not trainer.runner.is_main_process:
        return None
    gaps = []
    with transformers_without_zero3():  # rank 0 alone reloads; the other rank takes no part in a partitioned load
        for folder in ("checkpoint-2", "export"):
            loaded = LlamaForCausalLM.from_pretrained(f"{out}/{folder}").state_dict()
            gaps.append(max(float((loaded[k] - v).abs().max()) for k, v in state.items()))
    return (gaps, engine is not None, sorted(p.name for p in Path(out, "checkpoint-2").iterdir()),
            trainer.get_num_trainable_parameters())


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_checkpoint_and_save_model_stream_hf_files(tmp_path, strategy):
    if strategy == "zero3":
        pytest.importorskip("deepspeed")
    run = run_distributed(_hf_files_worker, world_size=2, args=(str(tmp_path), strategy))
    gaps, has_engine, files, trainable = run[0]
    assert gaps == [0.0, 0.0]
    assert has_engine == (strategy == "zero3") and (not has_engine or (tmp_path / "ds" / "latest").is_file())
    assert {"config.json", "model.safetensors", "trainer_state.json", "shardkit.json"} <= set(files)
    assert trainable == sum(p.numel() for p in tiny_llama().parameters())  # whole sizes, not this rank's shards
