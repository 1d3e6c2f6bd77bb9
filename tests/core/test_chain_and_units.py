from dataclasses import replace

import pytest

from edgetrain.core.chain import Chain, Stage, uniform_chain
from edgetrain.errors import CorruptFile, InvalidInput
from edgetrain.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GB", 2 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5 GiB", int(1.5 * 2**30)),
        ("4096", 4096),
        (1e9, 10**9),
        ("3k", 3000),
    ],
)
def test_parse_bytes_reads_decimal_and_binary_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["2XB", "", "GB", "-5MB", "0", "1.2.3MB"])
def test_parse_bytes_rejects_nonsense_with_the_accepted_forms(text):
    with pytest.raises(InvalidInput, match=r"e\.g\."):
        parse_bytes(text)


@pytest.mark.parametrize("value", ["1e999", "1e400GB", float("inf"), float("nan")])
def test_parse_bytes_rejects_sizes_that_are_not_finite(value):
    with pytest.raises(InvalidInput, match="not a finite number of bytes"):
        parse_bytes(value)


def test_format_bytes_uses_binary_prefixes():
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(2**31) == "2.00 GiB"
    assert format_bytes(12) == "12 B"


def test_chain_round_trips_through_json_and_rejects_garbage():
    chain = uniform_chain(4, activation_bytes=8)
    again = Chain.from_dict(chain.to_dict())
    assert again == chain
    assert Chain.from_json(chain.to_json()) == chain
    with pytest.raises(CorruptFile, match="not valid JSON"):
        Chain.from_json("{")
    with pytest.raises(CorruptFile):
        Chain.from_dict({"stages": [{"name": "x"}]})
    measured = replace(chain, autograd_peak_bytes=(120, 96))  # what a profile measured
    assert Chain.from_json(measured.to_json()) == measured
    with pytest.raises(CorruptFile):
        Chain.from_dict({**measured.to_dict(), "autograd_peak_bytes": [1]})


def test_buffer_copies_round_trip_and_a_chain_written_without_them_copies_its_own_buffers():
    # A stage that runs a BatchNorm an earlier stage ran first: its buffers are counted there.
    stage = replace(uniform_chain(1).stages[0], buffer_bytes=0, copied_buffer_bytes=136)
    chain = Chain((stage,), input_bytes=1)
    assert Chain.from_json(chain.to_json()) == chain
    assert chain.stages[0].recompute_buffer_bytes == 136
    written_before = chain.to_dict()
    del written_before["stages"][0]["copied_buffer_bytes"]
    written_before["stages"][0]["buffer_bytes"] = 64
    assert Chain.from_dict(written_before).stages[0].recompute_buffer_bytes == 64


def test_chain_rejects_negative_costs_and_empty_chains():
    stage = uniform_chain(1).stages[0]
    bad = Stage(**{**stage.__dict__, "output_bytes": -1})
    with pytest.raises(InvalidInput, match="negative output_bytes"):
        Chain((bad,), input_bytes=1)
    with pytest.raises(InvalidInput):
        Chain((), input_bytes=1)


def test_chain_totals_add_up_its_stages():
    chain = uniform_chain(5, activation_bytes=3, forward_seconds=2.0, backward_seconds=1.0)
    assert chain.forward_seconds == 10.0
    assert chain.backward_seconds == 5.0
    assert chain.activation_bytes(0) == 3
    assert chain.gradient_of_activation_bytes(0) == 0
    assert chain.gradient_of_activation_bytes(5) == 3
