"""What tiling needs to know about a torch model: its layers as pure :class:`Layer` data (torch).

A tileable model is an ``nn.Sequential`` whose children each hold at most one window — a
``Conv2d`` (zero padding), ``MaxPool2d`` or ``AvgPool2d`` (floor mode) — followed by any number
of ``BatchNorm2d`` and element-wise activations. Anything else (a ``Linear``, a flatten, dropout,
a batch norm before the window) raises :class:`InvalidInput` naming the layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from edgetrain.errors import InvalidInput
from edgetrain.tiles.tiling import Layer, Network, Window

ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.Identity,
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Hardtanh,
)
"""Activations that act on each element alone, so tiles compute them exactly."""

WINDOWS: tuple[type[nn.Module], ...] = (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)


@dataclass(frozen=True)
class LayerOps:
    """One child of the model split into its window (or None) and the element-wise ops after it."""

    window: nn.Module | None
    after: tuple[nn.Module, ...]


def _leaves(module: nn.Module) -> Iterator[nn.Module]:
    if isinstance(module, nn.Sequential):
        for child in module:
            yield from _leaves(child)
    else:
        yield module


def _pair(value: int | tuple[int, ...] | str, what: str, label: str) -> tuple[int, int]:
    if isinstance(value, str):
        raise InvalidInput(f"{label} uses {what}={value!r}; give explicit integer {what} instead")
    if isinstance(value, int):
        return (value, value)
    return (int(value[0]), int(value[1]))


def split_layer(child: nn.Module, index: int) -> LayerOps:
    """The window and the element-wise ops of child ``index``; InvalidInput if not tileable."""
    label = f"layer {index} ({type(child).__name__})"
    window: nn.Module | None = None
    after: list[nn.Module] = []
    for leaf in _leaves(child):
        if isinstance(leaf, WINDOWS):
            if window is not None or any(isinstance(x, nn.BatchNorm2d) for x in after):
                raise InvalidInput(
                    f"{label} has a second window or a batch norm before its window; split it "
                    "into one child per convolution or pooling"
                )
            window = leaf
        elif isinstance(leaf, (nn.BatchNorm2d, *ELEMENTWISE)):
            after.append(leaf)
        else:
            raise InvalidInput(
                f"{label} contains {type(leaf).__name__}, which tiles cannot split; tile only the "
                "convolutional front (conv, pooling, batch norm, activations)"
            )
    if isinstance(window, nn.Conv2d) and window.padding_mode != "zeros":
        raise InvalidInput(f"{label} pads with {window.padding_mode!r}; only zero padding tiles")
    if isinstance(window, nn.MaxPool2d | nn.AvgPool2d) and window.ceil_mode:
        raise InvalidInput(f"{label} uses ceil_mode; tiles need floor mode (ceil_mode=False)")
    if isinstance(window, nn.MaxPool2d) and window.return_indices:
        raise InvalidInput(f"{label} returns indices; tiles need return_indices=False")
    if isinstance(window, nn.AvgPool2d) and (
        window.divisor_override is not None or not window.count_include_pad
    ):
        raise InvalidInput(
            f"{label} averages without counting padding; use count_include_pad=True, "
            "divisor_override=None"
        )
    return LayerOps(window, tuple(after))


def _describe(ops: LayerOps, name: str, index: int, channels: int) -> tuple[Layer, int]:
    label = f"layer {index} ({name})"
    window = ops.window
    rows = cols = Window()
    out_channels = channels
    macs = 0
    kind = "pointwise"
    if isinstance(window, nn.Conv2d):
        if window.in_channels != channels:
            raise InvalidInput(
                f"{label} expects {window.in_channels} channels but gets {channels}; fix the model"
            )
        kh, kw = _pair(window.kernel_size, "kernel_size", label)
        sh, sw = _pair(window.stride, "stride", label)
        ph, pw = _pair(window.padding, "padding", label)  # type: ignore[arg-type]
        dh, dw = _pair(window.dilation, "dilation", label)
        rows, cols = Window(kh, sh, ph, dh), Window(kw, sw, pw, dw)
        out_channels = window.out_channels
        macs = out_channels * (channels // window.groups) * kh * kw
        kind = "conv"
    elif isinstance(window, nn.MaxPool2d | nn.AvgPool2d):
        kh, kw = _pair(window.kernel_size, "kernel_size", label)
        stride = window.stride if window.stride is not None else window.kernel_size
        sh, sw = _pair(stride, "stride", label)
        ph, pw = _pair(window.padding, "padding", label)
        dilation = window.dilation if isinstance(window, nn.MaxPool2d) else 1
        dh, dw = _pair(dilation, "dilation", label)
        rows, cols = Window(kh, sh, ph, dh), Window(kw, sw, pw, dw)
        macs = channels * kh * kw
        kind = "pool"
    batchnorm = False
    for op in ops.after:
        if isinstance(op, nn.BatchNorm2d):
            if op.num_features != out_channels:
                raise InvalidInput(
                    f"{label} normalises {op.num_features} channels but has {out_channels}"
                )
            batchnorm = batchnorm or op.training or not op.track_running_stats
            macs += 2 * out_channels
        else:
            macs += out_channels
    return Layer(name, kind, channels, out_channels, rows, cols, macs, batchnorm, 0), out_channels


def describe(model: nn.Sequential, channels: int, height: int, width: int) -> Network:
    """The pure :class:`Network` of ``model`` for a ``channels`` × ``height`` × ``width`` input."""
    if not isinstance(model, nn.Sequential):
        raise InvalidInput(
            f"tiling needs an nn.Sequential of layers, got {type(model).__name__}; wrap the layers"
        )
    layers = []
    image_channels = channels
    for index, (name, child) in enumerate(model.named_children()):
        layer, channels = _describe(split_layer(child, index), name, index, channels)
        tensors = tuple(p.numel() for p in child.parameters() if p.requires_grad)
        layers.append(
            Layer(
                layer.name,
                layer.kind,
                layer.in_channels,
                layer.out_channels,
                layer.rows,
                layer.cols,
                layer.macs_per_pixel,
                layer.batchnorm,
                sum(tensors),
                tensors,
            )
        )
    return Network(tuple(layers), image_channels, height, width)


def model_ops(model: nn.Sequential) -> tuple[LayerOps, ...]:
    """Every child of ``model`` split by :func:`split_layer`."""
    return tuple(split_layer(child, i) for i, child in enumerate(model.children()))
