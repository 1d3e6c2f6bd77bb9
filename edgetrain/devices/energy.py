"""Energy profiles of devices: compute speed and efficiency, and the cost of paging (pure data).

The cost model is POET's (Patil et al., ICML 2022, github.com/ShishirPatil/poet,
``poet/chipsets.py`` and ``poet/power_computation.py`` at commit 6e63098):

* computing ``flop`` floating-point operations takes ``flop / flops_per_second`` seconds and
  ``flop / flops_per_joule`` joules;
* paging ``b`` bytes in takes ``pagein_latency_seconds + b / pagein_bytes_per_second`` seconds and
  ``memory_watts`` times that in joules (likewise out).

Every built-in profile names its source; figures POET does not give, and the ``odroid-xu4`` profile,
are marked as assumptions. ``measure_this`` makes a profile of this machine: compute throughput
measured with a matrix multiply, paging bandwidth and latency measured on a directory the user
names, power from the caller (a flag) since software cannot measure it.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edgetrain.errors import CorruptFile, InvalidInput
from edgetrain.jsonfile import read_json


@dataclass(frozen=True)
class EnergyProfile:
    """What computing and paging cost on one device.

    Attributes:
        name: short key (``m0``, ``m4f``, ``rpi4``, ``tx2``, ``odroid-xu4``, ``this``).
        title: what the device is.
        flops_per_second: sustained floating-point operations per second (flop/s).
        flops_per_joule: floating-point operations per joule of compute energy (flop/J).
        pagein_latency_seconds: fixed cost of one read from secondary storage (s).
        pagein_bytes_per_second: read throughput (bytes/s).
        pageout_latency_seconds: fixed cost of one write (s).
        pageout_bytes_per_second: write throughput (bytes/s).
        memory_watts: power drawn while paging (W); paging energy is this times paging time.
        compute_watts: power while computing (W), for reference (``flops_per_second /
            flops_per_joule`` when consistent).
        ram_bytes: RAM of the device (bytes), for reference; 0 when unknown.
        source: where every number comes from.
    """

    name: str
    title: str
    flops_per_second: float
    flops_per_joule: float
    pagein_latency_seconds: float
    pagein_bytes_per_second: float
    pageout_latency_seconds: float
    pageout_bytes_per_second: float
    memory_watts: float
    compute_watts: float
    ram_bytes: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        for key in (
            "flops_per_second",
            "flops_per_joule",
            "pagein_bytes_per_second",
            "pageout_bytes_per_second",
        ):
            if not getattr(self, key) > 0:
                raise InvalidInput(f"profile {self.name!r}: {key} must be positive")
        for key in (
            "pagein_latency_seconds",
            "pageout_latency_seconds",
            "memory_watts",
            "compute_watts",
        ):
            if not getattr(self, key) >= 0:
                raise InvalidInput(f"profile {self.name!r}: {key} must be >= 0")

    def compute_seconds(self, flop: float) -> float:
        """Seconds to compute ``flop`` operations."""
        return flop / self.flops_per_second

    def compute_joules(self, flop: float) -> float:
        """Joules to compute ``flop`` operations."""
        return flop / self.flops_per_joule

    def pagein_seconds(self, size: float) -> float:
        """Seconds to read ``size`` bytes back (0 bytes cost nothing)."""
        return self.pagein_latency_seconds + size / self.pagein_bytes_per_second if size else 0.0

    def pageout_seconds(self, size: float) -> float:
        """Seconds to write ``size`` bytes out."""
        return self.pageout_latency_seconds + size / self.pageout_bytes_per_second if size else 0.0

    def pagein_joules(self, size: float) -> float:
        """Joules to read ``size`` bytes back."""
        return self.memory_watts * self.pagein_seconds(size)

    def pageout_joules(self, size: float) -> float:
        """Joules to write ``size`` bytes out."""
        return self.memory_watts * self.pageout_seconds(size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_SD = (
    "SD card figures as POET measured them for the MKR1000: read 0.109 ms + 4.61651 MB/s, "
    "write 0.113 ms + 4.44 MB/s, 100 mA at 3.3 V while paging"
)

PROFILES: dict[str, EnergyProfile] = {
    "m0": EnergyProfile(
        name="m0",
        title="Arduino MKR1000 (Cortex-M0+, 48 MHz, 32 KB RAM) with an SD card",
        flops_per_second=2000 / 0.012,
        flops_per_joule=2000 / (0.012 * 0.020 * 3.3),
        pagein_latency_seconds=0.109e-3,
        pagein_bytes_per_second=4616.51e3,
        pageout_latency_seconds=0.113e-3,
        pageout_bytes_per_second=4440e3,
        memory_watts=0.100 * 3.3,
        compute_watts=0.020 * 3.3,
        ram_bytes=32 * 1024,
        source=(
            "POET chipsets.py MKR1000 (commit 6e63098): 2000 flop in 12 ms (software float), "
            f"20 mA at 3.3 V; {_SD}"
        ),
    ),
    "m4f": EnergyProfile(
        name="m4f",
        title="nRF52840 (Cortex-M4F, 64 MHz, 256 KB RAM) with an SD card",
        flops_per_second=16283 * 100 * 1000 / 255.6237,
        flops_per_joule=16283 * 100 * 1000 / (255.6237 * 0.003328 * 3.3),
        pagein_latency_seconds=0.109e-3,
        pagein_bytes_per_second=4616.51e3,
        pageout_latency_seconds=0.113e-3,
        pageout_bytes_per_second=4440e3,
        memory_watts=0.100 * 3.3,
        compute_watts=0.003328 * 3.3,
        ram_bytes=256 * 1024,
        source=(
            "POET chipsets.py M4F (commit 6e63098): 1.6283e9 flop in 255.6 s measured, "
            f"3.328 mA at 3.3 V; {_SD} (POET reuses the MKR1000 card)"
        ),
    ),
    "rpi4": EnergyProfile(
        name="rpi4",
        title="Raspberry Pi 4 B (Cortex-A72, 4 cores) with an SD card",
        flops_per_second=2e9,
        flops_per_joule=16283 * 100 * 1000 / (13.53 * 0.6 * 5),
        pagein_latency_seconds=0.00509561e-3,
        pagein_bytes_per_second=45.5e6,
        pageout_latency_seconds=0.0185314e-3,
        pageout_bytes_per_second=24.5e6,
        memory_watts=0.030 * 5,
        compute_watts=0.6 * 5,
        ram_bytes=4 * 2**30,
        source=(
            "POET chipsets.py RPi (commit 6e63098): 2 GFLOP/s, 1.6283e9 flop in 13.53 s at "
            "600 mA 5 V for the energy; SD read 5.1 us + 45.5 MB/s, write 18.5 us + 24.5 MB/s "
            "(page cache on), 30 mA at 5 V while paging"
        ),
    ),
    "tx2": EnergyProfile(
        name="tx2",
        title="NVIDIA Jetson TX2 (one Cortex-A57 core) with its eMMC",
        flops_per_second=2e9,
        flops_per_joule=2e9 / (0.995 - 0.229),
        pagein_latency_seconds=0.00054,
        pagein_bytes_per_second=108.5e6,
        pageout_latency_seconds=0.002396,
        pageout_bytes_per_second=94.37e6,
        memory_watts=0.309,
        compute_watts=0.995 - 0.229,
        ram_bytes=8 * 2**30,
        source=(
            "POET chipsets.py JetsonTX2 (commit 6e63098): one core under stress 995 mW minus "
            "229 mW idle, read 0.54 ms + 108.5 MB/s, write 2.396 ms + 94.37 MB/s, 309 mW while "
            "paging. POET gives no speed: 2 GFLOP/s (one A57 at 2 GHz, one flop per cycle, "
            "POET's own assumption for the Pi) is an assumption, and flop/J follows from it"
        ),
    ),
    "odroid-xu4": EnergyProfile(
        name="odroid-xu4",
        title="ODROID-XU4 (Exynos 5422, 4x Cortex-A15 2 GHz + 4x A7) with eMMC 5.0, Waggle node",
        flops_per_second=4 * 2e9,
        flops_per_joule=4 * 2e9 / 4.0,
        pagein_latency_seconds=0.2e-3,
        pagein_bytes_per_second=140e6,
        pageout_latency_seconds=0.5e-3,
        pageout_bytes_per_second=40e6,
        memory_watts=0.5,
        compute_watts=4.0,
        ram_bytes=2 * 2**30,
        source=(
            "Hardkernel ODROID-XU4 specification (Exynos 5422, 2 GB LPDDR3, eMMC 5.0); the paper's "
            "Waggle node. Assumptions: 4 A15 cores x 2 GHz x 1 flop/cycle (POET's per-core "
            "convention), 4 W above idle under load, eMMC 5.0 read 140 MB/s / write 40 MB/s with "
            "0.2 / 0.5 ms latency, 0.5 W while paging. Measure the board to replace them"
        ),
    ),
}
"""Built-in profiles by name."""

ALIASES = {
    "mkr1000": "m0",
    "m4": "m4f",
    "nrf52840": "m4f",
    "a72": "rpi4",
    "pi4": "rpi4",
    "jetsontx2": "tx2",
    "xu4": "odroid-xu4",
    "odroid": "odroid-xu4",
}


def get(name: str) -> EnergyProfile:
    """A built-in profile by name or alias, or a profile JSON file (see :func:`from_dict`)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key in PROFILES:
        return PROFILES[key]
    if name.endswith(".json"):
        return load(name)
    raise InvalidInput(
        f"unknown device {name!r}; choose one of {', '.join(PROFILES)}, a profile .json, "
        "or measure this machine with `edgetrain poet --device this --page-dir DIR --watts W`"
    )


