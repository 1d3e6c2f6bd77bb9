"""PageStore: pages written in the background come back bit for bit, verified, and are deleted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from edgetrain.errors import CorruptFile, InvalidInput
from edgetrain.runtime.paging import PageStore


def test_pages_round_trip_exactly_and_leave_nothing_behind(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tensors = {f"a{k}": torch.randn(3, 5, 7, dtype=torch.float64) for k in range(4)}
    with PageStore(tmp_path) as store:
        for key, tensor in tensors.items():
            store.put(key, tensor)
        store.flush()
        assert len(list(tmp_path.iterdir())) == 4
        for key in reversed(list(tensors)):
            back = store.take(key)
            assert back.dtype == tensors[key].dtype and torch.equal(back, tensors[key])
        store.flush()  # deletions run behind, on the store's sync thread
        assert list(tmp_path.iterdir()) == []
        store.put("left", torch.ones(2))
    assert list(tmp_path.iterdir()) == []  # close() removes pages never taken


def test_a_corrupted_page_is_refused(tmp_path: Path) -> None:
    with PageStore(tmp_path) as store:
        store.put("x", torch.arange(100.0))
        store.flush()
        (page,) = tmp_path.iterdir()
        data = bytearray(page.read_bytes())
        data[-5] ^= 0xFF
        page.write_bytes(bytes(data))
        with pytest.raises(CorruptFile, match="checksum"):
            store.take("x")


def test_a_missing_page_is_refused(tmp_path: Path) -> None:
    with PageStore(tmp_path) as store:
        store.put("x", torch.arange(10.0))
        store.flush()
        for page in tmp_path.iterdir():
            page.unlink()
        with pytest.raises(CorruptFile, match="missing"):
            store.take("x")


def test_a_directory_that_cannot_be_used_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="does not exist"):
        PageStore(tmp_path / "nope")
    if os.geteuid() == 0:
        pytest.skip("root can write to read-only directories")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(InvalidInput, match="cannot write"):
            PageStore(locked)
    finally:
        locked.chmod(0o700)


def test_a_write_that_fails_is_reported_by_the_next_call(tmp_path: Path) -> None:
    store = PageStore(tmp_path)
    store.directory = tmp_path / "vanished"  # every write now fails, as on a removed card
    store.put("x", torch.ones(3))
    with pytest.raises(InvalidInput, match="cannot write a page"):
        store.flush()
    store.close()


# -- plans that page: the one simulator and the one executor --------------------------------------

import copy  # noqa: E402

from torch import nn  # noqa: E402

from edgetrain import plan  # noqa: E402
from edgetrain.core.chain import Chain  # noqa: E402
from edgetrain.core.schedule import Op, Schedule  # noqa: E402
from edgetrain.core.simulator import simulate  # noqa: E402
from edgetrain.frontend.profiling import analytic_chain  # noqa: E402
from edgetrain.planners.optimal import minimum_memory, store_all  # noqa: E402
from edgetrain.runtime.checkpointed import Checkpointed  # noqa: E402
from tests.conftest import loss_and_peak  # noqa: E402


def _user_model() -> nn.Sequential:
    torch.manual_seed(3)
    acts = [nn.Tanh, nn.GELU, nn.SiLU]
    layers: list[nn.Module] = []
    for i in range(8):
        layers += [nn.Linear(48, 48), acts[i % 3]()]
    return nn.Sequential(*layers, nn.Linear(48, 5)).double()


def _paged(chain: Chain, schedule: Schedule) -> Schedule:
    """Page out each checkpoint a[j] kept by ``Fc j`` and page it in before its next use, where
    the simulator accepts it (not when a graph also holds a[j])."""
    from edgetrain.errors import InvalidSchedule

    ops = list(schedule)
    for at in range(len(ops)):
        kind, k = ops[at]
        if kind is not Op.FORWARD_CHECKPOINT or k == 0:
            continue
        use = next(
            (u for u in range(at + 1, len(ops)) if ops[u][1] == k and ops[u][0] in _FORWARDS),
            None,
        )
        if use is None or use == at + 1:
            continue
        trial = [*ops[: at + 1], (Op.PAGE_OUT, k), *ops[at + 1 : use], (Op.PAGE_IN, k), *ops[use:]]
        try:
            simulate(chain, Schedule.from_ops(schedule.length, trial))
        except InvalidSchedule:
            continue
        return _paged(chain, Schedule.from_ops(schedule.length, trial, "paged", {}))
    return schedule


_FORWARDS = (Op.FORWARD_NOSAVE, Op.FORWARD_CHECKPOINT, Op.FORWARD_ALL)


def test_a_paging_plan_gives_autograds_gradients_and_its_predicted_peak(tmp_path: Path) -> None:
    model = _user_model()
    reference = copy.deepcopy(model)
    x = torch.randn(512, 48, dtype=torch.float64)
    chain = analytic_chain(model, x)
    everything = simulate(chain, store_all(chain)).peak_bytes
    base = plan(chain, "optimal", memory=(everything + minimum_memory(chain)) / 2)
    paged = _paged(chain, base)
    cost = simulate(chain, paged)
    assert cost.pages_out >= 1 and cost.pages_in == cost.pages_out
    assert cost.peak_bytes <= simulate(chain, base).peak_bytes + max(
        s.output_bytes for s in chain.stages
    )
    net = Checkpointed(model, x, chain=chain, schedule=paged, page_dir=tmp_path)
    loss, measured = loss_and_peak(net, x)
    ref_loss, _ = loss_and_peak(reference, x)
    assert torch.equal(loss, ref_loss)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []  # every page deleted after use
    # Paging lowers the real peak, and the real peak stays within the prediction (it peaks in
    # the backward pass here, where the simulator is slightly conservative for these layers).
    unpaged = Checkpointed(model, x, chain=chain, schedule=base)
    for p in model.parameters():
        p.grad = None
    _, measured_base = loss_and_peak(unpaged, x)
    assert measured < measured_base
    assert cost.peak_bytes * 0.9 <= measured <= cost.peak_bytes * 1.02


def test_a_paging_plan_needs_a_page_directory(tmp_path: Path) -> None:
    model = _user_model()
    x = torch.randn(512, 48, dtype=torch.float64)
    chain = analytic_chain(model, x)
    everything = simulate(chain, store_all(chain)).peak_bytes
    paged = _paged(chain, plan(chain, "optimal", memory=(everything + minimum_memory(chain)) / 2))
    assert simulate(chain, paged).pages_out
    with pytest.raises(InvalidInput, match="page_dir"):
        Checkpointed(model, x, chain=chain, schedule=paged)
    with pytest.raises(InvalidInput, match="does not exist"):
        Checkpointed(model, x, chain=chain, schedule=paged, page_dir=tmp_path / "missing")


def test_the_simulator_refuses_paging_what_a_graph_holds() -> None:
    from dataclasses import replace

    from edgetrain.core.chain import uniform_chain
    from edgetrain.errors import InvalidSchedule

    plain = uniform_chain(3, 10)
    tanh = replace(plain.stages[0], saves_output=True)  # its graph keeps a[1]
    chain = replace(plain, stages=(tanh, *plain.stages[1:]))
    ops = [(Op.FORWARD_ALL, 0), (Op.PAGE_OUT, 1)]
    with pytest.raises(InvalidSchedule, match="graph still holds"):
        simulate(chain, Schedule.from_ops(3, ops))
    with pytest.raises(InvalidSchedule, match="page file"):
        simulate(chain, Schedule.from_ops(3, [(Op.FORWARD_CHECKPOINT, 0), (Op.PAGE_IN, 1)]))
    text = Schedule.from_ops(3, [(Op.PAGE_OUT, 1), (Op.PAGE_IN, 1)]).text()
    assert text == "Po1 Pi1"


def test_structures_strided_and_channels_last_tensors_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(1)
    image = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    base = torch.randn(6, 7)
    value = {"x": (image, base[:, 1::2], base[2:]), "n": 3, "none": None, "b": torch.ones(3) > 0}
    with PageStore(tmp_path) as store:
        store.put("v", value)
        back = store.take("v")
    assert back["n"] == 3 and back["none"] is None and torch.equal(back["b"], value["b"])
    for got, want in zip(back["x"], value["x"], strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert back["x"][0].is_contiguous(memory_format=torch.channels_last)
    assert list(tmp_path.iterdir()) == []


def test_a_truncated_page_is_refused(tmp_path: Path) -> None:
    with PageStore(tmp_path) as store:
        store.put("x", torch.arange(100.0))
        store.flush()
        (page,) = tmp_path.iterdir()
        page.write_bytes(page.read_bytes()[:-8])
        with pytest.raises(CorruptFile, match="size"):
            store.take("x")
