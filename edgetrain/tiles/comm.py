"""One rank's view of the cluster: gloo point-to-point and collectives, counting bytes (torch).

:class:`Comm` wraps a ``torch.distributed`` gloo process group. It is built either for local
workers (a file store in a temporary directory, the gloo device bound to the given address,
loopback by default, so nothing listens on other interfaces) or from the ``torchrun``
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). Every operation
has the process group's timeout, so a peer that died or hangs turns into an exception instead
of an endless wait.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Traffic:
    """Bytes this rank handed to the network.

    ``halo_bytes`` counts point-to-point sends (halos and gradient halos) exactly;
    ``collective_bytes`` counts the payload this rank contributes to collectives (batch-norm
    statistics, weight gradients). What gloo puts on the wire for a collective depends on its
    algorithm (a ring all-reduce sends about twice the payload).
    """

    halo_bytes: int = 0
    halo_messages: int = 0
    collective_bytes: int = 0
    collectives: int = 0
    sync_points: int = 0
    """Times this rank waited for its peers: every exchange, small gather and blocking
    collective, and each wait for collectives started earlier."""
    wait_seconds: float = 0.0
    """Wall time spent in those waits."""

    @property
    def bytes_sent(self) -> int:
        return self.halo_bytes + self.collective_bytes


GATHER_TAG = 1 << 20
"""Message tag of :meth:`Comm.gather_small` (halo exchanges use small tags: 2 x group + 0/1)."""


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Comm:
    """Send, receive and reduce tensors among ``size`` ranks (``size == 1``: all local no-ops)."""

    def __init__(self, backend: dist.ProcessGroupGloo | None, rank: int, size: int) -> None:
        self.backend = backend
        self.rank = rank
        self.size = size
        self.traffic = Traffic()

    # --- construction ---------------------------------------------------------------------

    @staticmethod
    def solo() -> Comm:
        """A cluster of one: collectives return their input."""
        return Comm(None, 0, 1)

    @staticmethod
    def gloo(
        store: dist.Store, rank: int, size: int, address: str | None, timeout_seconds: float
    ) -> Comm:
        """A gloo group over ``store``; its sockets bind to ``address`` (None: gloo's default).

        gloo's default follows ``GLOO_SOCKET_IFNAME`` or the host name's address.
        """
        options = dist.ProcessGroupGloo._Options()
        if address:
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        else:
            options._devices = [dist.ProcessGroupGloo.create_default_device()]
        options._timeout = datetime.timedelta(seconds=timeout_seconds)
        backend = dist.ProcessGroupGloo(dist.PrefixStore("edgetrain", store), rank, size, options)
        return Comm(backend, rank, size)

    @staticmethod
    def from_file(path: str, rank: int, size: int, address: str, timeout_seconds: float) -> Comm:
        """Local workers meet through a file store (no listening socket for the rendezvous)."""
        store = dist.FileStore(path, size)
        # The rendezvous waits no longer than an operation: a peer that died before it joined
        # is then a timed-out peer, not a five-minute stall.
        store.set_timeout(datetime.timedelta(seconds=timeout_seconds))
        return Comm.gloo(store, rank, size, address, timeout_seconds)

    @staticmethod
    def from_torchrun(address: str | None, timeout_seconds: float) -> tuple[Comm, dist.Store]:
        """Join the group ``torchrun`` set up (reads its environment variables)."""
        store, rank, size = next(
            iter(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_seconds)))
        )
        store.set_timeout(datetime.timedelta(seconds=timeout_seconds))
        return Comm.gloo(store, rank, size, address, timeout_seconds), store

    # --- operations -----------------------------------------------------------------------

    def exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        receives: Sequence[tuple[int, torch.Tensor]],
        tag: int,
    ) -> None:
        """Send ``(peer, tensor)`` pairs and fill ``(peer, buffer)`` pairs, all at once.

        Every receive is posted before any send and all are waited for together, so neighbours
        exchanging in both directions cannot deadlock whatever order they call in.
        """
        self._p2p(sends, receives, tag)
        self.traffic.halo_bytes += sum(_nbytes(t) for _, t in sends)
        self.traffic.halo_messages += len(sends)

    def _p2p(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        receives: Sequence[tuple[int, torch.Tensor]],
        tag: int,
    ) -> None:
        if self.backend is None:
            if sends or receives:
                raise AssertionError("a cluster of one has no peers to exchange with")
            return
        works = [self.backend.recv([buf], peer, tag) for peer, buf in receives]
        works += [self.backend.send([t.contiguous()], peer, tag) for peer, t in sends]
        if works:  # nothing to exchange (an aligned window) waits for no one
            self.wait_all(works)

    def wait_all(self, works: Sequence[Any]) -> None:
        """Wait for ``works`` (started operations): one synchronisation point."""
        began = time.perf_counter()
        for work in works:
            if work is not None:
                work.wait()
        self.traffic.wait_seconds += time.perf_counter() - began
        self.traffic.sync_points += 1

    def gather_small(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` in rank order, sent directly to every peer.

        For a few hundred bytes (batch-norm statistics) one round of point-to-point messages
        is quicker than gloo's ring collectives, and each rank then reduces the parts itself in
        rank order, so all ranks compute bit-identical results.
        """
        if self.backend is None:
            return [tensor]
        peers = [r for r in range(self.size) if r != self.rank]
        parts = {r: torch.empty_like(tensor) for r in peers}
        self._p2p([(r, tensor) for r in peers], list(parts.items()), GATHER_TAG)
        self.traffic.collective_bytes += _nbytes(tensor) * len(peers)
        self.traffic.collectives += 1
        parts[self.rank] = tensor
        return [parts[r] for r in range(self.size)]

    def exchange_with_small(
        self,
        small: torch.Tensor,
        sends: Sequence[tuple[int, torch.Tensor]],
        receives: Sequence[tuple[int, tuple[int, ...]]],
        tag: int,
    ) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
        """A halo exchange and :meth:`gather_small` in one round of messages.

        Every peer gets ``small`` (a few hundred bytes), with the halo ``sends`` holds for it
        appended to the same message; ``receives`` gives the shape of the halo each peer sends
        here. Returns every rank's ``small`` in rank order and the received halos by peer.
        """
        if self.size == 1:
            return [small], {}
        halos = dict(sends)
        shapes = dict(receives)
        flat = small.reshape(-1)
        n = flat.numel()
        outgoing, incoming = [], []
        for peer in range(self.size):
            if peer == self.rank:
                continue
            halo = halos.get(peer)
            outgoing.append((peer, flat if halo is None else torch.cat([flat, halo.reshape(-1)])))
            size = n + (_numel(shapes[peer]) if peer in shapes else 0)
            incoming.append((peer, small.new_empty(size)))
        self._p2p(outgoing, incoming, tag)
        self.traffic.halo_bytes += sum(_nbytes(t) for _, t in sends)
        self.traffic.halo_messages += len(sends)
        self.traffic.collective_bytes += _nbytes(small) * (self.size - 1)
        self.traffic.collectives += 1
        parts, received = [], {}
        by_peer = dict(incoming)
        for peer in range(self.size):
            if peer == self.rank:
                parts.append(small)
                continue
            parts.append(by_peer[peer][:n].view_as(small))
            if peer in shapes:
                received[peer] = by_peer[peer][n:].view(shapes[peer])
        return parts, received

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks, in place (it must be contiguous)."""
        if self.backend is not None:
            self.wait_all([self.backend.allreduce([tensor])])
            self.traffic.collective_bytes += _nbytes(tensor)
            self.traffic.collectives += 1
        return tensor

    def all_reduce_start(self, tensor: torch.Tensor) -> Any:
        """Start summing ``tensor`` over all ranks in place; ``wait()`` the returned work.

        gloo runs it on its own threads, so it overlaps with what this rank computes meanwhile.
        Every rank must start its collectives in the same order.
        """
        if self.backend is None:
            return None
        self.traffic.collective_bytes += _nbytes(tensor)
        self.traffic.collectives += 1
        return self.backend.allreduce([tensor])

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` with rank ``root``'s, in place."""
        if self.backend is not None:
            self.backend.broadcast(tensor, root).wait()
        return tensor

    def barrier(self) -> None:
        if self.backend is not None:
            self.backend.barrier().wait()


PEER_LOSS_SYMPTOMS = (
    "Connection closed by peer",
    "Timed out",
    "timed out",
    "Connection reset",
    "Wait timeout",
)
"""What gloo's errors say when a peer died (its sockets closed) or stopped answering (timeout),
and what the store says when a peer never joined the group's rendezvous."""


def is_peer_loss(error: BaseException | str) -> bool:
    """Whether ``error`` (an exception or its first line) says a peer died or stopped answering,
    rather than that this rank's own computation failed."""
    text = str(error)
    return any(symptom in text for symptom in PEER_LOSS_SYMPTOMS)


def listening_addresses() -> list[str]:
    """``address:port`` of every TCP socket this process listens on (Linux; else empty)."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return []
    inodes = set()
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(_decode(fields[1], width))
    return found


def _decode(text: str, width: int) -> str:
    address, port = text.split(":")
    raw = bytes.fromhex(address)
    if width == 8:
        host = ".".join(str(b) for b in reversed(raw))
    else:  # four little-endian 32-bit words
        words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
        host = ":".join(b"".join(words)[i : i + 2].hex() for i in range(0, 16, 2))
    return f"{host}:{int(port, 16)}"
