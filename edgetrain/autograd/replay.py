"""Computing a stage again: the random-number state it saw, copies of its buffers, its autocast
state; and :class:`GraphRunModule`, a run of stages as one graph that computes some of its
stages' outputs again when the backward reads them.

A recomputation must give the tensors the first run gave (the same kernels on the same values),
and change nothing else: it replays the random-number state the stage saw first (dropout masks),
runs on copies of the stage's buffers (BatchNorm's running statistics are updated once per step,
as without checkpointing; in training mode the batch's own statistics normalise, so the output
is the same) and under the autocast state of the forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from edgetrain.autograd.stage_state import stage_buffers
from edgetrain.autograd.stages import leaves
from edgetrain.autograd.storage_counter import storage_key
from edgetrain.errors import InvalidInput

RngState = tuple[torch.Tensor, list[torch.Tensor]]  # CPU generator state, CUDA states
AutocastState = list[tuple[str, torch.dtype, bool]]


def rng_state() -> RngState:
    """The random-number state now (CPU, and CUDA's when it is in use)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return torch.get_rng_state(), cuda


def set_rng_state(state: RngState) -> None:
    torch.set_rng_state(state[0])
    if state[1]:
        torch.cuda.set_rng_state_all(state[1])


def autocast_state() -> AutocastState:
    """The autocast contexts active now: ``(device, dtype, enabled)``."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return [
        (d, torch.get_autocast_dtype(d), torch.is_autocast_enabled(d))
        for d in devices
        if torch.is_autocast_enabled(d)
    ]


def autocast_label(state: AutocastState) -> tuple[str, ...]:
    """``state`` in words, as a :class:`~edgetrain.core.chain.Chain` records it:
    ``("cpu:bfloat16",)``;
    empty without autocast."""
    return tuple(f"{d}:{str(t).removeprefix('torch.')}" for d, t, enabled in state if enabled)


@contextmanager
def autocasting(state: AutocastState) -> Iterator[None]:
    """Enter the autocast contexts of ``state`` (from :func:`autocast_state`), without autocast's
    cache of weight copies.

    With the cache, each lower-precision copy of a weight lives until the caller's autocast
    region ends, however many stage runs made one (each stage run casts a leaf of its own, so
    every recomputation adds copies): an MLP step under ``torch.autocast`` with its backward
    inside the region held 1.38 MB (3 ×) above its plan. Without it a copy is made by the
    operation that needs it and lives as long as autograd saves it, in the forward as in every
    recomputation, as the profile (run in this context too) measures it."""
    with ExitStack() as stack:
        for device, dtype, enabled in state:
            stack.enter_context(
                torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=False)
            )
        yield


BufferSnapshot = dict[tuple[int, str], torch.Tensor]
"""The buffers of a stage's modules as they were: (id of the module's buffer dict, name) ->
a copy (a place a module assigns a new tensor to is found again)."""


def buffer_snapshot(modules: list[nn.Module]) -> BufferSnapshot:
    """Copies of the buffers of ``modules`` as they are now, for a stage whose result depends
    on buffers its forward changes (:attr:`~edgetrain.core.chain.Stage.reads_updated_buffers`):
    taken before its first run, so that a run again starts where the first one did. Holds
    what a recomputation copies (:func:`~edgetrain.autograd.stage_state.buffer_copy_bytes`)."""
    copies: dict[int, torch.Tensor] = {}
    snapshot: BufferSnapshot = {}
    for buffers, name, buffer in stage_buffers(modules):
        if id(buffer) not in copies:
            copies[id(buffer)] = buffer.detach().clone()
        snapshot[(id(buffers), name)] = copies[id(buffer)]
    return snapshot


@contextmanager
def recomputing(
    state: RngState, modules: list[nn.Module], snapshot: BufferSnapshot | None = None
) -> Iterator[None]:
    """Replay a stage's first RNG state, on copies of the buffers of its ``modules`` (all of
    them, those of a module an earlier stage ran too included; a tensor held in two places is
    copied once, and the copy is held in both): copies of the buffers as they are now, or as
    they were in ``snapshot`` (:func:`buffer_snapshot`, taken before the stage first ran).

    The recomputation updates the copies (BatchNorm running statistics ...), which are then
    dropped: the module's own buffers are untouched, and a graph may keep the copies it saved.
    """
    outer = rng_state()
    set_rng_state(state)
    swapped = stage_buffers(modules)
    copies: dict[int, torch.Tensor] = {}
    for buffers, name, buffer in swapped:
        source = buffer if snapshot is None else snapshot.get((id(buffers), name), buffer)
        if id(source) not in copies:
            copies[id(source)] = source.detach().clone()
        buffers[name] = copies[id(source)]
    del copies, snapshot
    try:
        yield
    finally:
        for buffers, name, original in swapped:
            buffers[name] = original
        set_rng_state(outer)


def check_backward(done: bool) -> None:
    """Refuse a second backward through a step (``done``) and double backward, with the
    contract's messages (``Checkpointed`` keeps nothing for either)."""
    if done:
        raise RuntimeError(
            "Checkpointed: backward through the same step twice; its saved state is freed "
            "after the first backward (retain_graph is not supported)"
        )
    if torch.is_grad_enabled():
        raise RuntimeError(
            "Checkpointed does not support double backward (create_graph=True, e.g. a "
            "gradient penalty); compute it on the model without Checkpointed"
        )


