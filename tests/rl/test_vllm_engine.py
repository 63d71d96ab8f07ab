"""use_vllm=True's colocated engine (shardkit.rl.vllm_engine) against a STAND-IN for vLLM, not vLLM itself, which
cannot share the main test environment (it pins its own transformers; test_vllm_real.py runs the real one in its own
environment): a module injected as ``vllm`` that implements only the surface the engine calls, as vLLM 0.32 has it
(``LLM(...)`` with ``load_format="dummy"``, ``LLM.collective_rpc("reload_weights", kwargs=...)`` on the in-process
worker, ``reset_prefix_cache``, ``generate`` on token-id prompts, ``SamplingParams``) around a Hugging Face Llama
built from the configuration the engine wrote. It checks the engine's own logic: every policy weight reaches the
engine under Hugging Face's name (shardkit's Llama and a Hugging Face model), so that the engine's greedy tokens
equal the policy's own; the sampling settings map to TRL's ``SamplingParams``; weights are pushed once per optimizer
step; completions come back in the trainer's format (EOS kept, truncation flagged); training runs through it;
unsupported settings are refused."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.rl.conftest import tiny_llama
from tests.rl.test_shardkit_llama_policy import shardkit_copy


class _Output:
    def __init__(self, token_ids, finish_reason, stop_reason, logprobs=None):
        self.token_ids, self.finish_reason, self.stop_reason = token_ids, finish_reason, stop_reason
        self.logprobs = logprobs  # vLLM's: one {token id: Logprob} per generated token, with logprobs=0 the sampled


class _RequestOutput:
    def __init__(self, prompt_token_ids, output):
        self.prompt_token_ids, self.outputs = prompt_token_ids, [output]


class _StandInModel:
    """vLLM's model as the engine sees it: ``load_weights`` of (Hugging Face name, tensor) pairs."""

    def __init__(self, hf_model):
        self.hf = hf_model
        self.loaded: dict[str, torch.Tensor] = {}
        self.calls = 0

    def load_weights(self, weights):
        params = dict(self.hf.named_parameters())
        for name, tensor in weights:
            assert name in params, f"vLLM's Llama has no parameter {name!r}"
            assert isinstance(tensor, torch.Tensor) and type(tensor) is torch.Tensor or \
                type(tensor) is torch.nn.Parameter, type(tensor)
            with torch.no_grad():
                params[name].copy_(tensor)
            self.loaded[name] = tensor.detach().clone()
            self.calls += 1


