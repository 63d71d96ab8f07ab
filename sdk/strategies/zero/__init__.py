"""ZeRO stages 1, 2 and 3 and ZeRO-Infinity on the DeepSpeed engine, configured from shardkit objects.

    from shardkit.strategies.zero import ZeRO3
    runner = Runner(strategy=ZeRO3(offload="cpu"), precision=BF16(), gradient_accumulation_steps=4)

Files: ``strategy.py`` (:class:`ZeROStrategy`, the one implementation, as stages 1 and 2 run it; ZeRO1,
ZeRO2), ``stage3.py`` (ZeRO3 and ZeROInfinity: what partitioned parameters change, as overrides),
``leaf.py`` (the mixture-of-experts blocks ZeRO-3 gathers whole), ``config.py`` (settings, their
validation and the DeepSpeed JSON built from them and the precision),
``layout.py`` (where each stage keeps each rank's share of the state), ``checkpoint.py`` (shardkit's
checkpoint format over that layout) and ``memory.py`` (bytes held per rank). Importing this package
does not import DeepSpeed.
"""

from __future__ import annotations

from shardkit.strategies.zero.config import ZeROSettings, ZeROSettingsError
from shardkit.strategies.zero.stage3 import ZeRO3, ZeROInfinity
from shardkit.strategies.zero.strategy import ZeRO1, ZeRO2, ZeROStrategy

__all__ = ["ZeRO1", "ZeRO2", "ZeRO3", "ZeROInfinity", "ZeROStrategy", "ZeROSettings", "ZeROSettingsError"]
