"""GRPOTrainer and RLOOTrainer on 2 real processes (gloo on CPU), every case in one launch (the workers share the
process group, each case trains a fresh model):

- greedy rollouts under ZeRO-3, ZeROInfinity (parameters and optimizer state offloaded to the host), FSDP2 and
  TensorParallel:
  on the set-up model, before the first step, each rank generates through the rollout path for its own prompts and
  its own length (rank 0: 2 prompts x 3 tokens, rank 1: 3 prompts x 7 tokens; a TP group decodes both requests)
  without hanging, and every rank's tokens equal the unsharded model's greedy output in one process;
- GRPO under ZeRO-3 and FSDP2, rank 0 sampling at most 3 tokens per completion and rank 1 at most 6: the rewards of
  both ranks are gathered for the advantages, the loss is finite and equal on both ranks, the toy reward rises;
- GRPO under TensorParallel (one data-parallel rank: both ranks share the prompts): both ranks sample the same
  completions, and the logged loss, reward, reward_std and token count equal a hand computation from one rank's
  completions and rewards (counted once, not once per tp rank); GRPO under ZeROInfinity trains, with finite losses;
- RLOO (KL to a reference model set up like the policy) under TensorParallel and ZeROInfinity: finite, rank-equal
  losses and KL;
- ContextParallel is refused by name (rollouts cannot be split over its cp ranks);
- GRPO under DDP resumed from a background-saved checkpoint inside a generation round: each rank resumes with its own
  buffered round (a per-rank entry of the checkpoint), and the run logs and ends as the uninterrupted one;
- GRPO and RLOO under DDP with 2 completions per device and 4 per prompt (TRL's layout: a prompt's completions
  spread over both ranks; GRPO with 1 step per generation, every prompt split 2 + 2, RLOO with 3, the middle prompt of
  each round split): each rank's prompts are TRL's RepeatSampler's slice, and the advantages each rank trains on equal
  a hand computation from both ranks' gathered rewards; every rank holding the whole model, the rollouts' generation
  makes no collective call at all (the rewards' gather right after it does make some);
- GRPO evaluation under ZeRO-3, FSDP2 and TensorParallel in TRL's layout, with an uneven last step: 4 eval
  prompts, 2 completions each, 3 per rank and step (a step of 3 prompts, the middle one spread over both ranks, then
  a step of 1 prompt that rank 1 has no share of; under TP both ranks decode the same 6 rows, then 2), rank 0
  sampling at most 3 tokens, rank 1 at most 6 (ZeRO-3, FSDP2): nothing hangs, both ranks log the same figures (all
  named eval_*), each rank's eval prompts are its slice of TRL's eval sampler, every eval prompt is scored once,
  eval_reward and eval_loss equal a hand computation from every rank's rewards (the advantages of a spread group
  from both ranks; under TP counted once), and a direct evaluate() of the same weights repeats the one run at
  eval_steps."""

from __future__ import annotations

import contextlib
import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from harness import run_distributed  # noqa: E402

pytest.importorskip("deepspeed")
TEXT = Path(__file__).resolve().parents[2] / "examples" / "data" / "public_domain.txt"
PROMPTS = ("The old house", "She opened", "In the morning", "He asked the way")
# (trainer, strategy, steps): the reward must rise over the 10-step runs; the others check the bookkeeping
CASES = (("grpo", "zero3", 10), ("grpo", "fsdp", 10), ("grpo", "tp", 3), ("grpo", "zero_infinity", 2),
         ("rloo", "tp", 2), ("rloo", "zero_infinity", 2))
GREEDY = {0: (("The old house", "She opened"), 3), 1: (("In the morning", "He asked the way", "When the bell rang"), 7)}


SPREAD = dict(per_device_train_batch_size=2, num_generations=4, max_steps=2, seed=3)
SPREAD_STEPS = {"grpo": 1, "rloo": 3}  # steps_per_generation (from gradient_accumulation_steps)