def _stand_in_vllm():
    from transformers import LlamaConfig, LlamaForCausalLM

    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    module.__version__ = "stand-in"
    module.instances = []
    module.greedy = False
    # added to the log-prob the stand-in reports for a generated token: a real engine's numerics differ from the
    # training model's, so the correction has something to correct
    module.logprob_shift = lambda token: 0.0

    class SamplingParams:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    class LLM:
        def __init__(self, model, **kwargs):
            config = json.loads((Path(model) / "config.json").read_text())
            assert kwargs["load_format"] == "dummy" and kwargs["skip_tokenizer_init"]
            self.kwargs, self.config = kwargs, config
            torch.manual_seed(1234)  # dummy weights: anything but the policy's
            hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})).eval()
            self.model = _StandInModel(hf)
            runner = types.SimpleNamespace(model=self.model)
            self.reloads = 0

            def reload_weights(weights_iterator=None, weights_path=None, is_checkpoint_format=True):
                # vLLM 0.32's worker method: the checkpoint-format tensors through the model's load_weights
                assert is_checkpoint_format and weights_path is None
                self.reloads += 1
                self.model.load_weights(weights_iterator)

            worker = types.SimpleNamespace(model_runner=runner, reload_weights=reload_weights)
            self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(driver_worker=worker))
            self.resets = 0
            self.requests = []
            module.instances.append(self)

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            # in process (external launcher): the one worker's method, its result in a list
            worker = self.llm_engine.model_executor.driver_worker
            return [getattr(worker, method)(*args, **(kwargs or {}))]

        def reset_prefix_cache(self):
            self.resets += 1

        def generate(self, prompts, sampling_params, use_tqdm=True):
            # greedy with module.greedy (to check the weights), else sampled at the temperature (no other filter),
            # stopping on the stop ids, which vLLM keeps in the output
            kw = sampling_params.kwargs
            self.requests.append((prompts, kw))
            gen = torch.Generator().manual_seed(self.kwargs["seed"] + len(self.requests))
            out = []
            for prompt in prompts:
                ids = torch.tensor([prompt["prompt_token_ids"]])
                new, logprobs = [], []
                with torch.no_grad():
                    for _ in range(kw["max_tokens"]):
                        logits = self.model.hf(torch.cat([ids, torch.tensor([new], dtype=torch.long)], 1)
                                               if new else ids).logits[0, -1]
                        token = int(logits.argmax()) if module.greedy else \
                            int(torch.multinomial((logits / kw["temperature"]).softmax(-1), 1, generator=gen))
                        new.append(token)
                        # processed log-probs: after the temperature, as the engine was asked to report them
                        lp = float((logits / kw["temperature"]).log_softmax(-1)[token])
                        lp += module.logprob_shift(token)
                        logprobs.append({token: types.SimpleNamespace(logprob=lp, rank=1)})
                        if token in kw["stop_token_ids"]:
                            break
                stopped = new[-1] in kw["stop_token_ids"]
                out.append(_RequestOutput(prompt["prompt_token_ids"],
                                          _Output(new, "stop" if stopped else "length", new[-1] if stopped else None,
                                                  logprobs if kw.get("logprobs") == 0 else None)))
            return out

    module.LLM, module.SamplingParams = LLM, SamplingParams
    return module


@pytest.fixture
def vllm(monkeypatch):
    module = _stand_in_vllm()
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


def _trainer(model, tokenizer, tmp_path, reward=None, **kw):
    from shardkit.rl import GRPOConfig, GRPOTrainer

    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=5,
                report_to="none", use_cpu=True, use_vllm=True, vllm_importance_sampling_correction=False,
                vllm_gpu_memory_utilization=0.25, temperature=0.9, top_p=0.8, top_k=7, save_strategy="no",
                disable_tqdm=True, learning_rate=1e-2, logging_steps=1)
    args = GRPOConfig(**{**base, **kw})
    prompts = [{"prompt": p} for p in ("The old house", "She opened")] * 4
    reward = reward or (lambda completion_ids, **k: [float(c[0] % 3) for c in completion_ids])
    return GRPOTrainer(model, reward, args=args,
                       train_dataset=prompts, processing_class=tokenizer)


def _own_greedy(model, prompt_ids, new, eos):
    """The policy's own greedy completion of one prompt, cut after its first EOS."""
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=new, synced=False) \
        if not hasattr(model, "config") or not hasattr(model.config, "model_type") else \
        model.generate(torch.tensor([prompt_ids]), max_new_tokens=new, do_sample=False, eos_token_id=None)
    row = out[0, len(prompt_ids):].tolist()
    end = next((i for i, t in enumerate(row) if t in eos), None)
    return (row, True) if end is None else (row[:end + 1], False)


