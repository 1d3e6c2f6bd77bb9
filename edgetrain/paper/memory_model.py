"""The memory a training step needs, two ways: the paper's accounting and autograd's.

**Paper accounting** (reproduces Tables I-III of Kukreja et al. 2019 within 3.8 %)::

    total = 4 × weights                      weights, gradients, two optimizer buffers (Adam)
          + 2 × batch × layer outputs        every convolution, normalisation, activation and
                                             linear layer's output, and its gradient

The tables say so themselves: their intercepts (batch → 0) are 3.93-3.98 × the parameter bytes,
and their slopes per image are exactly 2 × the conv/BatchNorm/ReLU outputs of each residual block
(ResNet-101 − ResNet-50 = 17 extra blocks = 117.14 MB per image, to the table's last digit).
Pooling outputs and the input are not counted (counting pooling raises the worst cell error from
3.7 % to 4.7 %). The remaining differences sit in the stem and first blocks; the tables' exact
layer list is not published. Sizes are mebibytes (MB = 2**20 bytes; Table III: GB = 2**30).

**Autograd accounting** (what PyTorch really holds on this device, measured to within 1 %):
weights + gradients + optimizer state + buffers + input + the peak of a plain forward and
backward, computed from the chain: autograd keeps fewer tensors than "every layer output"
(in-place ReLU shares BatchNorm's output, a convolution saves only its input) and frees each
stage's graph as the backward passes it.

Pure: numbers in (a :class:`~edgetrain.core.chain.Chain`), numbers out.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgetrain.core.accounting import optimizer_state_bytes
from edgetrain.core.chain import Chain
from edgetrain.core.simulator import simulate
from edgetrain.errors import InvalidInput
from edgetrain.planners.sequential import sequential
from edgetrain.units import MB_PAPER

ACCOUNTINGS = ("paper", "autograd")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a training step needs, by term.

    Attributes:
        weights_bytes: parameters.
        gradients_bytes: parameter gradients.
        optimizer_bytes: optimizer state.
        activations_bytes: paper: layer outputs; autograd: the peak of everything the forward and
            backward hold at once (saved tensors, activation gradients, transients).
        activation_gradients_bytes: paper: the layer outputs' gradients; autograd: 0 (in the peak).
        other_bytes: buffers (BatchNorm statistics) and the input; 0 in the paper's accounting.
        accounting: "paper" or "autograd".
    """

    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    activation_gradients_bytes: int
    other_bytes: int
    accounting: str

    @property
    def total_bytes(self) -> int:
        """Everything the step needs at its peak."""
        return (
            self.weights_bytes
            + self.gradients_bytes
            + self.optimizer_bytes
            + self.activations_bytes
            + self.activation_gradients_bytes
            + self.other_bytes
        )

    @property
    def fixed_bytes(self) -> int:
        """The part that does not depend on the batch: weights, gradients, optimizer state."""
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes


def paper_estimate(chain: Chain) -> MemoryEstimate:
    """The paper's accounting for the batch ``chain`` was profiled with."""
    weights = chain.weight_bytes
    layers = chain.layer_output_bytes
    return MemoryEstimate(weights, weights, 2 * weights, layers, layers, 0, "paper")


def autograd_estimate(chain: Chain, optimizer: str = "adam") -> MemoryEstimate:
    """What plain autograd holds at its peak, by the chain's measured or analytic costs, in a step
    after the first whose gradients exist (``zero_grad(set_to_none=False)``; with PyTorch's
    default ``zero_grad()`` the gradients are created during the step, which needs no more)."""
    peak = simulate(chain, sequential(chain, 1), grads_exist=True).peak_bytes
    return MemoryEstimate(
        weights_bytes=chain.weight_bytes,
        gradients_bytes=chain.gradient_bytes,
        optimizer_bytes=optimizer_state_bytes(chain, optimizer),
        activations_bytes=peak,
        activation_gradients_bytes=0,
        other_bytes=chain.buffer_bytes + chain.input_bytes,
        accounting="autograd",
    )


