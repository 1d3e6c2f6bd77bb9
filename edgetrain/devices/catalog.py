"""Built-in profiles: Raspberry Pi 3 Model B on 100 Mb/s Ethernet and on its own Wi-Fi.

Sources, and what is derived or assumed (replace with your own measurements when you have them):

* Board: Raspberry Pi 3 Model B, BCM2837, 4× Cortex-A53 at 1.2 GHz, 1 GB LPDDR2
  (raspberrypi.com product brief). About 0.8 GB of it is left for a training process.
* Core speed: Darknet without NNPACK needs about 38 s for one YOLOv2 detection on a Pi 3
  (NTUEE ESLab 2017, ntuee-eslab.github.io/2017Fall-IntelligentSecurityGuard/recognition.html).
  Darknet's default build is single-threaded, and YOLOv2 at 416×416 is 29.5 GFLOP = 14.7 G
  multiply-accumulates (Darknet's own count), so one core sustains about 14.7e9 / 38 ≈ 3.9e8
  MAC/s. Assumption: the timing was for the 416×416 configuration.
* Parallel efficiency 0.75 on four cores: an assumption (memory bandwidth shared by the cores);
  the paper reports its speedups over one core, so this is the number to calibrate first.
* Ethernet: 10/100 through the LAN9514 USB hub. TCP payload on 100BASE-TX is at most
  100 Mb/s × 1448/1538 ≈ 94 Mb/s (frame, IP and TCP overheads); iperf on Pi 3 boards reports
  about that (jeffgeerling.com/blog/2016/review-raspberry-pi-model-3-b-benchmarks-vs-pi-2).
  Latency 0.3 ms per message: an assumption (switch + USB Ethernet + kernel TCP stack).
* Wi-Fi: BCM43438, 802.11n, 2.4 GHz, one spatial stream, 20 MHz: 72.2 Mb/s PHY at best. TCP
  goodput is about half the PHY rate; 30 Mb/s is assumed. It is one shared channel through the
  access point, so every transfer in the cluster queues on it (``shared_medium``). Latency 2 ms
  per message: an assumption (typical access-point round trips are a few milliseconds).
"""

from __future__ import annotations

from pathlib import Path

from edgetrain.devices.boards import boards_from_json
from edgetrain.devices.cluster import Cluster, Device, Link, cluster_from_json
from edgetrain.errors import InvalidInput
from edgetrain.jsonfile import read_json

PI3 = Device(
    name="Raspberry Pi 3 Model B",
    core_macs_per_second=14.7e9 / 38.0,
    cores=4,
    parallel_efficiency=0.75,
    memory_bytes=800 * 2**20,
    source=(
        "BCM2837 4x A53 1.2 GHz, 1 GB (raspberrypi.com); core speed from Darknet YOLOv2 "
        "38 s/image single-threaded (NTUEE ESLab 2017, assumed 416x416); 0.75 efficiency assumed"
    ),
)

ETHERNET_100 = Link(
    name="100 Mb/s Ethernet (switch)",
    bandwidth_bytes_per_second=94e6 / 8,
    latency_seconds=0.3e-3,
    shared_medium=False,
    source="100BASE-TX TCP goodput 94 Mb/s (protocol overhead; iperf on Pi 3); latency assumed",
)

WIFI_PI3 = Link(
    name="Pi 3 Wi-Fi 802.11n 2.4 GHz (shared)",
    bandwidth_bytes_per_second=30e6 / 8,
    latency_seconds=2e-3,
    shared_medium=True,
    source="BCM43438 1x1 802.11n 72.2 Mb/s PHY; 30 Mb/s goodput and 2 ms latency assumed",
)

CLUSTERS: dict[str, Cluster] = {
    "pi3-ethernet": Cluster("pi3-ethernet", PI3, ETHERNET_100),
    "pi3-wifi": Cluster("pi3-wifi", PI3, WIFI_PI3),
}
"""Built-in profiles by name."""


def load(name: str) -> Cluster:
    """A built-in profile by name (``pi3-ethernet``, ``pi3-wifi``) or a ``.json`` file: one
    device and a link (:func:`cluster_from_json`) or a list of boards that differ
    (:func:`~edgetrain.devices.boards.boards_from_json`)."""
    if name in CLUSTERS:
        return CLUSTERS[name]
    path = Path(name)
    if path.suffix == ".json":
        data = read_json(path, "profile", "fix the file")
        if isinstance(data, dict) and "boards" in data:
            return boards_from_json(data, {key: c.link for key, c in CLUSTERS.items()})
        return cluster_from_json(data)
    raise InvalidInput(
        f"unknown profile {name!r}; choose one of {', '.join(CLUSTERS)} or give a .json file"
    )