@pytest.mark.parametrize("kind", ["shardkit", "hf"])
def test_weights_reach_the_engine_and_its_tokens_are_the_policys(vllm, tokenizer, tmp_path, kind):
    from shardkit.rl.rollout import tokenize_prompts

    vllm.greedy = True
    hf = tiny_llama(len(tokenizer))
    policy = shardkit_copy(hf) if kind == "shardkit" else hf
    reference = {k: v.clone() for k, v in policy.state_dict().items()}
    trainer = _trainer(policy, tokenizer, tmp_path)
    (llm,) = vllm.instances
    assert llm.kwargs["gpu_memory_utilization"] == 0.25 and llm.kwargs["tensor_parallel_size"] == 1
    assert llm.kwargs["distributed_executor_backend"] == "external_launcher" and llm.kwargs["dtype"] == "float32"
    prompt_ids = tokenize_prompts(tokenizer, ["The old house", "She opened the letter", "In"])
    eos = trainer.eos_token_ids
    completions = trainer.generate(prompt_ids)
    # every weight pushed whole, under Hugging Face's names, once (the tied embedding once)
    hf_names = {n for n, _ in llm.model.hf.named_parameters()}
    assert set(llm.model.loaded) == hf_names and llm.model.calls == len(hf_names) and llm.resets == 1
    assert llm.reloads == 1  # one reload_weights call carries every tensor
    for name, tensor in llm.model.loaded.items():
        ours = name if kind == "hf" else name.removeprefix("model.")
        torch.testing.assert_close(tensor, reference[ours], rtol=0, atol=0, msg=name)
    # so the engine's greedy tokens are the policy's own, in the trainer's format
    for ids, row, cut in zip(prompt_ids, completions.ids, completions.truncated):
        assert (row, cut) == _own_greedy(trainer.model, ids, 5, eos)
    prompts, kw = llm.requests[-1]
    assert [p["prompt_token_ids"] for p in prompts] == prompt_ids
    assert kw == {"n": 1, "temperature": 0.9, "top_p": 0.8, "top_k": 7, "min_p": 0.0, "repetition_penalty": 1.0,
                  "max_tokens": 5, "stop_token_ids": eos, "detokenize": False}
    # the same optimizer step pushes nothing more
    trainer.generate(prompt_ids)
    assert llm.model.calls == len(hf_names) and llm.resets == 1


def test_training_pushes_each_steps_weights(vllm, tokenizer, tmp_path):
    hf = tiny_llama(len(tokenizer))
    trainer = _trainer(shardkit_copy(hf), tokenizer, tmp_path, max_steps=2)
    (llm,) = vllm.instances
    trainer.train()
    names = len(list(llm.model.hf.parameters()))
    assert len(llm.requests) == 2 and llm.model.calls == 2 * names and llm.resets == 2
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(h["grad_norm"] > 0 for h in logs)  # the sampled completions taught something
    # the second push carried the weights after the first step: neither the initial nor the final ones
    name = "layers.0.self_attn.q_proj.weight"
    pushed_second = llm.model.loaded["model." + name]
    assert not torch.equal(pushed_second, hf.state_dict()["model." + name])
    assert not torch.equal(pushed_second, trainer.model.state_dict()[name])


def test_completion_format_and_refusals(vllm, tokenizer, tmp_path):
    from shardkit.rl import GRPOConfig
    from shardkit.rl.vllm_engine import vllm_completion, vllm_sampled_logprobs

    eos = [2, 3]
    assert vllm_completion(_Output([5, 3, 9], "stop", 3), eos, 4) == ([5, 3], False)
    assert vllm_completion(_Output([5, 6, 7, 8], "length", None), eos, 4) == ([5, 6, 7, 8], True)
    # a stop token the output leaves out is put back (the trainer's completions end with their EOS)
    assert vllm_completion(_Output([5, 6], "stop", 3), eos, 4) == ([5, 6, 3], False)
    # the engine's log-prob of each kept token; none for the EOS put back (weight 1), a loud error for none at all
    steps = [{5: types.SimpleNamespace(logprob=-0.5)}, {6: types.SimpleNamespace(logprob=-1.5)}]
    got = vllm_sampled_logprobs(_Output([5, 6], "stop", 3, steps), [5, 6, 3])
    assert got[:2] == [-0.5, -1.5] and got[2] != got[2]
    with pytest.raises(RuntimeError, match="no log-probs"):
        vllm_sampled_logprobs(_Output([5, 6], "stop", 3), [5, 6, 3])
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode='token'"):
        GRPOConfig(output_dir=str(tmp_path), report_to="none", vllm_importance_sampling_mode="token")
    with pytest.raises(ValueError, match="clip_min"):
        GRPOConfig(output_dir=str(tmp_path), report_to="none", vllm_importance_sampling_mode="token_truncate",
                   vllm_importance_sampling_clip_max=None)
    with pytest.raises(ValueError, match="must be less than"):
        GRPOConfig(output_dir=str(tmp_path), report_to="none", vllm_importance_sampling_clip_min=3.0)
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode='sequence_mask' must be 'token_truncate'"):
        GRPOConfig(output_dir=str(tmp_path), report_to="none", use_vllm=True, loss_type="vespo")  # as TRL refuses
    assert GRPOConfig(output_dir=str(tmp_path), report_to="none", use_vllm=True, loss_type="vespo",
                      vllm_importance_sampling_mode="token_mask").loss_type == "vespo"
    assert GRPOConfig(output_dir=str(tmp_path), report_to="none",
                      vllm_importance_sampling_cap=2.0).vllm_importance_sampling_clip_max == 2.0  # TRL's old name
    with pytest.raises(NotImplementedError, match="vllm_enable_sleep_mode"):
        GRPOConfig(output_dir=str(tmp_path), report_to="none", use_vllm=True, vllm_enable_sleep_mode=True)
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size=2"):
        _trainer(tiny_llama(len(tokenizer)), tokenizer, tmp_path, vllm_tensor_parallel_size=2)


