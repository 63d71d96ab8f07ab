"""The README's main loop, extracted from README.md and run as written under gradient accumulation.

Its periodic save must fire once per N optimizer steps: never before the first step, never once per
micro-batch of a window (issue 30: ``if runner.optimizer_steps % 500 == 0`` saved ``step-0`` first and every
checkpoint four times under ``gradient_accumulation_steps=4``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from shardkit import Runner

README = Path(__file__).resolve().parents[2] / "README.md"


def _main_loop() -> str:
    """The README's first Python block, with its save period 500 shortened to 3 (the loop is otherwise as shown)."""
    block = re.search(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert block is not None, "README.md has no ```python block"
    code = block.group(1)
    assert "runner.save(" in code and "500" in code, "the README's main loop no longer saves every 500 steps"
    return code.replace("500", "3")


class _LossModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.linear(x).squeeze(-1), y)


def _loader(batches: int) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    rows = [{"x": torch.randn(4, generator=gen), "y": torch.randn((), generator=gen)} for _ in range(batches * 2)]
    return DataLoader(rows, batch_size=2)


@pytest.mark.timeout(300)
def test_readme_main_loop_saves_once_per_period_under_accumulation(monkeypatch):
    saved: list[tuple[str, int]] = []

    def record_save(self, path, state, *args, **kwargs):
        saved.append((str(path), self.optimizer_steps))

    monkeypatch.setattr(Runner, "save", record_save)
    model = _LossModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    micro_batches = 26  # gradient_accumulation_steps=4 in the README: 6 whole windows and 2 micro-batches
    namespace = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": _loader(micro_batches)}
    try:
        exec(compile(_main_loop(), str(README), "exec"), namespace)  # noqa: S102 - the README's own code
    finally:
        if "runner" in namespace:
            namespace["runner"].teardown()
    runner = namespace["runner"]
    assert runner.gradient_accumulation_steps == 4
    assert runner.optimizer_steps == 6
    assert saved == [("ckpt/step-3", 3), ("ckpt/step-6", 6)], saved


def test_should_is_false_inside_a_window_and_before_the_first_step():
    runner = Runner(gradient_accumulation_steps=2)
    model = _LossModel()
    model, optimizer = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert runner.should(every=1) is False  # before the first step (optimizer_steps 0 is a multiple of any N)
    fired = []
    for batch in _loader(8):
        runner.backward(model(**batch))
        assert runner.should(every=1) is False  # a backward since the step: inside the next window
        runner.step()
        fired.append(runner.should(every=2))
    assert fired == [False, False, False, True, False, False, False, True]
    with pytest.raises(ValueError, match="every=0.*whole number"):
        runner.should(every=0)
    runner.teardown()
