"""Memory estimates per device: model states by strategy and precision, activations, DeepSpeed's tables.

Model states per rank, with Ψ parameters on N ranks (G per node) and Adam (two fp32 states). Each row is a
:class:`Layout`: a strategy from the registry (``shardkit.strategies.registry.STRATEGIES``) and the constructor
arguments that give it; a registry name or alias (``tensor_parallel``, ``zero-3``) means its plain row, and a
registered strategy without a row here gets its plain row after these (:func:`layouts`). The bytes come from the
strategy built for the row (``Strategy.model_state_memory``, from its settings): this module names no strategy's
formula, so the table below describes what the registered strategies declare.

==================  ==============================  ==========================================
layout              on each device                  notes
==================  ==============================  ==========================================
ddp                 p + g + s                       everything replicated
zero1               p + (g + m + s)/N               + a bucket; g whole until reduced (working)
zero2               p + (g + m + s)/N               + a reduce bucket
zero3, fsdp         (p + g + m + s)/N               + the largest layer gathered (working)
zero2_offload       p + a reduce bucket             m + s + an fp32 gradient partition on the host
fsdp_offload        the largest layer only          (p + g + s)/N on the host (CPUOffloadPolicy)
fsdp_grad_op        (p + g + s)/N                   + all of p gathered between forward and backward
fsdp_hybrid         (p + g + s)/G                   sharded within a node, replicated across
tp                  split/T + replicated            T = tp_size (default G); dp replicates
zero3_offload       (p + g)/N on device             m + s + an fp32 gradient partition on the host
zero_infinity       the largest layer only          g/N (+ p up to max_in_cpu) on the host; the rest,
                                                    m + s and an fp32 gradient partition on NVMe
==================  ==============================  ==========================================

Bytes per parameter (p params, g grads, m fp32 master, s optimizer states) follow from the precision's
dtypes (any name in ``shardkit.precision.registry.PRECISIONS``) and from whether the strategy keeps a
separate fp32 master copy (``Strategy.keeps_master_copy``). Torch engines (DDP, FSDP2, DTensor) hold the
parameters in the precision's parameter dtype and step on them: fp32 under mixed bf16/fp16 (autocast), so
p=4, g=4, s=8, m=0; ``bf16-true`` halves all three. DeepSpeed holds parameters and gradients in the compute
dtype beside a separate fp32 master: p=2, g=2, m=4, s=8 under mixed precision and, in fp32, still a separate
master (p=4, g=4, m=4, s=8; see ``shardkit.strategies.zero.memory``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardkit.precision.registry import PRECISIONS
from shardkit.strategies.facts import MemoryJob, StrategyFamily
from shardkit.strategies.registry import STRATEGIES
from shardkit.utils.suggest import did_you_mean

from .model_spec import ModelSpec

if TYPE_CHECKING:
    import torch

__all__ = ["LAYOUTS", "Layout", "ModelStates", "activation_bytes", "activation_dtype", "all_to_all_bytes",
           "deepspeed_table", "estimate_model_states", "find_layout", "layouts", "listed_layouts", "memory_job",
           "recommend",
           "zero2_mem_needs", "zero3_mem_needs"]


@dataclass(frozen=True)
class Layout:
    """One way to run a registered strategy whose memory the estimate knows.

    Attributes:
        name: the row's name: the registry's name, or ``<name>_<variant>`` for a variant.
        strategy: the registry's name of the strategy.
        options: the constructor arguments that give this layout (``STRATEGIES.build(strategy, **options)``).
    """

    name: str
    strategy: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def build(self, **kwargs: Any) -> Any:
        """The strategy this row estimates (its options, then ``kwargs``)."""
        return STRATEGIES.build(self.strategy, **{**self.options, **kwargs})


# From least to most sharded / slowest: recommend() walks this order.
LAYOUTS = (
    Layout("ddp", "ddp"),
    Layout("zero1", "zero1"),
    Layout("zero2", "zero2"),
    Layout("fsdp_grad_op", "fsdp", {"sharding": "grad_op"}),
    Layout("fsdp_hybrid", "fsdp", {"sharding": "hybrid"}),
    Layout("tp", "tp", {"dp": "replicate"}),
    Layout("pp", "pp"),
    Layout("fsdp", "fsdp"),
    Layout("cp", "cp"),
    Layout("ep", "ep"),
    Layout("zero3", "zero3"),
    Layout("zero2_offload", "zero2", {"offload_optimizer": "cpu"}),
    Layout("fsdp_offload", "fsdp", {"cpu_offload": True}),
    Layout("zero3_offload", "zero3", {"offload_optimizer": "cpu"}),
    Layout("zero_infinity", "zero_infinity"),
)
# DeepSpeed's offload_param.max_in_cpu: parameter elements ZeRO-Infinity keeps in host memory.
DEEPSPEED_MAX_PARAMS_IN_CPU = 1_000_000_000


@dataclass(frozen=True)
class ModelStates:
    """Bytes one rank holds for model states.

    Attributes:
        params, grads, optimizer: held on the device between steps (optimizer includes the fp32 master).
        working: gathered on top during forward/backward (ZeRO-3/FSDP layers, grad_op's whole model).
        host: held in CPU memory per rank (offloaded states).
        nvme: swapped out to NVMe per rank (not held in memory).
    """

    strategy: str
    params: int
    grads: int
    optimizer: int
    working: int = 0
    host: int = 0
    nvme: int = 0

    @property
    def device_total(self) -> int:
        """params + grads + optimizer: what ``model_state_bytes`` measures."""
        return self.params + self.grads + self.optimizer

    @property
    def device_peak(self) -> int:
        """device_total + working."""
        return self.device_total + self.working


def layouts() -> tuple[Layout, ...]:
    """:data:`LAYOUTS`, then a plain row for every registered strategy that has none there: a strategy
    registered later is estimated (by the formula it declares) with no edit here."""
    covered = {layout.strategy for layout in LAYOUTS}
    return LAYOUTS + tuple(Layout(name, name) for name in STRATEGIES.names() if name not in covered)


def listed_layouts() -> tuple[Layout, ...]:
    """The rows ``--strategy all`` prints and :func:`recommend` tries: :func:`layouts` less a one-process strategy
    (``StrategyFamily.SINGLE``: one device, whose states are DDP's per device), which has no place among ways of
    using N devices (``--strategy single`` still estimates it)."""
    return tuple(layout for layout in layouts() if layout.build().family is not StrategyFamily.SINGLE)


def find_layout(name: str) -> Layout:
    """The row called ``name``, or the plain row of the registry's strategy ``name`` names (any alias).

    Raises:
        ValueError: neither (with the closest row or strategy name and the list of rows).
    """
    rows = {layout.name: layout for layout in layouts()}
    if name in rows:
        return rows[name]
    if name not in STRATEGIES:
        hint = did_you_mean(str(name), [*rows, *STRATEGIES.aliases()])
        raise ValueError(f"strategy {name!r} has no memory estimate{hint or '.'} Rows: {', '.join(rows)}")
    return rows[STRATEGIES.canonical(name)]


def _bytes_per_param(strategy: Any, precision: Any) -> tuple[int, int, int, int]:
    """(p, g, m, s) bytes per parameter under ``strategy`` and ``precision`` (a Precision, or its name)."""
    if not hasattr(precision, "param_dtype"):
        precision = PRECISIONS.build(precision)
    if strategy.keeps_master_copy:
        p = precision.compute_dtype.itemsize
        return p, p, 4, 8
    p = precision.param_dtype.itemsize
    return p, p, 0, 2 * p


def estimate_model_states(spec: ModelSpec, strategy: str, *, num_gpus_per_node: int = 1, num_nodes: int = 1,
                          precision: Any = "bf16", tp_size: int | None = None, pp_size: int | None = None,
                          ep_size: int | None = None, reduce_bucket_size: int | None = None,
                          params_in_cpu: int = DEEPSPEED_MAX_PARAMS_IN_CPU,
                          options: Mapping[str, Any] | None = None) -> ModelStates:
    """Bytes of parameters, gradients and optimizer state per rank under ``strategy`` (see the module table).

    The strategy built for the row says where each byte lives (``Strategy.model_state_memory``, from its own
    settings); this function only describes the job to it.

    Args:
        spec: the model's sizes.
        strategy: a row of :func:`layouts`, or a registered strategy name or alias (its plain row).
        num_gpus_per_node, num_nodes: the job's shape (N = their product).
        precision: a Precision, or any name or alias in ``PRECISIONS`` ("bf16" and "fp16" are mixed).
        tp_size: ranks per tensor-parallel group (default: the strategy's, else a node).
        pp_size: pipeline stages (default: the strategy's, else a node); the rest of the ranks replicate each stage.
        ep_size: expert-parallel ranks splitting a mixture of experts' routed experts (default: the strategy's own;
            ``spec.expert_params`` says how many parameters they are).
        reduce_bucket_size: ZeRO-1/2 gradient bucket elements (shardkit's "auto" is hidden^2; default
            from ``spec.hidden_size``, else none counted).
        params_in_cpu: zero_infinity: parameter elements per rank DeepSpeed keeps in host memory rather
            than on NVMe (``offload_param.max_in_cpu``, 1e9 by default).
        options: constructor arguments of the row's strategy on top of the row's own (``{"expert_tp": True,
            "tp_size": 2}`` for the ep row: ``ExpertParallel(tp_size=2, expert_tp=True)``).
    """
    layout = find_layout(strategy)
    built = layout.build(**(options or {}))
    job = memory_job(spec, built, num_gpus_per_node=num_gpus_per_node, num_nodes=num_nodes, precision=precision,
                     tp_size=tp_size, pp_size=pp_size, ep_size=ep_size, reduce_bucket_size=reduce_bucket_size,
                     params_in_cpu=params_in_cpu)
    held = built.model_state_memory(job)
    return ModelStates(layout.name, held.params, held.grads, held.optimizer, working=held.working, host=held.host,
                       nvme=held.nvme)


def memory_job(spec: ModelSpec, strategy: Any, *, num_gpus_per_node: int = 1, num_nodes: int = 1,
               precision: Any = "bf16", tp_size: int | None = None, pp_size: int | None = None,
               ep_size: int | None = None, reduce_bucket_size: int | None = None,
               params_in_cpu: int = DEEPSPEED_MAX_PARAMS_IN_CPU) -> MemoryJob:
    """The job :func:`estimate_model_states` describes to ``strategy`` (a built one: its bytes per parameter depend
    on whether it keeps a master copy); its arguments as there. ``strategy.model_state_memory(job)`` gives the
    bytes of a strategy built with options no row of :data:`LAYOUTS` has (``ExpertParallel(expert_sharding="none")``).
    """
    p, g, m, s = _bytes_per_param(strategy, precision)
    if reduce_bucket_size is None and spec.hidden_size:
        reduce_bucket_size = spec.hidden_size**2
    return MemoryJob(params=spec.total_params, largest_layer=spec.largest_layer_params,
                     ranks=num_gpus_per_node * num_nodes, ranks_per_node=num_gpus_per_node, param_bytes=p,
                     grad_bytes=g, master_bytes=m, state_bytes=s, tp_params=spec.tp_params, tp_size=tp_size,
                     pp_size=pp_size, bucket=reduce_bucket_size or 0, params_in_cpu=params_in_cpu, ep_size=ep_size,
                     expert_params=spec.expert_params, expert_block=spec.expert_block_params,
                     largest_dense_layer=spec.largest_dense_params)


def zero2_mem_needs(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1, cpu_offload: bool = True,
                    additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """(per CPU, per GPU) bytes as DeepSpeed's ``estimate_zero2_model_states_mem_needs`` computes them.

    Mixed precision with Adam: 2 bytes of 16-bit params per GPU, plus 16 bytes/param of grads,
    master and states spread over the GPUs or kept in CPU memory when offloaded.
    """
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / total_gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def zero3_mem_needs(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                    cpu_offload: bool = True, cpu_offload_params: bool = True, zero_init: bool = True,
                    additional_buffer_factor: float = 1.5) -> tuple[int, int, int]:
    """(per CPU, per GPU, largest layer) bytes as DeepSpeed's ``estimate_zero3_model_states_mem_needs``."""
    total_gpus = num_nodes * num_gpus_per_node
    per_node = 1 / num_nodes
    layer = 4 * largest_layer_params  # the gathered fp16 layer and its gradient
    if cpu_offload:
        states = 18 if cpu_offload_params else 16
        gpu = layer if cpu_offload_params else layer + int(2 * total_params / total_gpus)
        factor = states * per_node if zero_init else max(4 * num_gpus_per_node, states * per_node)
        cpu = total_params * factor * additional_buffer_factor
    else:
        gpu = layer + int(18 * total_params / total_gpus)
        # without zero.Init every process first builds the whole fp32 model on the CPU
        cpu = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu), layer


_TABLE_HEAD = ("  per CPU  |  per GPU |   Options", "  per CPU   |  per GPU   |   Options")


def deepspeed_table(stage: int, total_params: int, largest_layer_params: int = 0, num_gpus_per_node: int = 1,
                    num_nodes: int = 1, additional_buffer_factor: float = 1.5, unit: str = "GB") -> str:
    """The table DeepSpeed's ``estimate_zero{2,3}_model_states_mem_needs_all_live`` prints, line for line.

    DeepSpeed divides by 2**30 and labels the result "GB"; ``unit="GiB"`` labels the same numbers truly.
    """
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    head = ("Estimated memory needed for params, optim states and gradients for a:\n"
            f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n"
            f"SW: Model with {int(total_params / 1e6)}M total params")
    lines = []
    if stage == 2:
        lines.append(head + ".")
        lines.append(_TABLE_HEAD[unit == "GiB"])
        for off in (True, False):
            cpu, gpu = zero2_mem_needs(total_params, num_gpus_per_node, num_nodes, off, additional_buffer_factor)
            opts = f"offload_optimizer={'cpu ' if off else 'none'}"
            lines.append(f" {cpu / 2**30:7.2f}{unit} | {gpu / 2**30:6.2f}{unit} | {opts}")
        return "\n".join(lines)
    if stage != 3:
        raise ValueError(f"DeepSpeed prints tables for stages 2 and 3, not {stage}")
    lines.append(head + f", {int(largest_layer_params / 1e6)}M largest layer params.")
    lines.append(_TABLE_HEAD[unit == "GiB"])
    for off in (True, False):
        for off_params in (True, False):
            if not off and off_params:
                continue
            for init in (True, False):
                cpu, gpu, _ = zero3_mem_needs(total_params, largest_layer_params, num_gpus_per_node, num_nodes, off,
                                              off_params, init, additional_buffer_factor)
                opts = (f"offload_param={'cpu ' if off_params else 'none'}, "
                        f"offload_optimizer={'cpu ' if off else 'none'}, zero_init={int(init)}")
                lines.append(f" {cpu / 2**30:7.2f}{unit} | {gpu / 2**30:6.2f}{unit} | {opts}")
    return "\n".join(lines)


def activation_bytes(spec: ModelSpec, batch_size: int, seq_len: int, *, checkpointing: bool = False,
                     dtype_bytes: int = 2, tp_size: int = 1, cp_size: int = 1, pp_size: int = 1,
                     microbatches: int | None = None, schedule: str = "1f1b") -> int:
    """Activations a decoder keeps for backward, per rank (fused SDPA attention: no s^2 scores kept).

    Per token and layer a Llama block saves about ``5h + 3kv + 4i`` values (two norm inputs, the normed
    input shared by q/k/v, q and k after RoPE, v, the attention output, the o-projection input; gate,
    up, silu(gate) and their product for down), plus the logits (fp32, with their gradient) once.
    With checkpointing each layer keeps only its input ``h``, and one layer is recomputed at a time.
    ``tp_size`` divides the split parts (q/k/v, the attention output, the MLP's); the norms' inputs and the normed
    input the column-wise projections read are whole on every tp rank (no sequence parallelism), and so are the
    logits (shardkit's plan keeps the head replicated, an HF plan gathers its output). Measured on cp 2 x tp 2
    (benchmarks/context_parallel.py): 0.35-0.37 of cp 1 with ~0.05 of unsplit weights; splitting all of them
    had predicted 0.27, this gives 0.30.
    ``cp_size`` divides the tokens (each rank keeps its chunks' activations; ring attention's recomputed blocks
    keep none of the ``s^2`` scores). Under ``pp_size`` stages a rank keeps ``num_layers / pp_size`` layers for the
    micro-batches in flight: all ``microbatches`` under GPipe, at most ``pp_size`` under 1F1B (stage 0, the most).
    """
    if not spec.has_shape:
        raise ValueError("an activation estimate needs the decoder's shape (hidden, layers, intermediate, vocab): "
                         "give a config or a model instead of a bare parameter count")
    h, i, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    kv = h * (spec.num_kv_heads or spec.num_heads or 1) // (spec.num_heads or 1)
    tokens = batch_size * seq_len / cp_size
    layers = spec.num_layers / pp_size
    if pp_size > 1:
        m = microbatches or pp_size
        tokens = tokens / m * (m if schedule == "gpipe" else min(m, pp_size))
    per_layer = tokens * dtype_bytes * (3 * h + (2 * h + 3 * kv + 4 * i) / tp_size)
    logits = tokens * v * 4 * 2
    if checkpointing:
        return int(layers * tokens * h * dtype_bytes + per_layer + logits)
    return int(layers * per_layer + logits)


def activation_dtype(precision: Any) -> torch.dtype:
    """The dtype a run's activations (and the tokens its MoE layers exchange) are in under ``precision`` (a Precision,
    or its name): its compute dtype (bf16 under "bf16" mixed precision and "bf16-true", fp32 under "fp32")."""
    if not hasattr(precision, "compute_dtype"):
        precision = PRECISIONS.build(precision)
    return precision.compute_dtype


def all_to_all_bytes(spec: ModelSpec, batch_size: int, seq_len: int, ep_size: int, *, dtype_bytes: int = 2,
                     layers_in_flight: int = 1, tp_size: int = 1, expert_tp: bool = False) -> int:
    """The all-to-all receive buffers of a mixture of experts under expert parallelism, per rank.

    Each MoE layer sends every token's ``top_k`` routed copies to the ranks holding their experts (dispatch) and
    receives the experts' outputs back (combine); the send side is the layer's own sorted tokens and outputs, there
    without ``ep`` too. With routing balanced over the experts a rank receives as many rows as it sends, so per
    layer in flight::

        bytes = 2 (dispatch + combine) x tokens (batch_size x seq_len per rank) x top_k x hidden x dtype_bytes

    Under ep x tp (``tp_size > 1``) the tp peers see the same tokens and each dispatches ``1 / tp`` of the
    assignments, then they all-gather the outputs, whose receive buffers hold every peer's share::

        bytes = (2 / tp + 1) x tokens x top_k x hidden x dtype_bytes

    With tensor parallelism inside the experts (``expert_tp``: ``ExpertParallel(expert_tp=True)``, the tp peers
    holding column blocks of the same experts) each tp rank again sends its ``1 / tp`` share over ep and gets its
    outputs back, and besides the outputs' all-gather it receives every peer's dispatched rows (the tp all-gather
    that lets its block run on all of them) and every peer's partial outputs of its share (the sum over tp, an
    all-to-all of ``tp`` blocks of the share's rows, as the dispatcher runs it on every backend)::

        bytes = (2 / tp + 3) x tokens x top_k x hidden x dtype_bytes

    and ``layers_in_flight`` times that (1: the forward and the backward run one layer at a time; the copies autograd
    keeps for the backward are activations). Routing is dropless: a rank whose experts draw every token of its ep
    group receives up to ``ep_size`` times the balanced dispatch. 0 for a dense model or ``ep_size`` 1.
    """
    if ep_size <= 1 or not spec.moe_top_k:
        return 0
    if spec.hidden_size is None:
        raise ValueError("an all-to-all estimate needs the hidden size: give a config or a model")
    rows = batch_size * seq_len * spec.moe_top_k
    row = spec.hidden_size * dtype_bytes * layers_in_flight
    if tp_size <= 1:
        return 2 * rows * row
    # each peer's share is ceil(rows / tp) at most (the all-gather pads every share to the largest)
    share = -(-rows // tp_size)
    gathers = 3 if expert_tp else 1  # the outputs' all-gather; with expert_tp the rows' all-gather and the tp sum too
    return 2 * share * row + gathers * tp_size * share * row


def recommend(spec: ModelSpec, device_memory: int, *, num_gpus_per_node: int = 1, num_nodes: int = 1,
              precision: Any = "bf16", batch_size: int | None = None, seq_len: int | None = None,
              checkpointing: bool = False, reserve: float = 0.1) -> tuple[str | None, dict[str, int]]:
    """The first row of :func:`listed_layouts` whose peak per-device bytes fit ``device_memory``.

    Peak = model states + working set + activations (when batch and sequence are given and the shape
    is known). ``reserve`` keeps that fraction back for the allocator, the CUDA context and buffers.

    Returns:
        (the strategy or None if nothing fits, {strategy: peak bytes} for every strategy).
    """
    budget = device_memory * (1 - reserve)
    act = 0
    if batch_size and seq_len and spec.has_shape:
        act = activation_bytes(spec, batch_size, seq_len, checkpointing=checkpointing)
    peaks = {}
    for name in (layout.name for layout in listed_layouts()):
        if name == "fsdp_hybrid" and num_nodes == 1:
            continue  # the same as fsdp on one node
        if name == "pp":
            continue  # its forward runs backward too (the user's loop changes): listed, never recommended
        est = estimate_model_states(spec, name, num_gpus_per_node=num_gpus_per_node, num_nodes=num_nodes,
                                    precision=precision)
        tp = num_gpus_per_node if name == "tp" else 1
        a = act if tp == 1 or not act else activation_bytes(spec, batch_size, seq_len, checkpointing=checkpointing,
                                                             tp_size=tp)
        peaks[name] = est.device_peak + a
    fits = [n for n, b in peaks.items() if b <= budget]
    return (fits[0] if fits else None), peaks