def test_the_engine_ends_completions_only_where_it_stopped(vllm, tokenizer, tmp_path):
    """No token the engine did not sample is added, and a shardkit Llama's configuration gives vLLM no EOS of its own
    (transformers' LlamaConfig defaults to eos_token_id=2, an ordinary token of a shardkit vocabulary)."""
    from shardkit.rl.vllm_engine import vllm_completion

    eos = [2, 3]
    assert vllm_completion(_Output([5, 6], "stop", None), eos, 4) == ([5, 6], False)  # the model's own stop id
    assert vllm_completion(_Output([5, 6], "stop", "\n\n"), eos, 4) == ([5, 6], False)  # a stop string
    assert vllm_completion(_Output([5, 6], "stop", 7), eos, 4) == ([5, 6], False)  # a stop id of generation_kwargs
    assert vllm_completion(_Output([5, 6, 7, 8], "stop", 3), eos, 4) == ([5, 6, 7, 8], False)  # no room left
    _trainer(shardkit_copy(tiny_llama(len(tokenizer))), tokenizer, tmp_path)
    (llm,) = vllm.instances
    assert llm.config["eos_token_id"] is None and llm.config["bos_token_id"] is None


def test_a_second_train_call_pushes_the_trained_weights(vllm, tokenizer, tmp_path):
    """The optimizer step names the pushed weights only within one train() call: a second call starts again at step
    0 with the weights the first one trained, which must reach the engine."""
    trainer = _trainer(shardkit_copy(tiny_llama(len(tokenizer))), tokenizer, tmp_path, max_steps=1)
    (llm,) = vllm.instances
    trainer.train()
    names = len(list(llm.model.hf.parameters()))
    assert llm.model.calls == names
    name = "layers.0.self_attn.q_proj.weight"
    trained = trainer.model.state_dict()[name].clone()
    trainer.train()
    assert llm.model.calls == 2 * names
    torch.testing.assert_close(llm.model.loaded["model." + name], trained, rtol=0, atol=0)


def _trl_vllm_is(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's correction (GRPOTrainer._generate_and_score_completions), written out: it is inline there."""
    import math

    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = clip_min if clip_min is not None else -math.inf
    hi = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > hi), value=0.0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.8, 1.25), (0.9, None)])
