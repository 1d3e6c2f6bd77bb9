"""Tile-parallel training across devices (Rama, Threadgill and Gerstlauer's fused tiles).

The pure planning half imports no torch: :mod:`~edgetrain.tiles.tiling` (the geometry of
tiles, halos and groups) and :mod:`~edgetrain.tiles.grouping` (the cost model and the
dynamic program over group boundaries), :mod:`~edgetrain.tiles.rankplan` (what a rank
recomputes under a memory budget). The torch half runs a plan:
:mod:`~edgetrain.tiles.worker` (one rank: halo exchange, fused groups, global batch norm,
weight-gradient all-reduce) and :mod:`~edgetrain.tiles.launch` (local processes, or
``torchrun`` across boards). See docs/tiles.md.
"""

from __future__ import annotations

from edgetrain.tiles.grid import Grid, Grouping, parse_grid, parse_groups
from edgetrain.tiles.grouping import StepCost, optimise, step_cost
from edgetrain.tiles.tiling import Layer, Network, Region, TilePlan, Window, plan

__all__ = [
    "Grid",
    "Grouping",
    "Layer",
    "Network",
    "Region",
    "StepCost",
    "TilePlan",
    "Window",
    "optimise",
    "parse_grid",
    "parse_groups",
    "plan",
    "step_cost",
]
