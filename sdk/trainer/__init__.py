"""Trainer: Hugging Face's Trainer API on shardkit's Runner.

    from shardkit.trainer import Trainer, TrainingArguments
    trainer = Trainer(model, TrainingArguments(output_dir="out"), train_dataset=train, eval_dataset=val)
    trainer.train(resume_from_checkpoint=True)
"""

from shardkit.trainer import hf_optimizers as _hf_optimizers  # noqa: F401 - registers HF's remaining optim names
from shardkit.trainer.arguments import TrainingArguments, TrainingArgumentsError, UnknownArgumentError
from shardkit.trainer.callbacks import (
    CallbackHandler,
    DefaultFlowCallback,
    EarlyStoppingCallback,
    PrinterCallback,
    ProgressCallback,
    TrainerCallback,
)
from shardkit.trainer.checkpointing import get_last_checkpoint
from shardkit.trainer.collate import default_data_collator
from shardkit.trainer.enums import DebugOption, HubStrategy, IntervalStrategy, SaveStrategy, SchedulerType
from shardkit.trainer.evaluation import EvalLoopOutput, EvalPrediction, PredictionOutput
from shardkit.trainer.parser import HfArgumentParser
from shardkit.trainer.reporting import JsonlCallback, TensorBoardCallback, register_reporter
from shardkit.trainer.schedulers import get_scheduler
from shardkit.trainer.state import ExportableState, TrainerControl, TrainerState, TrainerStateError
from shardkit.trainer.trainer import Trainer, TrainOutput

__all__ = ["Trainer", "TrainingArguments", "TrainOutput", "TrainerState", "TrainerControl", "TrainerCallback",
           "CallbackHandler", "DefaultFlowCallback", "ProgressCallback", "PrinterCallback", "EarlyStoppingCallback",
           "ExportableState", "JsonlCallback", "TensorBoardCallback", "EvalPrediction", "EvalLoopOutput",
           "PredictionOutput", "HfArgumentParser", "get_scheduler", "get_last_checkpoint", "default_data_collator",
           "IntervalStrategy", "SaveStrategy", "HubStrategy", "SchedulerType", "DebugOption", "TrainerStateError",
           "TrainingArgumentsError", "UnknownArgumentError", "register_reporter"]