def test_correction_weights_equal_trls(mode, bounds):
    from shardkit.rl.vllm_correction import vllm_importance_weights

    gen = torch.Generator().manual_seed(7)
    old = -torch.rand(5, 6, generator=gen) * 3
    sampling = old + torch.randn(5, 6, generator=gen) * 0.3
    sampling[1, 2] = float("nan")  # a token vLLM gave no log-prob for
    mask = (torch.rand(5, 6, generator=gen) > 0.2).float()
    mask[4] = 0.0  # an empty completion
    ours = vllm_importance_weights(old, sampling, mask, mode, *bounds)
    expected = _trl_vllm_is(old, sampling, mask, mode, *bounds)
    assert ours.shape == ((5, 1) if mode.startswith("sequence") else (5, 6))
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    if bounds == (0.8, 1.25):  # the bounds did something: some ratios clipped or masked
        raw = _trl_vllm_is(old, sampling, mask, mode.split("_")[0] + "_truncate", None, float("inf"))
        assert bool(((raw < 0.8) | (raw > 1.25)).any())


@pytest.mark.parametrize("loss_type", ["vespo", "dapo"])
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
def test_policy_loss_with_the_correction_equals_trls(loss_type, mode):
    """On fixed random inputs (a later iteration: ratios off 1, positive and negative advantages, a KL term):
    VESPO's sequence weight takes vLLM's token weights in (TRL's get_gamma_weights, called itself), and the other
    loss types multiply the policy term, not the KL term, by them (TRL's _compute_loss, written out)."""
    trl = pytest.importorskip("trl")
    from shardkit.rl.losses import PolicyLossSettings, policy_loss
    from shardkit.rl.vllm_correction import vllm_importance_weights

    gen = torch.Generator().manual_seed(11)
    old = -torch.rand(6, 5, generator=gen) * 2
    logps = old + torch.randn(6, 5, generator=gen) * 0.2
    ref = old + torch.randn(6, 5, generator=gen) * 0.1
    sampling = old + torch.randn(6, 5, generator=gen) * 0.3
    mask = (torch.rand(6, 5, generator=gen) > 0.2).float()
    advantages = torch.randn(6, generator=gen)
    weights = vllm_importance_weights(old, sampling, mask, mode, 0.8, 1.25)
    assert bool((weights[mask.bool()] != 1).any())
    beta = 0.04
    settings = PolicyLossSettings(loss_type=loss_type, beta=beta, epsilon_low=0.2, epsilon_high=0.28)
    ours = policy_loss(logps, old, advantages, mask, settings, ref, weights)
    a = advantages.unsqueeze(1)
    ratio = torch.exp(logps - old)
    kl = (torch.exp(ref - logps) - (ref - logps) - 1) * ratio
    if loss_type == "vespo":
        phi = trl.GRPOTrainer.get_gamma_weights(a, logps - old, mask, weights, k_pos=2.0, lambda_pos=3.0,
                                                k_neg=3.0, lambda_neg=2.0)
        torch.testing.assert_close(ours.phi, phi, rtol=1e-6, atol=1e-7)
        unweighted = policy_loss(logps, old, advantages, mask, settings, ref).phi
        assert not torch.allclose(unweighted, phi)  # the correction moved the weight
        expected = -phi * a * logps + beta * kl
    else:
        expected = -torch.min(ratio * a, torch.clamp(ratio, 0.8, 1.28) * a) * weights + beta * kl
    torch.testing.assert_close(ours.per_token, expected, rtol=1e-6, atol=1e-7)


def test_evaluation_goes_through_the_engine_with_vespos_correction(vllm, tokenizer, tmp_path):
    """evaluate() generates through the engine (num_generations_eval completions per prompt, log-probs asked for),
    and an eval step's correction and VESPO weight are logged with the eval prefix."""
    import math

    vllm.logprob_shift = lambda token: 0.3 if token % 2 else -0.01
    trainer = _trainer(tiny_llama(len(tokenizer)), tokenizer, tmp_path, loss_type="vespo",
                       vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate",
                       vllm_importance_sampling_clip_min=0.9, vllm_importance_sampling_clip_max=1.02,
                       num_generations_eval=2, per_device_eval_batch_size=4)
    (llm,) = vllm.instances
    metrics = trainer.evaluate([{"prompt": p} for p in ("When the bell rang", "At night", "The river")])
    assert [len(prompts) for prompts, _ in llm.requests] == [4, 2]
    assert all(kw["logprobs"] == 0 for _, kw in llm.requests)
    assert metrics["eval_sampling/sampling_logp_difference/max"] == pytest.approx(0.3, rel=1e-3)
    assert metrics["eval_sampling/importance_sampling_ratio/min"] == pytest.approx(0.9, rel=1e-4)
    assert metrics["eval_vespo/phi_seq_mean"] > 0 and math.isfinite(metrics["eval_loss"])