def check_unchanged(watched: list[tuple[torch.Tensor, int]]) -> None:
    """Refuse to go on when a tensor of ``(tensor, version)`` changed in place since then."""
    for tensor, version in watched:
        if tensor._version != version:
            raise RuntimeError(
                "Checkpointed: an input or parameter of this step was modified in place "
                "between its forward and its backward (e.g. optimizer.step() before "
                "backward); run the backward first, or clone the tensor before changing it"
            )


class GraphRunModule(nn.Sequential):
    """Consecutive stages run as one autograd graph (a
    :class:`~edgetrain.core.graph_merge.GraphRun`).

    With grad, the output of each stage at a position in ``recomputed`` is not held by the
    graph of the stage after it: what that stage's operations save of it is replaced by a
    *recipe* (the stage, its input, its random-number and autocast state), and the backward
    computes the output again, once, when it first reads it, and frees it when the last
    operation that saved it has read it (what the plan's ``Fc k, Fr k+1`` and ``Fa k`` again
    before ``B k+1`` do, without building stage ``k``'s graph twice). The recipe's input is held
    as a saved tensor of the graph (through the caller's saved-tensor hooks, if any).

    Each segment ``(i, j)`` of ``checkpointed`` positions runs under
    :func:`torch.utils.checkpoint.checkpoint` (non-reentrant): its input is held (as a saved
    tensor, through the hooks above), and what its operations save is computed again, all of
    it, when the backward first reads any of it (the plan's ``Fc i, Fn i+1 .. Fn j``, then
    ``Fa i .. Fa j`` before ``B j``), replaying the random-number state the segment saw, on
    copies of its buffers (:func:`recomputing`: BatchNorm's statistics are updated once).
    Inside a segment, checkpoint's own saved-tensor hooks take what its operations save: the
    caller's hooks see the segment's input, not what its recomputation holds.
    Without grad, the stages just run.
    """

    def __init__(
        self,
        stages: list[nn.Module],
        recomputed: frozenset[int],
        checkpointed: frozenset[tuple[int, int]] = frozenset(),
        snapshotted: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(*stages)
        self.recomputed = recomputed
        self.checkpointed = dict(checkpointed)
        # Positions of stages whose result depends on buffers their forward changes: a rebuild
        # starts from a snapshot of their buffers taken before the first run (buffer_snapshot).
        self.snapshotted = snapshotted
        # Whose buffers a rebuild copies (see recomputing), found once, not at every rebuild.
        self._submodules = {k: list(stages[k].modules()) for k in recomputed}
        for i, j in checkpointed:
            self._submodules[i] = [m for stage in stages[i : j + 1] for m in stage.modules()]

    def extra_repr(self) -> str:
        segments = sorted(self.checkpointed.items())
        return f"recomputed={sorted(self.recomputed)}, checkpointed={segments}"

    def forward(self, x: Any) -> Any:
        if not torch.is_grad_enabled() or not (self.recomputed or self.checkpointed):
            for stage in self:
                x = stage(x)
            return x
        if not torch._C._autograd._saved_tensors_hooks_is_enabled():
            raise InvalidInput(
                "this plan computes some activations again in the backward, which needs "
                "saved-tensor hooks, but they are disabled here "
                "(torch.autograd.graph.disable_saved_tensors_hooks); run the step outside it"
            )
        hooks = _Recipes(torch._C._autograd._top_saved_tensors_default_hooks(False))
        stages = list(self)
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            position = 0
            while position < len(stages):
                end = self.checkpointed.get(position)
                if end is not None:
                    segment = stages[position : end + 1]
                    snapshot = any(k in self.snapshotted for k in range(position, end + 1))
                    x = self._checkpointed(segment, self._submodules[position], x, snapshot)
                    hooks.made = {}
                    position = end + 1
                    continue
                stage = stages[position]
                if position not in self.recomputed:
                    x = stage(x)
                    hooks.made = {}  # only the next stage's graph releases a recipe's output
                    position += 1
                    continue
                snapshot = position in self.snapshotted
                recipe = _Recipe(stage, self._submodules[position], x, hooks.outer, snapshot)
                hooks.own = []
                x = stage(x)
                hooks.made = {
                    storage_key(t): (recipe, i, t._version)
                    for i, t in enumerate(leaves(x))
                    if t.layout is torch.strided
                }
                hooks.settle()
                position += 1
        return x

    @staticmethod
    def _checkpointed(
        segment: list[nn.Module], submodules: list[nn.Module], x: Any, snapshot: bool
    ) -> Any:
        """``segment``'s stages on ``x`` under non-reentrant checkpointing (the input's tensors
        passed as arguments, so that checkpoint saves them as tensors); with ``snapshot``, the
        recomputation starts from the buffers as they were before the segment ran."""
        flat, spec = tree_flatten(x)

        def run(*args: Any) -> Any:
            y = tree_unflatten(list(args), spec)
            for stage in segment:
                y = stage(y)
            return y

        def contexts() -> tuple[Any, Any]:
            # Called before the segment runs: the snapshot is of the buffers it first sees.
            taken = buffer_snapshot(submodules) if snapshot else None
            return nullcontext(), recomputing(rng_state(), submodules, taken)

        return checkpoint(
            run, *flat, use_reentrant=False, preserve_rng_state=False, context_fn=contexts
        )


class _Recipe:
    """How to compute a stage's output again, and the output while the backward needs it."""

    def __init__(
        self,
        module: nn.Module,
        submodules: list[nn.Module],
        x: Any,
        outer: tuple[Any, Any] | None,
        snapshot: bool = False,
    ) -> None:
        self.module, self.submodules = module, submodules
        self.rng = rng_state()
        # Made before the stage runs: its buffers as the first run sees them.
        self.snapshot = buffer_snapshot(submodules) if snapshot else None
        self.autocast = autocast_state()
        flat, self.spec = tree_flatten(x)
        self.outer = outer
        pack = (lambda t: t) if outer is None else outer[0]
        # Detached: the values are what a rebuild needs, not the graph that made them.
        self.held: list[Any] | None = [
            (True, pack(t.detach())) if isinstance(t, torch.Tensor) else (False, t) for t in flat
        ]
        # What the rebuild reads besides the held input: it must be as it was (autograd checks
        # the tensors it saves the same way).
        self.versions = [(t, t._version) for t in module.parameters()]
        self.versions += [(t, t._version) for _, t in self.held if isinstance(t, torch.Tensor)]
        self.value: list[torch.Tensor] | None = None
        self.uses = 0

    def take(self) -> list[torch.Tensor]:
        """The output, computed on first use; dropped here once every saved use has read it."""
        value = self.value
        if value is None:
            check_backward(self.held is None)
            check_unchanged(self.versions)
            unpack = (lambda t: t) if self.outer is None else self.outer[1]
            x = tree_unflatten([unpack(t) if tensor else t for tensor, t in self.held], self.spec)
            self.held = None
            self.versions = []  # it holds the input too, which the rebuild frees
            rebuild = recomputing(self.rng, self.submodules, self.snapshot)
            self.snapshot = None
            with torch.no_grad(), rebuild, autocasting(self.autocast):
                value = leaves(self.module(x))
            del x, rebuild
            self.value = value
        self.uses -= 1
        if self.uses <= 0:
            self.value = None
        return value


class _Rebuilt:
    """A saved tensor released from the graph: a strided view of a recipe's output tensor."""

    __slots__ = ("index", "offset", "recipe", "size", "stride")

    def __init__(self, recipe: _Recipe, index: int, t: torch.Tensor) -> None:
        self.recipe, self.index = recipe, index
        self.size, self.stride, self.offset = tuple(t.shape), t.stride(), t.storage_offset()


class _Box:
    """A tensor saved by a recomputed stage's own operations while it runs: settled when the
    stage has returned, as a :class:`_Rebuilt` if it is the stage's output, else as saved."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class _Recipes:
    """The saved-tensor hooks of a :class:`GraphRunModule`: a tensor of a recipe's output that
    the next stage saves, or that the recomputed stage's own operations save (an attention's
    or a ReLU's output, which their backward reads), becomes a :class:`_Rebuilt`; everything
    else goes to the caller's hooks (``outer``), or is kept as autograd would."""

    def __init__(self, outer: tuple[Any, Any] | None) -> None:
        self.outer = outer
        self.made: dict[int, tuple[_Recipe, int, int]] = {}
        self.own: list[tuple[_Box, int]] | None = None  # while a recomputed stage runs

    def pack(self, t: torch.Tensor) -> Any:
        if self.own is not None:
            box = _Box(t)
            self.own.append((box, t._version))
            return box
        return self._pack(t)

    def _pack(self, t: torch.Tensor) -> Any:
        if self.made and t.layout is torch.strided:
            hit = self.made.get(storage_key(t))
            if hit is not None and t._version == hit[2]:
                hit[0].uses += 1
                return _Rebuilt(hit[0], hit[1], t)
        return self.outer_pack(t)

    def settle(self) -> None:
        """Settle what the recomputed stage that just ran saved (``made`` is its output):
        what it saved of its output, unchanged since, is rebuilt like the next stage's."""
        own, self.own = self.own or [], None
        for box, version in own:
            t = box.value
            box.value = self._pack(t) if t._version == version else self.outer_pack(t)

    def outer_pack(self, t: torch.Tensor) -> Any:
        """``t`` as the caller's hooks pack it (as it is without them)."""
        return t if self.outer is None else self.outer[0](t)

    def unpack(self, saved: Any) -> torch.Tensor:
        if type(saved) is _Box:
            saved = saved.value
        if type(saved) is not _Rebuilt:
            return saved if self.outer is None else self.outer[1](saved)  # type: ignore[no-any-return]
        value = saved.recipe.take()
        return value[saved.index].as_strided(saved.size, saved.stride, saved.offset)