def _worker(out: str) -> dict:
    results = {"cp": _refused_under_cp(out)}
    for strategy in EVAL_STRATEGIES:
        results[f"eval-{strategy}"] = _evaluate_uneven(str(Path(out) / f"eval-{strategy}"), strategy)
    for kind in ("grpo", "rloo"):
        results[f"spread-{kind}"] = _spread(str(Path(out) / f"spread-{kind}"), kind)
    results["resume-in-round"] = _resume_in_round(str(Path(out) / "resume"))
    for kind, strategy, steps in CASES:
        results[f"{kind}-{strategy}"] = _train(str(Path(out) / f"{kind}-{strategy}"), kind, strategy, steps)
    return results


def _tokenizer():
    from shardkit.sft import train_tokenizer

    return train_tokenizer([TEXT], vocab_size=300)


def _model(vocab: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128))


def _strategy(name: str, out: str):
    from shardkit.strategies import strategy_from_name
    from shardkit.strategies.zero import ZeROInfinity

    if name == "zero_infinity":  # offloaded to host memory: the NVMe swap (async_io) is test_zero.py's
        return ZeROInfinity(offload_params="cpu", offload_optimizer="cpu")
    return strategy_from_name(name)


def _refused_under_cp(out: str) -> str:
    from shardkit.rl import GRPOConfig, GRPOTrainer
    from shardkit.strategies import ContextParallel

    tokenizer = _tokenizer()
    args = GRPOConfig(output_dir=str(Path(out) / "cp"), max_steps=1, per_device_train_batch_size=4,
                      num_generations=4, report_to="none", use_cpu=True)
    try:
        GRPOTrainer(_model(len(tokenizer)), lambda completions, **kw: [0.0] * len(completions), args=args,
                    train_dataset=[{"prompt": p} for p in PROMPTS], processing_class=tokenizer,
                    strategy=ContextParallel(cp_size=2))
    except NotImplementedError as err:
        return str(err)
    return "not refused"


EVAL_PROMPTS = ("When the bell rang", "At night", "The river", "A small boat")
EVAL_STRATEGIES = ("zero3", "fsdp", "tp")


def _eval_layout(strategy: str) -> dict:
    """3 prompts a step, then 1: over 2 data-parallel ranks 3 rows each (the middle prompt spread), over TP's one
    data-parallel rank 6 rows."""
    return dict(num_generations_eval=2, per_device_eval_batch_size=6 if strategy == "tp" else 3)


def _evaluate_uneven(out: str, strategy: str) -> dict:
    from shardkit.rl import GRPOConfig, GRPOTrainer

    rank = int(os.environ["RANK"])
    tokenizer = _tokenizer()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    calls = []

    def in_target(prompts, completion_ids, **kwargs):
        rewards = [sum(100 <= t < 130 for t in c) / max(len(c), 1) for c in completion_ids]
        if prompts[0] in EVAL_PROMPTS:
            calls.append({"prompts": list(prompts), "ids": [list(c) for c in completion_ids], "rewards": rewards})
        return rewards

    # the ranks of a tensor-parallel group decode the same requests together: one length for both
    args = GRPOConfig(output_dir=out, max_steps=1, per_device_train_batch_size=8, num_generations=8,
                      **_eval_layout(strategy), max_completion_length=3 if rank == 0 and strategy != "tp" else 6,
                      eval_strategy="steps", eval_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
                      seed=0, use_cpu=True)
    trainer = GRPOTrainer(_model(len(tokenizer)), in_target, args=args,
                          train_dataset=[{"prompt": p} for p in PROMPTS] * 2,
                          eval_dataset=[{"prompt": p} for p in EVAL_PROMPTS], processing_class=tokenizer,
                          strategy=_strategy(strategy, out))
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "eval_reward" in h)
    direct = trainer.evaluate()
    keys = ("eval_reward", "eval_reward_std", "eval_loss", "eval_completions/max_length")
    return {"calls": calls, "logged": {k: logged[k] for k in keys}, "direct": {k: direct[k] for k in keys},
            "names": sorted(logged)}