def estimate(chain: Chain, accounting: str = "paper", optimizer: str = "adam") -> MemoryEstimate:
    """:func:`paper_estimate` or :func:`autograd_estimate` by name."""
    if accounting == "paper":
        return paper_estimate(chain)
    if accounting == "autograd":
        return autograd_estimate(chain, optimizer)
    raise InvalidInput(f"unknown accounting {accounting!r}; choose one of {', '.join(ACCOUNTINGS)}")


# The paper's tables (MB = 2**20 bytes). Table I: image 224, by batch. Table II: batch 1, by image.
# Table III: batch 8, by image, in GB (2**30 bytes).
PAPER_DEPTHS = (18, 34, 50, 101, 152)
TABLE_I: dict[int, dict[int, float]] = {
    18: {1: 230.05, 3: 340.05, 5: 450.06, 10: 725.07, 30: 1825.13, 50: 2925.18},
    34: {1: 413.00, 3: 580.42, 5: 747.85, 10: 1166.42, 30: 2840.70, 50: 4514.97},
    50: {1: 620.27, 3: 1091.11, 5: 1561.94, 10: 2739.04, 30: 7447.42, 50: 12155.79},
    101: {1: 1027.21, 3: 1732.33, 5: 2437.45, 10: 4200.25, 30: 11251.43, 50: 18302.62},
    152: {1: 1410.62, 3: 2405.14, 5: 3399.67, 10: 5885.98, 30: 15831.23, 50: 25776.48},
}
TABLE_II: dict[int, dict[int, float]] = {
    18: {224: 230.05, 350: 309.83, 500: 449.21, 650: 639.07, 1100: 1496.10, 1500: 2628.70},
    34: {224: 413.00, 350: 534.96, 500: 749.73, 650: 1039.08, 1100: 2346.95, 1500: 4075.07},
    50: {224: 620.27, 350: 964.66, 500: 1570.93, 650: 2387.54, 1100: 6073.06, 1500: 10944.42},
    101: {224: 1027.21, 350: 1543.72, 500: 2472.72, 650: 3682.00, 1100: 9208.30, 1500: 16515.11},
    152: {224: 1410.62, 350: 2139.75, 500: 3458.50, 650: 5161.76, 1100: 12961.96, 1500: 23277.27},
}
TABLE_III_GB: dict[int, dict[int, float]] = {
    18: {224: 0.60, 350: 1.22, 500: 2.31, 650: 3.79},
    34: {224: 0.98, 350: 1.93, 500: 3.60, 650: 5.86},
    50: {224: 2.22, 350: 4.90, 500: 9.63, 650: 15.99},
    101: {224: 3.41, 350: 7.45, 500: 14.69, 650: 24.13},
    152: {224: 4.78, 350: 10.47, 500: 20.76, 650: 34.06},
}


def paper_cells() -> list[tuple[str, int, int, int, float]]:
    """Every cell of Tables I-III: (table, depth, batch, image, MB)."""
    cells: list[tuple[str, int, int, int, float]] = []
    for depth in PAPER_DEPTHS:
        cells += [("I", depth, b, 224, mb) for b, mb in TABLE_I[depth].items()]
        cells += [("II", depth, 1, s, mb) for s, mb in TABLE_II[depth].items()]
        cells += [("III", depth, 8, s, gb * 1024) for s, gb in TABLE_III_GB[depth].items()]
    return cells


def paper_value_mb(depth: int, batch: int, image: int) -> float | None:
    """The paper's number for this cell in MB, if one of its tables has it."""
    if depth not in TABLE_I:
        return None
    if image == 224 and batch in TABLE_I[depth]:
        return TABLE_I[depth][batch]
    if batch == 1 and image in TABLE_II[depth]:
        return TABLE_II[depth][image]
    if batch == 8 and image in TABLE_III_GB[depth]:
        return TABLE_III_GB[depth][image] * 1024
    return None


def to_mb(size: float) -> float:
    """Bytes to the paper's MB (2**20 bytes)."""
    return size / MB_PAPER
