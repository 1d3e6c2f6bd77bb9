"""A profile of boards that differ: each board's measured speed and memory, and their link (pure).

The file ``edgetrain tiles --profile FILE`` reads is a JSON object::

    {
      "name": "two Pi 4 and a Pi 3",
      "link": "pi3-ethernet",
      "boards": [
        {"name": "pi4-a", "macs_per_second": 2.4e9, "memory": "1GB"},
        {"name": "pi4-b", "macs_per_second": 2.4e9, "memory": "1GB"},
        {"name": "pi3", "macs_per_second": 1.2e9, "memory": "600MB"}
      ]
    }

* ``boards``: one object per board, in rank order (board ``k`` runs rank ``k``, the tile in
  grid row ``k // columns`` and column ``k % columns``); ``macs_per_second`` is the board's
  measured multiply-accumulate rate on convolutions (all the cores a worker uses), ``memory``
  what a training process may use (bytes, or a size such as ``"512MB"``), ``name`` optional.
* ``link``: a built-in profile whose link the boards share (``pi3-ethernet``, ``pi3-wifi``) or an
  object with :class:`~edgetrain.devices.cluster.Link`'s fields.
* ``name`` and ``backward_factor`` (backward over forward time, default 2) are optional.

Anything else (an unknown key, a missing field, a speed that is not a positive number) is refused
with one line naming the board and the field.
"""

from __future__ import annotations

import math
from typing import Any

from edgetrain.devices.cluster import Cluster, Device, Link
from edgetrain.errors import InvalidInput
from edgetrain.units import parse_bytes

_TOP = {"name", "link", "boards", "backward_factor"}
_BOARD = {"name", "macs_per_second", "memory"}
_LINK = {"name", "bandwidth_bytes_per_second", "latency_seconds", "shared_medium", "source"}


def _positive(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(f"{what} is {value!r}; give a positive number")
    if not (math.isfinite(value) and value > 0):
        raise InvalidInput(f"{what} is {value!r}; give a positive number")
    return float(value)


def _unknown(data: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(data) - allowed)
    if extra:
        raise InvalidInput(
            f"unknown key {extra[0]!r} in {where}; use only {', '.join(sorted(allowed))}"
        )


def _board(data: Any, index: int, backward_factor: float) -> Device:
    where = f"board {index} of the profile"
    if not isinstance(data, dict):
        raise InvalidInput(f'{where} is not an object; write {{"macs_per_second": …, "memory": …}}')
    _unknown(data, _BOARD, where)
    for key in ("macs_per_second", "memory"):
        if key not in data:
            raise InvalidInput(f"{where} has no {key!r}; give its measured {key.replace('_', ' ')}")
    speed = _positive(data["macs_per_second"], f"macs_per_second of {where}")
    memory = data["memory"]
    if isinstance(memory, bool) or not isinstance(memory, str | int | float):
        raise InvalidInput(f"memory of {where} is {memory!r}; give bytes or a size like 512MB")
    try:
        memory_bytes = parse_bytes(memory)
    except InvalidInput as exc:
        raise InvalidInput(f"memory of {where}: {exc}") from exc
    name = data.get("name", f"board {index}")
    if not isinstance(name, str):
        raise InvalidInput(f"name of {where} is {name!r}; give a string")
    return Device(
        name=name,
        core_macs_per_second=speed,
        cores=1,
        parallel_efficiency=1.0,
        memory_bytes=memory_bytes,
        backward_factor=backward_factor,
        source="measured (profile)",
    )


def _link(data: Any, links: dict[str, Link]) -> Link:
    if isinstance(data, str):
        if data not in links:
            raise InvalidInput(
                f"unknown link {data!r} in the profile; name one of {', '.join(links)} or give "
                "an object with bandwidth_bytes_per_second, latency_seconds and shared_medium"
            )
        return links[data]
    if not isinstance(data, dict):
        raise InvalidInput('the profile\'s link is not a name or an object; e.g. "pi3-ethernet"')
    _unknown(data, _LINK, "the profile's link")
    for key in ("bandwidth_bytes_per_second", "latency_seconds", "shared_medium"):
        if key not in data:
            raise InvalidInput(f"the profile's link has no {key!r}; give it")
    if not isinstance(data["shared_medium"], bool):
        raise InvalidInput("shared_medium of the profile's link must be true or false")
    latency = data["latency_seconds"]
    if isinstance(latency, bool) or not isinstance(latency, int | float) or not latency >= 0:
        raise InvalidInput(f"latency_seconds of the profile's link is {latency!r}; give >= 0")
    return Link(
        name=str(data.get("name", "link")),
        bandwidth_bytes_per_second=_positive(
            data["bandwidth_bytes_per_second"], "bandwidth_bytes_per_second of the link"
        ),
        latency_seconds=float(latency),
        shared_medium=data["shared_medium"],
        source=str(data.get("source", "")),
    )


def boards_from_json(data: Any, links: dict[str, Link]) -> Cluster:
    """The :class:`Cluster` of the boards ``data`` lists (see the module docstring); ``links``
    are the built-in links by profile name. Raises InvalidInput naming the first problem."""
    if not isinstance(data, dict):
        raise InvalidInput("the profile is not a JSON object; write name, link and boards")
    _unknown(data, _TOP, "the profile")
    if "boards" not in data:
        raise InvalidInput("the profile has no 'boards'; list each board's speed and memory")
    if "link" not in data:
        raise InvalidInput("the profile has no 'link'; name one, e.g. \"pi3-ethernet\"")
    boards = data["boards"]
    if not isinstance(boards, list) or not boards:
        raise InvalidInput("the profile's 'boards' is not a non-empty list; give one per board")
    backward = _positive(data.get("backward_factor", 2.0), "the profile's backward_factor")
    devices = tuple(_board(b, i, backward) for i, b in enumerate(boards))
    name = data.get("name", f"{len(devices)} boards")
    if not isinstance(name, str):
        raise InvalidInput(f"the profile's name is {name!r}; give a string")
    return Cluster.of_differing(name, _link(data["link"], links), devices)