def _greedy_reference(model, tokenizer, prompts, max_new: int) -> list[list[int]]:
    """The unsharded model's greedy completions in this process, cut after the first EOS as rollouts are."""
    from shardkit.rl.rollout import left_pad

    ids, mask = left_pad([tokenizer(text=p)["input_ids"] for p in prompts], tokenizer.pad_token_id, "cpu")
    model.eval()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, synced_gpus=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model.train()
    rows = []
    for row in out[:, ids.shape[1]:].tolist():
        end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        rows.append(row[:end])
    return rows


def _train(out: str, kind: str, strategy: str, steps: int) -> dict:
    from shardkit.rl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
    from shardkit.rl.rollout import generate_completions
    from shardkit.trainer import TrainerCallback

    rank = int(os.environ["RANK"])  # set by the launcher before the process group exists
    tokenizer = _tokenizer()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = _model(len(tokenizer))
    prompts, max_new = GREEDY[rank]
    result = {"reference": _greedy_reference(model, tokenizer, prompts, max_new), "rounds": []}

    class Greedy(TrainerCallback):
        """The rollout path on the set-up (sharded) model, greedy, before the first step changes the weights."""

        def on_train_begin(self, args, state, control, **kwargs):
            done = generate_completions(trainer.runner, trainer.model_wrapped,
                                        [tokenizer(text=p)["input_ids"] for p in prompts],
                                        pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id],
                                        max_new_tokens=max_new, sampling={"do_sample": False})
            result["greedy"] = done.ids

    def in_target(prompts, completion_ids, **kwargs):
        rewards = [sum(100 <= t < 130 for t in c) / max(len(c), 1) for c in completion_ids]
        prompt_tokens = sum(len(tokenizer(text=p)["input_ids"]) for p in prompts)
        result["rounds"].append({"ids": [list(c) for c in completion_ids], "rewards": rewards,
                                 "prompt_tokens": prompt_tokens})
        return rewards

    common = dict(output_dir=out, max_steps=steps, per_device_train_batch_size=8, num_generations=8,
                  learning_rate=5e-2, lr_scheduler_type="constant", logging_steps=1, report_to="none",
                  save_strategy="no", disable_tqdm=True, seed=0, use_cpu=True)
    if kind == "rloo":
        args = RLOOConfig(max_completion_length=5, **common)
        trainer_class = RLOOTrainer
    else:
        # TP: both ranks share the prompts, so they share the length too; dapo with unscaled advantages keeps the
        # hand computation in the test short
        length = 6 if strategy == "tp" else 3 if rank == 0 else 6
        extra = dict(loss_type="dapo", scale_rewards="none") if strategy == "tp" else dict(loss_type="grpo")
        args = GRPOConfig(max_completion_length=length, **extra, **common)
        trainer_class = GRPOTrainer
    trainer = trainer_class(model, in_target, args=args, train_dataset=[{"prompt": p} for p in PROMPTS] * 8,
                            processing_class=tokenizer, callbacks=[Greedy()], strategy=_strategy(strategy, out))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    keys = ("loss", "reward", "reward_std", "num_tokens", "completions/max_length", "kl")
    result["logs"] = [{k: h[k] for k in keys if k in h} for h in logged]
    return result


# torch.distributed's collectives and process-group calls, counted under both the package's names and the module's
# that defines them (code inside torch.distributed calls the latter)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all",
               "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "gather",
               "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list",
               "send", "recv", "isend", "irecv", "batch_isend_irecv", "new_group")


@contextlib.contextmanager
def _counting_collectives(counts: dict):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    saved = []
    for module in (dist, distributed_c10d):
        for name in COLLECTIVES:
            func = getattr(module, name, None)
            if func is None:
                continue

            def counted(*args, _func=func, _name=name, **kwargs):
                counts[_name] = counts.get(_name, 0) + 1
                return _func(*args, **kwargs)

            saved.append((module, name, func))
            setattr(module, name, counted)
    try:
        yield counts
    finally:
        for module, name, func in saved:
            setattr(module, name, func)


