"""Telling transformers that ZeRO-3 runs, as Accelerate does, so that Hugging Face code acts on it by itself.

transformers reads one process-wide weak reference (``transformers.integrations.deepspeed``): while it points at
a live config whose stage is 3, ``is_deepspeed_zero3_enabled()`` is true, so that

- ``model.generate`` sets ``synced_gpus`` itself and every rank keeps stepping until the last one is done (ranks
  asking for different numbers of new tokens otherwise hang in the gathers of the ranks still decoding);
- ``from_pretrained`` / ``from_config`` build the model inside ``deepspeed.zero.Init`` with this config and load
  the checkpoint one module at a time into the partitions (each rank holds about 1/world of the parameters).

The strategy keeps the object alive (transformers holds only a weak reference) and clears the reference at
teardown when it is still its own. transformers is imported only where it is installed.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

__all__ = ["TransformersLink"]

log = logging.getLogger("shardkit.strategies.zero")


class _ConfigView:
    """What transformers asks of the registered object, for installs without Accelerate (whose class
    ``HfDeepSpeedConfig`` builds on): ``config`` and ``is_zero3()``."""

    def __init__(self, config: dict[str, Any]):
        self.config = config

    def is_zero3(self) -> bool:
        return int((self.config.get("zero_optimization") or {}).get("stage", 0)) == 3

    def is_offload(self) -> bool:
        section = self.config.get("zero_optimization") or {}
        return any((section.get(k) or {}).get("device") in ("cpu", "nvme")
                   for k in ("offload_param", "offload_optimizer"))


class TransformersLink:
    """The registration of one strategy's DeepSpeed config with transformers (a no-op without transformers)."""

    def __init__(self) -> None:
        self._registered: Any | None = None

    @property
    def active(self) -> bool:
        """Whether transformers currently reads this link's config."""
        if self._registered is None:
            return False
        from transformers.integrations import deepspeed as hf_deepspeed

        return hf_deepspeed.deepspeed_config() is self._registered.config

    def register(self, config: dict[str, Any]) -> None:
        """Point transformers at ``config`` (replacing what this link registered before)."""
        if importlib.util.find_spec("transformers") is None:
            return
        from transformers.integrations import deepspeed as hf_deepspeed

        try:
            registered = hf_deepspeed.HfDeepSpeedConfig(config)  # registers itself, as under Accelerate
        except (ImportError, TypeError) as err:  # no accelerate (PackageNotFoundError is an ImportError)
            log.debug("shardkit: transformers' HfDeepSpeedConfig unavailable (%s); registering the config alone", err)
            registered = _ConfigView(config)
            hf_deepspeed.set_hf_deepspeed_config(registered)
        self._registered = registered

    def release(self) -> None:
        """Clear transformers' reference if it is still this link's; later registrations by others stay."""
        if self._registered is None:
            return
        if self.active:
            from transformers.integrations import deepspeed as hf_deepspeed

            hf_deepspeed.unset_hf_deepspeed_config()
        self._registered = None
