"""Every stored benchmark result says where it was measured (machine, torch version, commit), and
every benchmark's ``--json`` output carries that record."""

import importlib.metadata
import importlib.util
import json
import re
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
DATA = BENCHMARKS / "data"
INPUTS = {"resnet18_cifar_a72.json", "vgg16_cifar_a72.json"}  # POET's instances: inputs
HEADER = re.compile(r"# measured at [0-9a-f]{7,} with torch \d+\.\d+\S*.* on a .+")
COMMITS = re.compile(r"[0-9a-f]{7,}(, [0-9a-f]{7,})*")


@pytest.mark.parametrize(
    "path",
    sorted(p for p in DATA.iterdir() if p.name not in INPUTS),
    ids=lambda p: p.name,
)
def test_a_stored_result_names_its_machine_torch_version_and_commit(path):
    if path.suffix == ".json":
        record = json.loads(path.read_text())["measured_on"]
        assert record["machine"] and record["torch"] and record["commit"] and record["command"]
        commit = record["commit"]
        commits = commit.values() if isinstance(commit, dict) else [commit]
        assert all(COMMITS.fullmatch(c) for c in commits), commit
    else:
        lines = path.read_text().splitlines()
        headers = [line for line in lines if line.startswith("# measured at")]
        assert lines[0] in headers and all(HEADER.fullmatch(line) for line in headers), headers


def test_json_output_carries_where_it_was_measured(capsys):
    spec = importlib.util.spec_from_file_location("_common", BENCHMARKS / "_common.py")
    assert spec is not None and spec.loader is not None
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    common.emit("t", ["a"], [{"a": 1}], True)
    record = json.loads(capsys.readouterr().out)["measured_on"]
    assert record["torch"] == importlib.metadata.version("torch")
    assert record["machine"] and record["date"] and record["command"].startswith("benchmarks/")
