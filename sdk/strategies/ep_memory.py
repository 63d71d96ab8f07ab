"""Model-state bytes per rank under expert parallelism: what ``ExpertParallel.model_state_memory`` and
``Pipeline(ep_size=..., dp="fsdp").model_state_memory`` declare (``shardkit estimate-memory`` asks them).

A mixture of experts' parameters are the routed experts (``MemoryJob.expert_params``, every MoE layer's) and the
dense rest (attention, embeddings, norms, routers, shared experts). Under ``ExpertParallel`` on ``N`` ranks,
``N = dp_replicate x dp_shard x cp x tp``:

- dense: the model's tensor-parallel plan splits ``tp_params`` over ``tp`` (the rest whole on every tp rank), then
  FSDP2 shards that over ``dp_shard x cp`` (HSDP: replicated over ``dp_replicate``);
- routed experts: each ep rank holds ``1 / ep`` of them (``ep`` borrowed from ``dp_shard x cp x tp``); with
  ``expert_sharding="full"`` FSDP2 shards that slice over the ``dp_shard x cp x tp / ep`` ranks holding the same
  experts, so a rank holds ``1 / (dp_shard x cp x tp)`` of them; with ``"none"`` the slice stays whole. With
  ``expert_tp=True`` ep is borrowed from ``dp_shard x cp`` only and each tp peer holds its block of its ep slice
  (:mod:`~shardkit.strategies.ep_expert_tp`), so a rank holds ``1 / (ep x tp)`` of them (and of their gradients
  and optimizer state), with ``"none"`` as with ``"full"`` (the only one built when ``ep < dp``).

Gathered on top (``working``): the largest dense module's tp part (``sharding="full"``) or every dense parameter's
(``"grad_op"``: gathered from forward to backward), plus one MoE layer's ep slice while FSDP2 gathers it
(``expert_sharding="full"`` with replicas; a slice held whole is not gathered), under ``"grad_op"`` every MoE
layer's slice.
"""

from __future__ import annotations

from shardkit.strategies.facts import MemoryJob, StateBytes

__all__ = ["expert_parallel_state", "pipeline_expert_working"]


def _dense_per_tp_rank(job: MemoryJob, tp: int) -> int:
    """The dense parameters one tp rank holds before data-parallel sharding: its 1/tp of the split ones, the rest
    whole (a job that names no split count has every dense parameter split)."""
    dense = job.params - job.expert_params
    split = dense if job.tp_params is None else min(job.tp_params, dense)
    return job.share(split, tp) + (dense - split)


def expert_parallel_state(job: MemoryJob, *, dp_replicate: int, tp: int, ep: int | None, expert_sharding: str,
                          sharding: str, expert_tp: bool = False) -> StateBytes:
    """One rank's bytes under ExpertParallel (the module docstring's layout).

    Args:
        job: the model and job (``job.ranks`` ranks).
        dp_replicate: replicas of the whole model (HSDP).
        tp: tensor-parallel ranks splitting the dense layers.
        ep: expert-parallel ranks (None: every rank of ``dp_shard x cp x tp``, as ExpertParallel() takes).
        expert_sharding: "full" or "none" (how the ranks holding the same experts hold them).
        sharding: the dense parameters' FSDP2 mode, "full" or "grad_op".
        expert_tp: tensor parallelism inside the experts (ep borrowed from dp_shard x cp; each tp peer holds its
            block of the ep slice).

    Raises:
        ValueError: the sizes do not fit ``job.ranks`` (named as the mesh names them).
    """
    borrowed = job.ranks // dp_replicate  # dp_shard x cp x tp: the ranks ep borrows from
    if borrowed * dp_replicate != job.ranks or borrowed % tp:
        raise ValueError(f"ExpertParallel on {job.ranks} ranks: dp_replicate({dp_replicate}) x tp({tp}) does not "
                         "divide them")
    lender = borrowed // tp if expert_tp else borrowed  # the ranks ep borrows from
    ep = ep or lender
    if lender % ep:
        what = "dp_shard x cp" if expert_tp else "dp_shard x cp x tp"
        raise ValueError(f"ExpertParallel on {job.ranks} ranks: ep({ep}) does not divide the {lender} ranks it "
                         f"borrows from ({what})")
    dense = _dense_per_tp_rank(job, tp)
    dense_ways = borrowed // tp  # dp_shard x cp
    experts = job.expert_params
    if expert_tp:
        expert_ways = ep * tp
    else:
        expert_ways = borrowed if expert_sharding == "full" else ep

    def held(nbytes: int) -> int:
        return job.share(dense * nbytes, dense_ways) + job.share(experts * nbytes, expert_ways)

    p = job.param_bytes
    if sharding == "grad_op":
        dense_working = dense * p - job.share(dense * p, dense_ways)
    else:
        largest = job.largest_layer if job.largest_dense_layer is None else job.largest_dense_layer
        dense_working = job.share(largest, tp) * p
    expert_working = 0
    if expert_sharding == "full" and not expert_tp and borrowed > ep:
        if sharding == "grad_op":  # the experts' units are not resharded after forward either
            slice_ = job.share(experts, ep) * p
            expert_working = slice_ - job.share(slice_, borrowed // ep)
        else:
            expert_working = job.share(job.expert_block, ep) * p
    return StateBytes(held(p), held(job.grad_bytes), held(job.optimizer_bytes),
                      working=dense_working + expert_working)


def pipeline_expert_working(job: MemoryJob, pp: int, ep: int) -> int:
    """Bytes a ``Pipeline(dp="fsdp")`` rank holds gathered on top of its shard: its stage's FSDP2 units stay whole
    from the first forward to the step's gradient reduction, so every dense parameter of the stage, and of its
    routed experts the ep slice (gathered over the ``dp_shard / ep`` ranks holding it; none when ep is
    ``dp_shard``, whose slices are held whole, and all of them with ``ep`` 1).

    Raises:
        ValueError: ``ep`` does not divide the ``job.ranks / pp`` ranks of a stage.
    """
    ways = max(1, job.ranks // pp)  # dp_shard
    if ways % ep:
        raise ValueError(f"Pipeline ep_size={ep} on {job.ranks} ranks in {pp} stages: ep does not divide the "
                         f"{ways} data-parallel ranks of a stage")
    p = job.param_bytes
    dense = job.share(job.params - job.expert_params, pp)
    experts = job.share(job.expert_params, pp)
    gathered = dense * p - job.share(dense * p, ways)
    if ways > ep:
        slice_ = job.share(experts, ep)
        gathered += slice_ * p - job.share(slice_ * p, ways // ep)
    return gathered