def from_dict(data: Any) -> EnergyProfile:
    """Rebuild a profile from :meth:`EnergyProfile.to_dict`."""
    if not isinstance(data, dict):
        raise CorruptFile("not an energy profile; expected a JSON object")
    try:
        return EnergyProfile(**data)
    except TypeError as exc:
        raise CorruptFile(f"not an energy profile ({exc}); write it with to_dict") from exc


def load(path: str | Path) -> EnergyProfile:
    """Read a profile JSON file."""
    return from_dict(read_json(path, "profile", "fix the file"))


def measure_this(
    directory: str | Path,
    *,
    compute_watts: float,
    memory_watts: float | None = None,
    sample_bytes: int = 8 * 2**20,
    repeats: int = 3,
) -> EnergyProfile:
    """Measure this machine: matmul throughput, and write/read of ``directory``.

    Writes ``repeats`` files of ``sample_bytes`` (fsync'd, so the page cache does not hide the
    device) and small files for the latency, reads them back, and deletes them. Power cannot be
    measured from software: ``compute_watts`` is the caller's figure and ``memory_watts`` defaults
    to a tenth of it. Raises :class:`InvalidInput` when the directory cannot be written.
    """
    import numpy as np

    if not compute_watts > 0 or compute_watts == float("inf"):
        raise InvalidInput("give the machine's power under load in watts, e.g. --watts 5")
    path = Path(directory)
    if not path.is_dir() or not os.access(path, os.W_OK):
        raise InvalidInput(f"cannot write to {path}; name an existing writable directory")
    n = 384
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    flops = 2 * n**3 / best

    blob = os.urandom(sample_bytes)
    small = b"x" * 64
    write: list[float] = []
    read: list[float] = []
    write_small: list[float] = []
    read_small: list[float] = []
    for i in range(repeats):
        for data, times_w, times_r in ((blob, write, read), (small, write_small, read_small)):
            target = path / f".edgetrain-probe-{os.getpid()}-{i}-{len(data)}"
            try:
                start = time.perf_counter()
                with open(target, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                times_w.append(time.perf_counter() - start)
                start = time.perf_counter()
                with open(target, "rb") as handle:
                    handle.read()
                times_r.append(time.perf_counter() - start)
            except OSError as exc:
                raise InvalidInput(
                    f"cannot write to {path}: {exc.strerror}; name a writable directory with space"
                ) from exc
            finally:
                target.unlink(missing_ok=True)
    lat_w, lat_r = min(write_small), min(read_small)
    bw_w = sample_bytes / max(min(write) - lat_w, 1e-9)
    bw_r = sample_bytes / max(min(read) - lat_r, 1e-9)
    mem_w = compute_watts / 10 if memory_watts is None else memory_watts
    return EnergyProfile(
        name="this",
        title=f"this machine, paging to {path}",
        flops_per_second=flops,
        flops_per_joule=flops / compute_watts,
        pagein_latency_seconds=lat_r,
        pagein_bytes_per_second=bw_r,
        pageout_latency_seconds=lat_w,
        pageout_bytes_per_second=bw_w,
        memory_watts=mem_w,
        compute_watts=compute_watts,
        source=(
            f"measured: float32 {n}x{n} matmul, best of {repeats}; {sample_bytes} B and 64 B "
            f"files written with fsync and read back in {path}; power given by the user "
            f"({compute_watts} W compute, {mem_w} W paging)"
        ),
    )
