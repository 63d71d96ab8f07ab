"""Pipeline parallelism's settings, schedules and stage split: what the strategy (``pipeline.py``) and its stage
machinery (``_pipeline_stages.py``) both read, so that each imports this and neither imports the other late.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardkit.utils.parsing import parse_int_list
from shardkit.utils.suggest import did_you_mean

__all__ = ["DATA_PARALLEL", "SCHEDULES", "PipelineSettings", "bubble_fraction", "stage_layers"]

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
             "zero_bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
             "dualpipev": "ScheduleDualPipeV"}
_MULTI_STAGE = ("interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
# rank r holds stages r and 2 * pp_size - 1 - r (the first and the last on rank 0)
_V_SHAPED = ("zbv", "dualpipev")
DATA_PARALLEL = ("ddp", "fsdp")


def bubble_fraction(pp: int, microbatches: int) -> float:
    """Idle share of a GPipe/1F1B step: (pp - 1) / (microbatches + pp - 1)."""
    return (pp - 1) / (microbatches + pp - 1)


def stage_layers(num_layers: int, stages: int, split: tuple[int, ...] | None = None) -> list[range]:
    """The layer indices of each stage: ``split`` (layers per stage) or equal blocks."""
    sizes = list(split) if split is not None else [num_layers // stages] * stages
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [range(s, s + n) for s, n in zip(starts, sizes)]


@dataclass(frozen=True)
class PipelineSettings:
    """Settings of pipeline parallelism.

    Args:
        pp_size: pipeline ranks; the world size must be a multiple (the rest replicates, as DDP). None: all.
        schedule: "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble" (interleaved zero-bubble), "zbv"
            (zero-bubble V: rank r runs stages r and 2 * pp_size - 1 - r; exactly 2 stages per rank) or
            "dualpipev" (DeepSeek's DualPipe, V-shaped as zbv; at least 2 x pp_size micro-batches).
        microbatches: pieces each batch is cut into; the batch size must be a multiple. None: the Runner's
            accumulation window when it is over 1, else pp_size (dualpipev: at least 2 x pp_size).
        stages_per_rank: model chunks per rank (interleaved schedules: 2 unless given; others: 1).
        layer_split: layers per stage (pp_size * stages_per_rank of them), default equal blocks; a string
            "2,6" (as ``--strategy-opt layer_split=2,6`` gives it) is read as (2, 6).
        dp: the ranks outside a pipeline group: "ddp" (replicas) or "fsdp" (FSDP2 over dp_shard).
    """

    pp_size: int | None = None
    schedule: str = "1f1b"
    microbatches: int | None = None
    stages_per_rank: int | None = None
    layer_split: tuple[int, ...] | None = None
    dp: str = "ddp"

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Pipeline schedule={self.schedule!r} is not one of {sorted(SCHEDULES)}"
                             f"{did_you_mean(str(self.schedule), list(SCHEDULES))}")
        for name in ("pp_size", "microbatches", "stages_per_rank"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"Pipeline {name}={value!r} must be an int >= 1")
        if self.dp not in DATA_PARALLEL:
            raise ValueError(f"Pipeline dp={self.dp!r} is not one of {DATA_PARALLEL}"
                             f"{did_you_mean(str(self.dp), DATA_PARALLEL)}")
        if self.layer_split is not None:
            split = self.layer_split
            if isinstance(split, str):
                split = parse_int_list(split, "Pipeline layer_split", minimum=1)
            elif not isinstance(split, (tuple, list)) or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                                             for n in split) or not split:
                raise ValueError(f"Pipeline layer_split={split!r} must be layers per stage, whole numbers >= 1 "
                                 "(e.g. (2, 6) or \"2,6\")")
            object.__setattr__(self, "layer_split", tuple(split))
            stages = (self.pp_size or 1) * self.chunks
            if self.pp_size is not None and len(self.layer_split) != stages:
                raise ValueError(f"Pipeline layer_split={self.layer_split} gives {len(self.layer_split)} stages; "
                                 f"pp_size({self.pp_size}) x stages_per_rank({self.chunks}) = {stages} are run: give "
                                 f"{stages} layer counts")
        if self.schedule in _V_SHAPED and self.stages_per_rank not in (None, 2):
            raise ValueError(f"Pipeline stages_per_rank={self.stages_per_rank}: schedule={self.schedule!r} runs "
                             "exactly 2 stages per rank (r and 2 * pp_size - 1 - r); leave stages_per_rank unset")
        if self.stages_per_rank not in (None, 1) and self.schedule not in _MULTI_STAGE:
            raise ValueError(f"Pipeline stages_per_rank={self.stages_per_rank} needs an interleaved schedule "
                             f"({', '.join(_MULTI_STAGE)}); {self.schedule!r} runs one stage per rank")

    @property
    def chunks(self) -> int:
        """Stages each rank holds."""
        return self.stages_per_rank or (2 if self.schedule in _MULTI_STAGE else 1)

    def stage_indices(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank ``pp_rank`` runs: looped (r, r + pp, ...) or, for V schedules, r and
        2 * pp - 1 - r (what torch's schedules expect)."""
        if self.schedule in _V_SHAPED:
            return [pp_rank, 2 * self.pp_size - 1 - pp_rank]
        return [pp_rank + c * self.pp_size for c in range(self.chunks)]
