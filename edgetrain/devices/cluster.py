"""Device and link profiles: the numbers the tile-parallel cost model needs (pure data).

A :class:`Cluster` is a number of identical devices joined by one kind of link, or a list of
boards that differ (``boards``, read from a profile by :mod:`~edgetrain.devices.boards`). Every
number carries its source or says that it is an assumption, so a user can replace it with a
measurement of their own boards (``load("path/to/profile.json")``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from edgetrain.errors import CorruptFile


@dataclass(frozen=True)
class Device:
    """One board.

    Attributes:
        name: what it is.
        core_macs_per_second: multiply-accumulates per second one core sustains on convolution
            (forward pass), the figure the paper's "speedup over a single core" divides by.
        cores: cores a worker uses.
        parallel_efficiency: speedup of ``cores`` cores over one, divided by ``cores`` (0..1].
        memory_bytes: memory a training process can use.
        backward_factor: backward time over forward time of the same layer (input and weight
            gradients: about 2).
        source: where the numbers come from.
    """

    name: str
    core_macs_per_second: float
    cores: int
    parallel_efficiency: float
    memory_bytes: int
    backward_factor: float = 2.0
    source: str = ""

    @property
    def macs_per_second(self) -> float:
        """Multiply-accumulates per second with all ``cores``."""
        return self.core_macs_per_second * self.cores * self.parallel_efficiency


@dataclass(frozen=True)
class Link:
    """The network between devices.

    Attributes:
        name: what it is.
        bandwidth_bytes_per_second: payload throughput of one device's link (TCP goodput).
        latency_seconds: one message's fixed cost (half a round trip plus software overhead).
        shared_medium: True when all devices share one channel (Wi-Fi): transfers add up instead
            of running in parallel on a switch's separate full-duplex ports.
        source: where the numbers come from.
    """

    name: str
    bandwidth_bytes_per_second: float
    latency_seconds: float
    shared_medium: bool
    source: str = ""


@dataclass(frozen=True)
class Cluster:
    """``Device`` boards on a ``Link``: what a grouping is optimised for.

    ``boards`` (empty: any number of ``device``) lists boards that differ, one per rank in rank
    order; ``device`` is then the slowest of them.
    """

    name: str
    device: Device
    link: Link
    boards: tuple[Device, ...] = ()

    def board(self, rank: int) -> Device:
        """The board that runs ``rank``."""
        return self.boards[rank] if self.boards else self.device

    def macs_per_second(self, rank: int) -> float:
        """Multiply-accumulates per second of the board that runs ``rank``."""
        return self.board(rank).macs_per_second

    @staticmethod
    def of_differing(name: str, link: Link, boards: Sequence[Device]) -> Cluster:
        """Boards that differ, one per rank in rank order, on ``link``; ``device`` the slowest."""
        slowest = min(boards, key=lambda b: b.macs_per_second)
        return Cluster(name, slowest, link, tuple(boards))

    def of_boards(self, ranks: Sequence[int]) -> Cluster:
        """The boards that run ``ranks`` (in that order) on the same link: what is left of a
        profile of boards that differ when others drop out. A cluster of identical devices is
        returned as it is."""
        if not self.boards:
            return self
        return Cluster.of_differing(self.name, self.link, [self.boards[r] for r in ranks])

    def to_json(self) -> dict[str, Any]:
        """Name, device and link (what :func:`cluster_from_json` reads); a profile of boards
        that differ is written as the boards' own format reads it back."""
        if not self.boards:
            return {"name": self.name, "device": asdict(self.device), "link": asdict(self.link)}
        return {
            "name": self.name,
            "link": asdict(self.link),
            "backward_factor": self.device.backward_factor,
            "boards": [
                {"name": b.name, "macs_per_second": b.macs_per_second, "memory": b.memory_bytes}
                for b in self.boards
            ],
        }


def cluster_from_json(data: dict[str, Any]) -> Cluster:
    """Build a :class:`Cluster` from the dictionary :meth:`Cluster.to_json` writes."""
    try:
        return Cluster(
            name=str(data["name"]), device=Device(**data["device"]), link=Link(**data["link"])
        )
    except (KeyError, TypeError) as exc:
        raise CorruptFile(
            f"not a cluster profile ({exc}); write name, device and link as in docs/tiles.md"
        ) from exc