def _spread(out: str, kind: str) -> dict:
    """A prompt's 4 completions on 2 ranks, 2 per micro-batch: what each rank scored and trained on."""
    from shardkit.rl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    tokenizer = _tokenizer()
    result = {"rounds": [], "used": [], "generate_collectives": [], "score_collectives": []}

    def reward(prompts, completion_ids, **kwargs):
        rewards = [float(sum(c) % 7) + 0.5 * len(c) for c in completion_ids]
        result["rounds"].append({"prompts": list(prompts), "ids": [list(c) for c in completion_ids],
                                 "rewards": rewards})
        return rewards

    config, base = (RLOOConfig, RLOOTrainer) if kind == "rloo" else (GRPOConfig, GRPOTrainer)

    class Recording(base):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            mask = inputs["completion_mask"].bool()
            result["used"].append([(row[m].tolist(), float(a)) for row, m, a in
                                   zip(inputs["completion_ids"], mask, inputs["advantages"])])
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        def generate(self, prompt_ids):
            with _counting_collectives({}) as counts:
                done = super().generate(prompt_ids)
            result["generate_collectives"].append(counts)
            return done

        def score_completions(self, rows, prompt_ids, completions):  # the counter's control: the rewards' gather
            with _counting_collectives({}) as counts:
                scored = super().score_completions(rows, prompt_ids, completions)
            result["score_collectives"].append(counts)
            return scored

    extra = {"beta": 0.0} if kind == "rloo" else {"scale_rewards": "group"}
    args = config(output_dir=out, max_completion_length=4, learning_rate=1e-2, logging_steps=1, report_to="none",
                  save_strategy="no", disable_tqdm=True, use_cpu=True, gradient_accumulation_steps=SPREAD_STEPS[kind],
                  **SPREAD, **extra)
    trainer = Recording(_model(len(tokenizer)), reward, args=args, train_dataset=[{"prompt": p} for p in PROMPTS * 2],
                        processing_class=tokenizer, strategy=_strategy("ddp", out))
    trainer.train()
    result["generation_batch_size"] = trainer.args.generation_batch_size
    result["logs"] = [{k: h[k] for k in ("loss", "reward", "frac_reward_zero_std") if k in h}
                      for h in trainer.state.log_history if "loss" in h]
    return result


def _resume_in_round(out: str) -> dict:
    """GRPO under DDP, 2 completions per rank and micro-step, 2 micro-steps per round, one per optimizer step: the
    background-saved checkpoint-1 falls inside the first round. The uninterrupted 2 steps, then a resume from
    checkpoint-1."""
    import torch

    from shardkit.checkpoint import CheckpointReader, rank_entry
    from shardkit.rl import GRPOConfig, GRPOTrainer
    from shardkit.utils.seeding import seed_everything

    tokenizer = _tokenizer()

    def reward(completion_ids, **kwargs):
        return [float(sum(c) % 7) + 0.5 * len(c) for c in completion_ids]

    def run(name, resume):
        seed_everything(0)
        args = GRPOConfig(output_dir=str(Path(out) / name), max_steps=2, per_device_train_batch_size=2,
                          num_generations=4, steps_per_generation=2, max_completion_length=4, learning_rate=5e-2,
                          lr_scheduler_type="constant", logging_steps=2, save_strategy="steps", save_steps=1,
                          async_save=True, report_to="none", disable_tqdm=True, seed=0, use_cpu=True)
        trainer = GRPOTrainer(_model(len(tokenizer)), reward, args=args,
                              train_dataset=[{"prompt": p} for p in PROMPTS], processing_class=tokenizer,
                              strategy=_strategy("ddp", out))
        trainer.train(resume_from_checkpoint=resume)
        logs = [{k: h[k] for k in ("loss", "reward", "reward_std", "num_tokens")} for h in trainer.state.log_history
                if "loss" in h]
        return logs, [p.detach().clone() for p in trainer.model.parameters()]

    full, weights = run("full", None)
    checkpoint = Path(out) / "full" / "checkpoint-1"
    with CheckpointReader(checkpoint) as reader:
        rounds = [reader.read_state(rank_entry("rl_round", r))["round"] for r in range(2)]
    resumed, resumed_weights = run("resumed", str(checkpoint))
    return {"full": full, "resumed": resumed, "used": [r["used"] for r in rounds],
            "prompts": [[b["prompt_ids"].tolist() for b in r["batches"]] for r in rounds],
            "same_weights": all(torch.equal(a, b) for a, b in zip(weights, resumed_weights))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_worker, 2, args=(str(tmp_path_factory.mktemp("grpo")),), timeout=1800,
                           env={"DS_ACCELERATOR": "cpu"})


