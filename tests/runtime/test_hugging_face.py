"""Hugging Face transformers models, built from small configs, train under Checkpointed as
plain autograd trains them: keyword inputs (``input_ids``, ``attention_mask``, ``labels``), the
model's own output object with its loss, dropout on, float64, gradients bitwise equal at the
least memory and at a middle budget."""

import copy
import os

import pytest
import torch

from edgetrain.frontend.cuts import as_stages, stage_input
from edgetrain.frontend.profiling import analytic_chain
from edgetrain.models import thirdparty
from edgetrain.runtime.checkpointed import Checkpointed

transformers = pytest.importorskip("transformers")  # the zoo extra
tf = thirdparty.transformers()

SMALL = {"num_hidden_layers": 2, "num_attention_heads": 4, "attn_implementation": "eager"}


def _bert():
    config = tf.BertConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, max_position_embeddings=32, **SMALL
    )
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0  # padding: the mask is an input, not a constant
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1])}
    return tf.BertForSequenceClassification(config), inputs


def _gpt2():
    config = tf.GPT2Config(
        vocab_size=64, n_embd=16, n_layer=2, n_head=4, n_positions=32, use_cache=False,
        attn_implementation="eager",
    )  # fmt: skip
    ids = torch.randint(0, 64, (2, 12))
    return tf.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}


def _llama():
    # One decoder layer: its RMSNorms and rotary embedding cut into twice the stages of the
    # others' layers (the zoo test trains the two-layer Llama at the least memory).
    config = tf.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, max_position_embeddings=32,
        num_key_value_heads=2, use_cache=False, attention_dropout=0.1,
        **{**SMALL, "num_hidden_layers": 1},
    )  # fmt: skip
    ids = torch.randint(0, 64, (2, 12))
    return tf.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


def _vit():
    config = tf.ViTConfig(
        image_size=16, patch_size=4, hidden_size=16, intermediate_size=32, num_labels=3,
        hidden_dropout_prob=0.1, **SMALL,
    )  # fmt: skip
    inputs = {"pixel_values": torch.randn(2, 3, 16, 16), "labels": torch.tensor([0, 2])}
    return tf.ViTForImageClassification(config), inputs


MODELS = {"bert": _bert, "gpt2": _gpt2, "llama": _llama, "vit": _vit}


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_hugging_face_model_trains_bitwise_at_the_least_memory_and_a_middle_budget(name):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model = model.double().train()
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    stages = as_stages(copy.deepcopy(model), inputs)
    chain = analytic_chain(stages, stage_input(stages, inputs))
    assert chain.length > 8  # cut between and inside the layers
    plain = copy.deepcopy(model)
    torch.manual_seed(5)
    expected = plain(**inputs)
    expected.loss.backward()
    budget: int | str = "min"
    for _ in range(2 if os.environ.get("EDGETRAIN_FULL_ZOO") == "1" else 1):
        twin = copy.deepcopy(model)
        net = Checkpointed(twin, inputs, memory_budget=budget, chain=chain)
        torch.manual_seed(5)
        out = net(**inputs)
        assert type(out) is type(expected)
        assert torch.equal(out.loss, expected.loss) and torch.equal(out.logits, expected.logits)
        out.loss.backward()
        for (p, a), b in zip(plain.named_parameters(), twin.parameters(), strict=True):
            assert (a.grad is None) == (b.grad is None), p
            assert a.grad is None or torch.equal(a.grad, b.grad), p
        # then half way between the least memory and storing everything
        budget = net.fixed_bytes + (net.cost.peak_bytes + net.plain_cost.peak_bytes) // 2
