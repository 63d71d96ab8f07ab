"""Trainer: Hugging Face's Trainer API on shardkit's Runner.

    from shardkit.trainer import Trainer, TrainingArguments
    trainer = Trainer(model, TrainingArguments(output_dir="out"), train_dataset=train, eval_dataset=val)
    trainer.train(resume_from_checkpoint=True)
"""

from shardkit.trainer.arguments import TrainingArguments
from shardkit.trainer.callbacks import (
    CallbackHandler,
    DefaultFlowCallback,
    EarlyStoppingCallback,
    ExportableState,
    PrinterCallback,
    ProgressCallback,
    TrainerCallback,
)
from shardkit.trainer.checkpointing import get_last_checkpoint
from shardkit.trainer.evaluation import EvalLoopOutput, EvalPrediction, PredictionOutput
from shardkit.trainer.parser import HfArgumentParser
from shardkit.trainer.reporting import JsonlCallback, TensorBoardCallback
from shardkit.trainer.schedulers import get_scheduler
from shardkit.trainer.state import TrainerControl, TrainerState
from shardkit.trainer.trainer import Trainer, TrainOutput

__all__ = ["Trainer", "TrainingArguments", "TrainOutput", "TrainerState", "TrainerControl", "TrainerCallback",
           "CallbackHandler", "DefaultFlowCallback", "ProgressCallback", "PrinterCallback", "EarlyStoppingCallback",
           "ExportableState", "JsonlCallback", "TensorBoardCallback", "EvalPrediction", "EvalLoopOutput",
           "PredictionOutput", "HfArgumentParser", "get_scheduler", "get_last_checkpoint"]