def _case(runs, name: str) -> list[dict]:
    return [rank[name] for rank in runs]


@pytest.mark.parametrize("name", sorted({f"{k}-{s}" for k, s, _ in CASES if k == "grpo"}))
def test_greedy_rollouts_equal_the_unsharded_model(runs, name):
    for rank, result in enumerate(_case(runs, name)):
        assert result["greedy"] == result["reference"], (rank, result["greedy"], result["reference"])
        assert [len(r) for r in result["greedy"]] == [len(r) for r in result["reference"]]
    ranks = _case(runs, name)
    assert len(ranks[0]["greedy"]) == 2 and len(ranks[1]["greedy"]) == 3  # uneven batches and lengths


@pytest.mark.parametrize("name", ["grpo-zero3", "grpo-fsdp"])
def test_two_ranks_different_lengths_reward_rises(runs, name):
    results = _case(runs, name)
    losses = [h["loss"] for h in results[0]["logs"]]
    assert len(losses) == 10 and all(math.isfinite(v) for v in losses), losses
    assert losses == [h["loss"] for h in results[1]["logs"]]
    rewards = [h["reward"] for h in results[0]["logs"]]
    assert rewards == [h["reward"] for h in results[1]["logs"]]  # every rank logs the whole generation batch's
    assert {max(len(c) for c in r["ids"]) for r in results[0]["rounds"]} == {3}
    assert {max(len(c) for c in r["ids"]) for r in results[1]["rounds"]} == {6}  # no EOS within 6 here
    assert all(h["completions/max_length"] == 6 for h in results[0]["logs"])  # the lengths gathered from both
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards


def test_tensor_parallel_counts_the_shared_batch_once(runs):
    """Both tp ranks hold one data-parallel batch: every logged figure is that batch's, computed by hand from the
    completions and rewards one rank saw (dapo, unscaled advantages, ratio 1 at generation)."""
    import torch

    results = _case(runs, "grpo-tp")
    assert results[0]["rounds"] == results[1]["rounds"]  # the same prompts and the same sampled completions
    assert results[0]["logs"] == results[1]["logs"]
    tokens = 0
    for log, rnd in zip(results[0]["logs"], results[0]["rounds"]):
        rewards = torch.tensor(rnd["rewards"], dtype=torch.float64)
        lengths = torch.tensor([len(c) for c in rnd["ids"]], dtype=torch.float64)
        advantages = rewards - rewards.mean()
        tokens += rnd["prompt_tokens"] + int(lengths.sum())
        assert log["loss"] == pytest.approx(float(-(advantages * lengths).sum() / lengths.sum()), abs=1e-5)
        assert log["reward"] == pytest.approx(float(rewards.mean()), abs=1e-6)
        assert log["reward_std"] == pytest.approx(float(rewards.std()), abs=1e-6)
        assert log["num_tokens"] == tokens
    assert len(results[0]["rounds"]) == 3


@pytest.mark.parametrize("name", ["grpo-zero_infinity", "rloo-tp", "rloo-zero_infinity"])
def test_trains_on_two_ranks(runs, name):
    results = _case(runs, name)
    for key in ("loss", "kl") if name.startswith("rloo") else ("loss",):
        values = [h[key] for h in results[0]["logs"]]
        assert len(values) == 2 and all(math.isfinite(v) for v in values), (key, values)
        assert values == [h[key] for h in results[1]["logs"]], key