def test_training_with_the_correction_weighs_each_token(vllm, tokenizer, tmp_path):
    """One step with the correction on: the engine is asked for log-probs, the loss is TRL's dapo loss with each
    token's term times clamp(pi_train / pi_vllm), computed here from a copy of the policy, and TRL's metrics are
    logged."""
    import copy

    # odd tokens: ratio exp(-0.3) < clip_min, truncated to 0.9; even ones: exp(0.01), inside the bounds
    vllm.logprob_shift = lambda token: 0.3 if token % 2 else -0.01
    hf = tiny_llama(len(tokenizer))
    initial = copy.deepcopy(hf).eval()
    trainer = _trainer(hf, tokenizer, tmp_path, max_steps=1, vllm_importance_sampling_correction=True,
                       reward=lambda completion_ids, **k: [float(sum(c) % 7) for c in completion_ids],
                       vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_min=0.9,
                       vllm_importance_sampling_clip_max=1.02)
    (llm,) = vllm.instances
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs"
    seen = []
    compute_loss = trainer.compute_loss

    def recording(model, inputs, *a, **k):
        loss = compute_loss(model, inputs, *a, **k)
        seen.append(({k: v.detach().clone() for k, v in inputs.items() if torch.is_tensor(v)}, loss.detach()))
        return loss

    trainer.compute_loss = recording
    trainer.train()
    (prompts, kw), = llm.requests
    assert kw["logprobs"] == 0
    (batch, loss), = seen
    assert bool((batch["advantages"] != 0).any())  # else the loss is 0 whatever the weights
    temperature = 0.9
    total, tokens = 0.0, 0.0
    weights_seen = []
    for row, (p_ids, p_mask, c_ids, c_mask, adv) in enumerate(zip(
            batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"],
            batch["advantages"])):
        prompt = p_ids[p_mask.bool()]
        n = int(c_mask.sum())
        completion = c_ids[:n]
        with torch.no_grad():
            logits = initial(torch.cat([prompt, completion]).unsqueeze(0)).logits[0, len(prompt) - 1:-1]
        own = (logits / temperature).log_softmax(-1).gather(1, completion.unsqueeze(1)).squeeze(1)
        shift = torch.tensor([vllm.logprob_shift(int(t)) for t in completion])
        w = torch.exp(-shift).clamp(0.9, 1.02)  # old - sampling = -shift: the stand-in reports own + shift
        weights_seen.append(w)
        # first iteration: the ratio is 1, the clipped objective is -A per token
        total += float((-adv * w).sum())
        tokens += n
        torch.testing.assert_close(batch["old_per_token_logps"][row, :n], own, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(batch["importance_sampling_ratio"][row, :n], w, rtol=1e-4, atol=1e-5)
    assert abs(total) > 1e-3  # the weights moved the loss off 0 (the unweighted first-step loss sums to ~0)
    torch.testing.assert_close(loss, torch.tensor(total / tokens), rtol=1e-5, atol=1e-6)
    logs = next(h for h in trainer.state.log_history if "loss" in h)
    all_w = torch.cat(weights_seen)
    assert logs["sampling/importance_sampling_ratio/max"] == pytest.approx(float(all_w.max()), rel=1e-4)
    assert logs["sampling/importance_sampling_ratio/min"] == pytest.approx(0.9, rel=1e-4)
    assert logs["sampling/sampling_logp_difference/max"] == pytest.approx(0.3, rel=1e-3)
