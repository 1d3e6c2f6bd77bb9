"""Hostile JSON (non-finite, huge or deeply nested numbers, oversized files) is one line naming
the file and the problem, for every kind of file edgetrain reads, and exit 2 on the CLI."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgetrain import jsonfile
from edgetrain.cli.main import cli
from edgetrain.core.chain import Chain, uniform_chain
from edgetrain.core.schedule import Schedule
from edgetrain.errors import CorruptFile
from edgetrain.planners.optimal import store_all


def _plan_text() -> str:
    return json.dumps(store_all(uniform_chain(4)).to_dict())


def _with_length(text: str, length: str) -> str:
    return text.replace('"length": 4', f'"length": {length}')


HOSTILE = {
    "infinity": (lambda: _with_length(_plan_text(), "Infinity"), "Infinity"),
    "nan": (lambda: _with_length(_plan_text(), "NaN"), "NaN"),
    "overflowing float": (lambda: _with_length(_plan_text(), "1e400"), "not finite"),
    "5000 digits": (lambda: _with_length(_plan_text(), "9" * 5000), "5000 digits"),
    "1e23": (lambda: _with_length(_plan_text(), "1e23"), "1e23"),
    "deep nesting": (lambda: "[" * 200_000 + "]" * 200_000, "deeper than 64"),
    "moderate nesting": (lambda: "[" * 500 + "]" * 500, "deeper than 64"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_plan_is_one_line_naming_the_file(tmp_path: Path, case: str) -> None:
    make, problem = HOSTILE[case]
    path = tmp_path / "plan.json"
    path.write_text(make())
    with pytest.raises(CorruptFile) as caught:
        Schedule.load(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and problem in message


def test_an_operation_index_of_1e23_in_a_checksummed_plan_is_refused(tmp_path: Path) -> None:
    data = store_all(uniform_chain(4)).to_dict()
    ops = data["ops"].split()
    ops[0] = ops[0].rstrip("0123456789") + "1" + "0" * 23
    data["ops"] = " ".join(ops)
    data["sha256"] = hashlib.sha256(data["ops"].encode()).hexdigest()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CorruptFile, match="index beyond any chain") as caught:
        Schedule.load(path)
    assert str(path) in str(caught.value)


def test_a_file_above_the_size_limit_is_refused_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "plan.json"
    path.write_text(_plan_text())
    monkeypatch.setattr(jsonfile, "MAX_FILE_BYTES", 100)
    read: list[object] = []
    real_open = open

    def spying_open(file: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        handle = real_open(file, mode, *args, **kwargs)  # type: ignore[call-overload]
        original = handle.read

        def counted(*a: object) -> object:
            read.append(a)
            return original(*a)

        handle.read = counted
        return handle

    monkeypatch.setattr("builtins.open", spying_open)
    with pytest.raises(CorruptFile, match="MiB") as caught:
        Schedule.load(path)
    assert str(path) in str(caught.value) and read == []


def test_a_sparse_file_of_a_gigabyte_is_refused_without_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    with open(path, "wb") as handle:
        handle.truncate(2**30)  # sparse: no disk used, 1 GiB by stat
    with pytest.raises(CorruptFile, match="1024 MiB, above the 64 MiB"):
        Schedule.load(path)


def test_a_hostile_chain_is_one_line() -> None:
    text = Chain.to_json(uniform_chain(3)).replace('"input_bytes": 1', '"input_bytes": 1e400')
    assert "1e400" in text
    with pytest.raises(CorruptFile, match="chain holds the number 1e400"):
        Chain.from_json(text)
    with pytest.raises(CorruptFile, match="deeper than 64"):
        Chain.from_json("[" * 200_000 + "]" * 200_000)


def test_graphs_and_device_profiles_go_through_the_same_limits(tmp_path: Path) -> None:
    from edgetrain import devices
    from edgetrain.devices import energy
    from edgetrain.planners.poet import graph

    path = tmp_path / "file.json"
    path.write_text('{"format": "edgetrain-graph-v1", "nodes": [' + "9" * 5000 + "]}")
    for load in (graph.load, devices.load, energy.load):
        with pytest.raises(CorruptFile, match="5000 digits") as caught:
            load(str(path))
        assert str(path) in str(caught.value)


def test_edgetrains_own_files_stay_within_the_limits(tmp_path: Path) -> None:
    chain = uniform_chain(30, activation_bytes=2**40)
    schedule = store_all(chain)
    schedule.save(tmp_path / "plan.json")
    assert list(Schedule.load(tmp_path / "plan.json")) == list(schedule)
    assert Chain.from_json(chain.to_json()) == chain


@pytest.mark.parametrize("case", ["infinity", "5000 digits", "deep nesting"])
def test_the_cli_refuses_a_hostile_plan_with_exit_2(tmp_path: Path, case: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(HOSTILE[case][0]())
    result = CliRunner().invoke(
        cli, ["train", "--model", "resnet18", "--batch", "1", "--image", "64", "--plan", str(path)]
    )
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    assert HOSTILE[case][1] in result.output and str(path) in result.output.replace("\n", "")