def test_context_parallel_is_refused_by_name(runs):
    for message in (rank["cp"] for rank in runs):
        assert "ContextParallel (cp=2)" in message and "--strategy fsdp" in message, message


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_a_prompts_completions_spread_over_ranks(runs, kind):
    """per_device_train_batch_size=2, num_generations=4 on 2 ranks (a layout shardkit once refused): a round is
    2 x steps_per_generation / 2 prompts x 4 completions, 2 x steps_per_generation per rank, a prompt's group split
    2 + 2 over the ranks (GRPO: every prompt; RLOO, 3 steps per generation: the middle of 3). The prompts are TRL's
    RepeatSampler's, dealt in contiguous slices; the advantages each rank trains on are the hand-computed group
    advantages (GRPO: group mean and std; RLOO: leave-one-out) of both ranks' gathered rewards, its slice."""
    import torch

    trl_utils = pytest.importorskip("trl.trainer.utils")
    ranks, spg = _case(runs, f"spread-{kind}"), SPREAD_STEPS[kind]
    share, groups = 2 * spg, spg  # completions per rank, prompts per round
    assert all(r["generation_batch_size"] == 2 * share for r in ranks)
    rows = [{"prompt": p} for p in PROMPTS * 2]
    stream = list(trl_utils.RepeatSampler(rows, mini_repeat_count=4, batch_size=groups, repeat_count=spg,
                                          seed=SPREAD["seed"]))
    assert len(ranks[0]["rounds"]) == len(ranks[1]["rounds"]) == 2
    for k in range(2):
        first = k * 2 * share * spg  # TRL's stream holds each round spg times
        trl_round = [rows[i]["prompt"] for i in stream[first:first + 2 * share]]
        assert ranks[0]["rounds"][k]["prompts"] + ranks[1]["rounds"][k]["prompts"] == trl_round
        middle = 4 * (groups // 2)
        assert len(set(trl_round[middle:middle + 4])) == 1  # this group is spread over both ranks
        assert ranks[0]["rounds"][k]["prompts"][-1] == ranks[1]["rounds"][k]["prompts"][0]
        rewards = torch.tensor(ranks[0]["rounds"][k]["rewards"] + ranks[1]["rounds"][k]["rewards"],
                               dtype=torch.float64).view(groups, 4)
        if kind == "grpo":
            advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
        else:
            advantages = rewards - (rewards.sum(1, keepdim=True) - rewards) / 3
        advantages = advantages.flatten().tolist()
        for rank, result in enumerate(ranks):
            expected = sorted(zip(result["rounds"][k]["ids"], advantages[rank * share:(rank + 1) * share]))
            batches = result["used"][k * spg:(k + 1) * spg]
            used = sorted(pair for batch in batches for pair in batch)
            assert len(used) == share and all(len(batch) == 2 for batch in batches)
            assert [ids for ids, _ in used] == [ids for ids, _ in expected], (kind, k, rank)
            assert [a for _, a in used] == pytest.approx([a for _, a in expected], abs=1e-4), (kind, k, rank)
    losses = [h["loss"] for h in ranks[0]["logs"]]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert ranks[0]["logs"] == ranks[1]["logs"]
    gathered = [ranks[0]["rounds"][k]["rewards"] + ranks[1]["rounds"][k]["rewards"] for k in range(2)]
    assert [h["reward"] for h in ranks[0]["logs"]] == pytest.approx([sum(r) / len(r) for r in gathered], abs=1e-5)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_ddp_rollouts_generate_without_a_collective(runs, kind):
    """Every DDP rank holds the whole model, so its rollouts are its own: no entry barrier, no per-token flag, no
    waiting for the other rank (TRL's generation under DDP makes none either)."""
    for rank in _case(runs, f"spread-{kind}"):
        assert len(rank["generate_collectives"]) == len(rank["rounds"]) > 0
        assert rank["generate_collectives"] == [{}] * len(rank["rounds"])
        # the counter sees the trainer's collectives: scoring gathers the rewards of both ranks
        assert all(sum(counts.values()) > 0 for counts in rank["score_collectives"])


@pytest.mark.parametrize("strategy", EVAL_STRATEGIES)
def test_evaluation_spreads_groups_over_ranks_with_an_uneven_last_step(runs, strategy):
    """Two evaluations (at eval_steps=1, then evaluate()) of 2 steps each. Under ZeRO-3 and FSDP2 (2 data-parallel
    ranks), step 1: rows p0 p0 p1 | p1 p2 p2 (rank 0 | rank 1) of TRL's eval sampler's stream; step 2: p3 p3 |
    nothing (rank 1 generates for a filler that counts nowhere). Under TP (one data-parallel rank, both ranks decode
    the same rows): p0 p0 p1 p1 p2 p2, then p3 p3, on both ranks, counted once. Each eval prompt is scored once (twice
    over, num_generations_eval=2); eval_reward is the mean of the steps' mean rewards, eval_loss the per-completion
    mean of each data-parallel rank's dapo loss (ratio 1: -sum(A |o|) over its completions / (the step's tokens /
    the data-parallel ranks)), the advantages of each group from every rank's rewards."""
    import torch

    trl_utils = pytest.importorskip("trl.trainer.utils")
    results = _case(runs, f"eval-{strategy}")
    assert results[0]["logged"] == results[1]["logged"]
    assert results[0]["direct"] == results[0]["logged"]  # the same weights, the eval's own seeded stream
    assert [n for n in results[0]["names"] if not n.startswith("eval_")] == ["epoch", "step"]
    tp = strategy == "tp"
    assert [len(r["calls"]) for r in results] == ([4, 4] if tp else [4, 2])
    if tp:  # the tp peers sample the same completions (one random stream) and score them alike
        assert results[0]["calls"] == results[1]["calls"]
    rows = [{"prompt": p} for p in EVAL_PROMPTS]
    stream = [rows[i]["prompt"] for i in trl_utils.RepeatSampler(rows, mini_repeat_count=2, seed=0)]
    for evaluation in range(2):
        if tp:  # each step one data-parallel share: rank 0's calls
            first = [results[0]["calls"][2 * evaluation]]
        else:
            first = [results[0]["calls"][2 * evaluation], results[1]["calls"][evaluation]]
            assert first[0]["prompts"][-1] == first[1]["prompts"][0]  # this group is spread over both ranks
        last = results[0]["calls"][2 * evaluation + 1]
        assert [p for c in first for p in c["prompts"]] + last["prompts"] == stream
        loss, count, step_rewards, step_stds = 0.0, 0, [], []
        for step in (first, [last]):
            rewards = torch.tensor([r for c in step for r in c["rewards"]], dtype=torch.float64)
            lengths = [torch.tensor([len(i) for i in c["ids"]], dtype=torch.float64) for c in step]
            groups = rewards.view(-1, 2)
            advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)
            tokens, offset, ranks = float(sum(n.sum() for n in lengths)), 0, 1 if tp else 2
            for n in lengths:
                mine = advantages[offset:offset + len(n)]
                loss += float(-(mine * n).sum() / (tokens / ranks)) * len(n)
                count, offset = count + len(n), offset + len(n)
            step_rewards.append(float(rewards.mean()))
            step_stds.append(float(rewards.std()))  # each completion once: a tp peer's copy would change it
        assert count == 8
        assert results[0]["logged"]["eval_reward"] == pytest.approx(sum(step_rewards) / 2, abs=1e-6)
        assert results[0]["logged"]["eval_reward_std"] == pytest.approx(sum(step_stds) / 2, abs=1e-6)
        assert results[0]["logged"]["eval_loss"] == pytest.approx(loss / count, abs=1e-5)
    lengths = [[len(i) for c in r["calls"] for i in c["ids"]] for r in results]
    assert max(lengths[0]) <= (6 if tp else 3) and max(lengths[1]) == 6


def test_a_resume_inside_a_round_goes_on_with_each_ranks_round(runs):
    """Each rank's unfinished round is its own entry of the (background-saved) checkpoint, and each rank resumes with
    its own: the resumed run logs the uninterrupted run's loss, rewards and tokens, and ends with its weights."""
    for rank in _case(runs, "resume-in-round"):
        assert rank["used"] == [1, 1]
        assert rank["prompts"][0] != rank["prompts"][1]  # each rank's own round: its own prompts
        assert len(rank["full"]) == 1 and rank["resumed"] == rank["full"]
        assert rank["same_weights"]
