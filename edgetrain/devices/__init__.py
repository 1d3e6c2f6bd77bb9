"""Device and link profiles (data with sources) for the tile-parallel cost model; pure."""

from __future__ import annotations

from edgetrain.devices.catalog import CLUSTERS, load
from edgetrain.devices.cluster import Cluster, Device, Link, cluster_from_json

__all__ = ["CLUSTERS", "Cluster", "Device", "Link", "cluster_from_json", "load"]
