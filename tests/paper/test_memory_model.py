"""The memory model: every cell of the paper's Tables I-III within ±5 %, and the autograd
accounting within ±10 % of a real measured step."""

import functools

import pytest

from edgetrain.models import model_chain
from edgetrain.paper.measured_step import measure_training_step
from edgetrain.paper.memory_model import (
    TABLE_I,
    TABLE_II,
    TABLE_III_GB,
    autograd_estimate,
    paper_cells,
    paper_estimate,
    paper_value_mb,
    to_mb,
)


@functools.cache
def chain_of(depth: int, batch: int, image: int):
    return model_chain(f"resnet{depth}", batch, image, timing=False)


def test_the_tables_are_transcribed_whole():
    assert len(paper_cells()) == 5 * 6 + 5 * 6 + 5 * 4 == 80
    assert TABLE_I[152][50] == 25776.48 and TABLE_II[18][1500] == 2628.70
    assert TABLE_III_GB[101][650] == 24.13
    assert paper_value_mb(50, 8, 500) == 9.63 * 1024
    assert paper_value_mb(50, 7, 500) is None


@pytest.mark.parametrize(("table", "depth", "batch", "image", "paper_mb"), paper_cells())
def test_every_cell_of_tables_I_to_III_within_5_percent(table, depth, batch, image, paper_mb):
    ours = to_mb(paper_estimate(chain_of(depth, batch, image)).total_bytes)
    assert ours == pytest.approx(paper_mb, rel=0.05), (table, depth, batch, image)


def test_the_accounting_is_four_weights_plus_twice_the_layer_outputs():
    chain = chain_of(50, 3, 224)
    estimate = paper_estimate(chain)
    assert estimate.fixed_bytes == 4 * chain.weight_bytes
    assert estimate.total_bytes == 4 * chain.weight_bytes + 2 * chain.layer_output_bytes
    # Batch only scales the activations.
    assert chain_of(50, 1, 224).layer_output_bytes * 3 == chain.layer_output_bytes


@pytest.mark.parametrize(("name", "batch", "image"), [("resnet18", 2, 64), ("resnet50", 1, 96)])
def test_autograd_accounting_is_within_10_percent_of_a_measured_step(name, batch, image):
    predicted = autograd_estimate(model_chain(name, batch, image, timing=False), "adam")
    measured = measure_training_step(name, batch, image, "adam")
    assert measured == pytest.approx(predicted.total_bytes, rel=0.10)
