"""Third-party models built from their configs, small: the zoo that the tests and
``benchmarks/zoo.py`` train with ``Checkpointed``.

Each :class:`ZooModel` builds one model of torchvision, timm or Hugging Face transformers from a
config (no weights are downloaded) at a size that trains in well under a second a step on a
CPU, and makes its usual input: an image batch for torchvision and timm models, the keyword
arguments a Hugging Face model takes (``input_ids``, ``attention_mask``, ``labels``,
``pixel_values``) as a dict, called ``model(**inputs)``. The libraries are imported through
:mod:`edgetrain.models.thirdparty` (the ``zoo`` extra).

``blocks`` names the classes of a model's repeated blocks (residual blocks, transformer layers):
where ``torch.utils.checkpoint`` goes when a user checkpoints "each block".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from edgetrain.models import thirdparty

Inputs = torch.Tensor | dict[str, torch.Tensor]


@dataclass(frozen=True)
class ZooModel:
    """One model of the zoo: its library, what it is, how to build it and its input.

    ``make(size)`` builds it for inputs of ``size`` (float32, seeded by the caller; a ViT's
    image side, a language model's context; most ignore it); ``inputs(batch, size)`` makes an input
    of ``batch`` images of side ``size`` or sequences of ``size`` tokens (a tensor, or a dict of
    keyword arguments); ``blocks``: class names of its repeated blocks; ``input_names``: the
    keyword inputs it takes (empty: one positional image batch)."""

    name: str
    library: str
    description: str
    make: Callable[[int], nn.Module]
    inputs: Callable[[int, int], Inputs]
    blocks: tuple[str, ...]
    input_names: tuple[str, ...] = ()

    @property
    def takes_tokens(self) -> bool:
        """Whether its input is token ids (``size`` is then a sequence length)."""
        return "input_ids" in self.input_names


VOCAB = 128
CLASSES = 10


def _images(batch: int, size: int) -> torch.Tensor:
    return torch.randn(batch, 3, size, size)


def _tokens(batch: int, size: int, labels: str | None = "tokens") -> dict[str, torch.Tensor]:
    """Token ids, an attention mask whose last sequence ends in two padding tokens, and labels:
    the ids themselves (a language model's, shifted inside it), or one class per sequence."""
    ids = torch.randint(0, VOCAB, (batch, size))
    mask = torch.ones(batch, size, dtype=torch.long)
    mask[-1, -2:] = 0
    out = {"input_ids": ids, "attention_mask": mask}
    if labels == "tokens":
        out["labels"] = ids.clone()
    elif labels == "classes":
        out["labels"] = torch.randint(0, 3, (batch,))
    return out


def _pixels(batch: int, size: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": _images(batch, size), "labels": torch.randint(0, CLASSES, (batch,))}


# -- torchvision -----------------------------------------------------------------------------------


def _resnet(size: int) -> nn.Module:
    tv = thirdparty.torchvision()
    block = tv.models.resnet.BasicBlock
    return tv.models.ResNet(block, [1, 1, 1, 1], num_classes=CLASSES)


def _mobilenet_v3(size: int) -> nn.Module:
    tv = thirdparty.torchvision()
    conf = tv.models.mobilenetv3.InvertedResidualConfig
    setting = [  # MobileNetV3-Small's first four blocks, at half width
        conf(16, 3, 16, 16, True, "RE", 2, 1, 0.5),
        conf(16, 3, 72, 24, False, "RE", 2, 1, 0.5),
        conf(24, 3, 88, 24, False, "RE", 1, 1, 0.5),
        conf(24, 5, 96, 40, True, "HS", 2, 1, 0.5),
    ]
    return tv.models.MobileNetV3(setting, last_channel=128, num_classes=CLASSES)


def _swin(size: int) -> nn.Module:
    tv = thirdparty.torchvision()
    return tv.models.SwinTransformer(
        patch_size=[4, 4],
        embed_dim=16,
        depths=[2, 2],
        num_heads=[1, 2],
        window_size=[2, 2],
        stochastic_depth_prob=0.1,
        num_classes=CLASSES,
    )


# -- timm ------------------------------------------------------------------------------------------


def _mobilevit(size: int) -> nn.Module:
    return thirdparty.timm().create_model("mobilevit_xxs", num_classes=CLASSES)


def _convnext(size: int) -> nn.Module:
    return thirdparty.timm().create_model(
        "convnext_atto", depths=(1, 1, 1, 1), dims=(16, 32, 64, 128), num_classes=CLASSES
    )


def _efficientnet(size: int) -> nn.Module:
    return thirdparty.timm().create_model("test_efficientnet", num_classes=CLASSES)


def _timm_vit(size: int) -> nn.Module:
    return thirdparty.timm().create_model(
        "vit_tiny_patch16_224",
        img_size=size,
        patch_size=8,
        embed_dim=48,
        depth=2,
        num_heads=2,
        num_classes=CLASSES,
    )


# -- Hugging Face transformers ---------------------------------------------------------------


ATTENTION = "eager"
"""The zoo's Hugging Face attention: "eager" (matrix products and softmax); the ``-sdpa``
models use "sdpa" (``F.scaled_dot_product_attention``, transformers' default)."""


def _bert(size: int, attention: str = ATTENTION) -> nn.Module:
    tr = thirdparty.transformers()
    config = tr.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=max(64, size),
        num_labels=3,
        attn_implementation=attention,
    )
    return tr.BertForSequenceClassification(config)


def _gpt2(size: int, attention: str = ATTENTION) -> nn.Module:
    tr = thirdparty.transformers()
    config = tr.GPT2Config(
        vocab_size=VOCAB,
        n_positions=max(64, size),
        n_embd=32,
        n_layer=2,
        n_head=2,
        use_cache=False,
        attn_implementation=attention,
    )
    return tr.GPT2LMHeadModel(config)


def _hf_vit(size: int) -> nn.Module:
    tr = thirdparty.transformers()
    config = tr.ViTConfig(
        image_size=size,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=CLASSES,
        attn_implementation=ATTENTION,
    )
    return tr.ViTForImageClassification(config)


def _llama(size: int, attention: str = ATTENTION) -> nn.Module:
    tr = thirdparty.transformers()
    config = tr.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(64, size),
        use_cache=False,
        attn_implementation=attention,
    )
    return tr.LlamaForCausalLM(config)


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update: ``base(x) + scale * up(down(x))``
    (LoRA, Hu et al. 2021). ``up`` starts small rather than at zero, so that both adapter
    matrices get a gradient from the first step (with zeros, ``down``'s gradient is zero)."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.down.weight, a=math.sqrt(5))
        nn.init.normal_(self.up.weight, std=0.02)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x)) * self.scale


