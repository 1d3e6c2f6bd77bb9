"""What a rank needs to run the step it is in once more (torch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class StepStart:
    """What a rank needs to run the step it is in once more: ``step``, the step begun last, and
    ``buffers``, its buffers as they were when it began. The weights need no copy: they change
    only in a step's last act, the update, after which the step has completed."""

    step: int = -1
    buffers: dict[str, torch.Tensor] | None = None

    def rewind(self, model: nn.Module, completed: int) -> None:
        """Put back ``model``'s buffers as they were at the start of step ``completed`` (the
        steps it has completed) when that step had begun; a step that never began changed
        nothing."""
        if self.step != completed or self.buffers is None:
            return
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(self.buffers[name])
