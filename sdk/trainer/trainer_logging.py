"""The Trainer's logger, ``shardkit.trainer``: under transformers' logging when transformers is in use.

Hugging Face's Trainer logs through transformers' library logger, so ``transformers.logging.set_verbosity_info()``
(or ``log_level``) decides whether "Running training" and the callback warnings are printed, transformers' handler
prints them, and a capture on transformers' logger sees them. With transformers imported, shardkit's Trainer
logger becomes a child of that library logger and follows the same rules. Without transformers it stays under the
``shardkit`` logger (Python's logging: its level, handlers and propagation to the root logger).
"""

from __future__ import annotations

import logging
import sys

__all__ = ["TRAINER_LOGGER", "follow_transformers_logging", "set_trainer_log_level", "trainer_log_level"]

TRAINER_LOGGER = "shardkit.trainer"


def follow_transformers_logging() -> bool:
    """Put the Trainer's logger under transformers' library logger when transformers is imported (never
    importing it here); True when it is there."""
    if "transformers" not in sys.modules:
        return False
    from transformers.utils import logging as hf_logging

    logging.getLogger(TRAINER_LOGGER).parent = hf_logging.get_logger()
    return True


def set_trainer_log_level(level: int) -> None:
    """``TrainingArguments.log_level`` applied as Hugging Face's Trainer applies it: transformers' verbosity when
    transformers is in use (the Trainer's logger follows it), else the ``shardkit`` loggers' level."""
    trainer_logger = logging.getLogger(TRAINER_LOGGER)
    if follow_transformers_logging():
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(level)
        trainer_logger.setLevel(logging.NOTSET)
    else:
        trainer_logger.setLevel(level)
    logging.getLogger("shardkit").setLevel(level)


def trainer_log_level() -> int:
    """The level the Trainer's lines are printed at now (transformers' verbosity when transformers is in use)."""
    follow_transformers_logging()
    return logging.getLogger(TRAINER_LOGGER).getEffectiveLevel()