def add_lora(model: nn.Module, targets: tuple[str, ...], rank: int = 4) -> nn.Module:
    """Freeze ``model`` and wrap each ``nn.Linear`` whose attribute name is in ``targets``
    (``q_proj``, ``v_proj``) in a :class:`LoRALinear`: only the adapters train."""
    model.requires_grad_(False)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(parent, name, LoRALinear(child, rank))
    return model


def _llama_lora(size: int) -> nn.Module:
    return add_lora(_llama(size), ("q_proj", "v_proj"))


def _lm_inputs(batch: int, size: int) -> Inputs:
    """A causal language model's: token ids, the attention mask (the last sequence padded) and
    labels, the ids themselves."""
    return _tokens(batch, size)


def _classifier_inputs(batch: int, size: int) -> Inputs:
    return _tokens(batch, size, labels="classes")


def _sdpa(make: Callable[..., nn.Module]) -> Callable[[int], nn.Module]:
    return functools.partial(make, attention="sdpa")


TOKENS = ("input_ids", "attention_mask", "labels")
ZOO: dict[str, ZooModel] = {
    model.name: model
    for model in (
        ZooModel("tv-resnet", "torchvision", "ResNet, BasicBlock x [1, 1, 1, 1]", _resnet,
                 _images, ("BasicBlock",)),
        ZooModel("tv-mobilenet-v3", "torchvision",
                 "MobileNetV3-Small's first 4 blocks, width 0.5 (squeeze-excite, hardswish)",
                 _mobilenet_v3, _images, ("InvertedResidual",)),
        ZooModel("tv-swin", "torchvision",
                 "Swin Transformer, 2 stages of 2 blocks, shifted 2x2 windows, stochastic depth",
                 _swin, _images, ("SwinTransformerBlock",)),
        ZooModel("timm-mobilevit", "timm", "MobileViT-XXS (timm mobilevit_xxs)", _mobilevit,
                 _images, ("BottleneckBlock", "MobileVitBlock")),
        ZooModel("timm-convnext", "timm", "ConvNeXt-Atto's layout, 1 block a stage, dims 16-128",
                 _convnext, _images, ("ConvNeXtBlock",)),
        ZooModel("timm-efficientnet", "timm",
                 "timm test_efficientnet (edge residual, inverted residual + SE, BatchNormAct2d)",
                 _efficientnet, _images, ("EdgeResidual", "InvertedResidual")),
        ZooModel("timm-vit", "timm", "ViT (timm), 2 blocks, dim 48, 8x8 patches",
                 _timm_vit, _images, ("Block",)),
        ZooModel("hf-bert", "transformers", "BertForSequenceClassification, 2 layers, dim 32",
                 _bert, _classifier_inputs, ("BertLayer",), TOKENS),
        ZooModel("hf-bert-sdpa", "transformers", "the BERT above, sdpa attention",
                 _sdpa(_bert), _classifier_inputs, ("BertLayer",), TOKENS),
        ZooModel("hf-gpt2", "transformers", "GPT2LMHeadModel, 2 layers, dim 32", _gpt2,
                 _lm_inputs, ("GPT2Block",), TOKENS),
        ZooModel("hf-gpt2-sdpa", "transformers", "the GPT-2 above, sdpa attention",
                 _sdpa(_gpt2), _lm_inputs, ("GPT2Block",), TOKENS),
        ZooModel("hf-vit", "transformers", "ViTForImageClassification, 2 layers, dim 32",
                 _hf_vit, _pixels, ("ViTLayer",), ("pixel_values", "labels")),
        ZooModel("hf-llama", "transformers",
                 "LlamaForCausalLM, 2 layers, dim 32, grouped-query attention, RoPE",
                 _llama, _lm_inputs, ("LlamaDecoderLayer",), TOKENS),
        ZooModel("hf-llama-sdpa", "transformers", "the Llama above, sdpa attention",
                 _sdpa(_llama), _lm_inputs, ("LlamaDecoderLayer",), TOKENS),
        ZooModel("hf-llama-lora", "transformers",
                 "the Llama above frozen, rank-4 LoRA adapters on q_proj and v_proj",
                 _llama_lora, _lm_inputs, ("LlamaDecoderLayer",), TOKENS),
    )
}  # fmt: skip


def loss_of(output: Any) -> torch.Tensor:
    """A step's loss: the model's own (a Hugging Face output given ``labels``), else the mean
    square of its output (tensor, or an output object's ``logits``)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    logits = getattr(output, "logits", output)
    return logits.float().square().mean()


def call(model: nn.Module, inputs: Inputs) -> Any:
    """``model(**inputs)`` for keyword inputs, else ``model(inputs)``."""
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def as_dtype(inputs: Inputs, dtype: torch.dtype) -> Inputs:
    """The input with its floating-point tensors in ``dtype`` (ids and masks as they are)."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    if isinstance(inputs, dict):
        return {k: cast(v) for k, v in inputs.items()}
    return cast(inputs)
