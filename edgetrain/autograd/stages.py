"""How a stage runs: the primitives shared by the profiler and the executor.

Profiling and execution must run a stage the same way, or the measured costs would not predict
the run: both go through :func:`run_forward`, :func:`run_forward_with_grad` and
:func:`run_backward`.

A stage run with grad keeps exactly what autograd saves and nothing else. Its input enters through a
*tap*: a view of the input made by an autograd function that saves nothing, so the input's storage
stays alive only if the stage's own operations save it. Its trainable parameters enter as leaves of
their own that share the parameters' storage (swapped into the modules' parameter dicts for the
call, as :func:`torch.func.functional_call` does, at places found once per plan:
:func:`~edgetrain.autograd.stage_state.stage_params`); a post-accumulate hook hands each one's
gradient to the executor's sink the moment autograd has it, and clears it there, so nothing is
written to the parameter's ``.grad`` and no hook of the user's runs here: the executor hands the
gradients to autograd once per step, as plain autograd would. Of the stage's output the graph keeps
only an empty tensor hung on each output tensor (:class:`_Hand`), not the tensors: the output's
storage too stays alive only if autograd saved it.

Activations are tensors, or tuples, lists and dicts of tensors (any pytree); only floating-point
tensors carry gradients.

What a stage is (:mod:`~edgetrain.autograd.stage_grouping`) and what its modules hold
(:mod:`~edgetrain.autograd.stage_state`) are modules of their own.
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.autograd.graph import _engine_run_backward
from torch.utils._pytree import tree_flatten, tree_unflatten

from edgetrain.autograd.stage_state import StageParams
from edgetrain.autograd.storage_counter import storage_key
from edgetrain.errors import InvalidInput


class _Tap(torch.autograd.Function):
    """``x`` as a view that requires grad, saving nothing; ``anchor`` only makes it differentiable.

    Its backward (run when a backward targets the anchor) puts the gradient that reached the view
    into ``box`` and passes nothing on.
    """

    @staticmethod
    def forward(
        ctx: Any, anchor: torch.Tensor, x: torch.Tensor, box: list[torch.Tensor]
    ) -> torch.Tensor:
        ctx.box = box
        ctx.set_materialize_grads(False)  # no gradient reached the view: the box stays empty
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[None, None, None]:
        if grad is not None:
            ctx.box.append(grad)
        return None, None, None


class _Hand(torch.autograd.Function):
    """An empty tensor hung on a stage's output tensor ``x``: backpropagating from it hands the
    gradient waiting in ``box`` to ``x``'s producer.

    The engine then holds the only reference to that gradient and frees it as soon as the
    operation that reads it is done, as inside one autograd graph; handed to the engine as a
    root gradient it would stay alive to the end of the stage's backward (the call's argument
    holds it), one more tensor of the output's size at the backward's peak.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, box: list[torch.Tensor]) -> torch.Tensor:
        ctx.box = box
        return x.new_empty(0)

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        return (ctx.box.pop() if ctx.box else None), None


# The leaf every tap hangs from. One serves all stages: it is empty, never gets a gradient
# (a tap's backward passes none on), and a backward targeting it reaches only the taps of the
# graph it starts from; making one per stage run cost about a microsecond. (Made outside
# inference mode, in case this module is first imported inside it.)
with torch.inference_mode(False):
    _ANCHOR = torch.empty(0, requires_grad=True)


def _anchor() -> torch.Tensor:
    return _ANCHOR


# ``Function.apply`` is a Python wrapper that, outside functorch transforms (vmap, grad ...),
# only unwraps dead functorch wrappers before calling the C ``apply`` it inherits. Every stage
# run with grad applies a tap per input and a hand per output, so calling the C ``apply``
# directly when no transform is active saves about a microsecond each.
_C_APPLY = torch._C._FunctionBase.__dict__["apply"]
_FAST_APPLY = {fn: _C_APPLY.__get__(None, fn) for fn in (_Tap, _Hand)}


def _apply(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)``, by the C ``apply`` when no functorch transform is active."""
    if torch._C._are_functorch_transforms_active():
        return fn.apply(*args)
    return _FAST_APPLY[fn](*args)


def leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of an activation (a tensor or a pytree of them), in pytree order."""
    if isinstance(value, torch.Tensor):
        return [value]  # the common cases, without walking a pytree
    if _flat_sequence(value):
        return list(value)
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _flat_sequence(value: Any) -> bool:
    """Whether ``value`` is a plain tuple or list of tensors (its pytree leaves, in order)."""
    return (type(value) is tuple or type(value) is list) and all(
        isinstance(t, torch.Tensor) for t in value
    )


def differentiable(t: torch.Tensor) -> bool:
    """Whether a tensor can carry a gradient (floating point or complex)."""
    return t.is_floating_point() or t.is_complex()


@dataclass
class StageGraph:
    """What is kept of a stage run with grad: never the stage's input or output tensors.

    Attributes:
        outputs: per output tensor, whether it needs a gradient.
        hands: per output tensor, the empty tensor and box its gradient enters through (see
            :class:`_Hand`; None for outputs that need no gradient or are ``passed``).
        inputs: per input tensor, a box its gradient lands in (None: none wanted).
        input_anchor: the leaf the input taps hang from (backward towards it fills the boxes).
        params: the stage's trainable parameters as leaves of their own (sharing storage with
            them), whose gradient goes to the forward's sink as soon as autograd accumulates it.
        passed: ``(output tensor, input tensor)`` pairs: an input returned unchanged (a residual
            skip) that at most one operation of the stage also reads. :func:`run_backward` adds
            its gradient to the input's itself, in place when it can, as autograd does inside
            one graph (see :func:`run_backward`).
    """

    outputs: list[bool]
    inputs: list[list[torch.Tensor] | None]
    input_anchor: torch.Tensor | None = None
    params: list[torch.Tensor] = field(default_factory=list)
    passed: list[tuple[int, int]] = field(default_factory=list)
    hands: list[tuple[torch.Tensor, list[torch.Tensor]] | None] = field(default_factory=list)
    release: Release | None = None


def _saving(hooks: Release | None) -> AbstractContextManager[None]:
    """The saved-tensor hooks of a stage's call: a release's (over the caller's own, which it
    keeps for what it does not release), or autograd's own."""
    if hooks is None:
        return nullcontext()
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():
        raise InvalidInput(
            "this plan releases stage inputs (Fr), which needs saved-tensor hooks, but they are "
            "disabled here (torch.autograd.graph.disable_saved_tensors_hooks); run the step "
            "outside that context"
        )
    hooks.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack)


class _Released:
    """Where a released saved tensor lies: input tensor ``index``, as a strided view of it."""

    __slots__ = ("index", "offset", "size", "stride")

    def __init__(
        self, index: int, size: tuple[int, ...], stride: tuple[int, ...], offset: int
    ) -> None:
        self.index, self.size, self.stride, self.offset = index, size, stride, offset


class Release:
    """Saved-tensor hooks that keep a stage's graph from holding its input (``Fr``).

    What autograd saves of the input's storages (a convolution's or a linear layer's input, a
    tensor passed through) is replaced by where it lies in which input tensor; the backward reads
    it from the input computed again (:attr:`rebuilt`, set just before it runs: the same kernels
    on the same values give the same tensor). A saved tensor of the input's storage that an
    in-place operation of the stage changed is kept as it is (never so for a stage of a chain:
    a stage's input stays intact, see :func:`~edgetrain.autograd.stage_grouping.group_children`).

    Saved-tensor hooks the caller has set around the step (``save_on_cpu``, their own) still get
    every tensor the stage saves but a released one, which is not held at all (:attr:`outer`,
    the caller's hooks when the stage ran; the innermost hooks are the only ones autograd calls).
    """

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        self.versions: dict[int, tuple[int, int, torch.dtype]] = {}
        for i, t in enumerate(inputs):
            self.versions.setdefault(storage_key(t), (i, t._version, t.dtype))
        self.rebuilt: list[torch.Tensor] | None = None
        self.outer: tuple[Any, Any] | None = None

    def pack(self, t: torch.Tensor) -> Any:
        if t.layout is torch.strided:  # else no storage of its own to compare (sparse ...)
            hit = self.versions.get(storage_key(t))
            if hit is not None and t._version == hit[1] and t.dtype == hit[2]:
                return _Released(hit[0], tuple(t.shape), t.stride(), t.storage_offset())
        return t if self.outer is None else self.outer[0](t)

    def unpack(self, saved: Any) -> torch.Tensor:
        if type(saved) is not _Released:
            return saved if self.outer is None else self.outer[1](saved)  # type: ignore[no-any-return]
        if self.rebuilt is None:
            raise RuntimeError("edgetrain: a released input was read before it was rebuilt")
        return self.rebuilt[saved.index].as_strided(saved.size, saved.stride, saved.offset)


def run_forward(module: nn.Module, x: Any, *, stage: int = 0, name: str = "") -> Any:
    """Run one stage without building a graph; returns its output."""
    with torch.no_grad():
        out = module(x)
    _check_output(out, stage, name)
    return out


def run_forward_with_grad(
    module: nn.Module,
    x: Any,
    *,
    needs_input_grad: bool | list[bool],
    params: StageParams | None = None,
    sink: Any = None,
    stage: int = 0,
    name: str = "",
    release: bool = False,
) -> tuple[Any, StageGraph]:
    """Run one stage building its graph; returns ``(output, graph)`` for :func:`run_backward`.

    ``needs_input_grad``: whether (each of) the input's tensors needs a gradient. ``params``: the
    stage's trainable parameters (:func:`~edgetrain.autograd.stage_state.stage_params`);
    :func:`run_backward` hands each one's gradient to ``sink(index, grad)`` as autograd computes
    it. ``release``: the graph holds
    nothing of the input (:class:`Release`); :func:`run_backward` then needs it again.
    """
    with torch.enable_grad():  # one switch for the whole stage: taps, call and hands
        anchor = _anchor()
        boxes: list[list[torch.Tensor] | None] = []
        taps: list[torch.Tensor] = []
        if isinstance(x, torch.Tensor):  # the common case, without walking a pytree
            wanted = (
                needs_input_grad[0]
                if isinstance(needs_input_grad, list)
                else needs_input_grad and differentiable(x)
            )
            inputs = _tap(anchor, x, wanted, boxes)
            taps.append(inputs)
        elif _flat_sequence(x):
            wanted_each = (
                needs_input_grad
                if isinstance(needs_input_grad, list)
                else [needs_input_grad and differentiable(t) for t in x]
            )
            tapped_each = [_tap(anchor, t, w, boxes) for t, w in zip(x, wanted_each, strict=True)]
            taps.extend(tapped_each)
            inputs = tuple(tapped_each) if type(x) is tuple else tapped_each
        else:
            flat, spec = tree_flatten(x)
            tensors = [t for t in flat if isinstance(t, torch.Tensor)]
            wanted_each = (
                needs_input_grad
                if isinstance(needs_input_grad, list)
                else [needs_input_grad and differentiable(t) for t in tensors]
            )
            tapped: list[Any] = []
            position = 0
            for item in flat:
                if not isinstance(item, torch.Tensor):
                    tapped.append(item)
                    continue
                tapped.append(_tap(anchor, item, wanted_each[position], boxes))
                taps.append(tapped[-1])
                position += 1
            inputs = tree_unflatten(tapped, spec)
        made: list[torch.Tensor] = []
        if params is not None and params.params:
            for index, param in params.params:
                # A leaf of its own: autograd accumulates into it first thing, as into .grad.
                leaf = param.detach().requires_grad_()
                # What register_post_accumulate_grad_hook does, without the removable handle it
                # makes (a third of the leaf's cost): the leaf dies with the stage's graph.
                leaf._post_accumulate_grad_hooks = {0: _handing_to(sink, index)}
                made.append(leaf)
        hooks = Release(leaves(x)) if release else None
        with _saving(hooks):
            if params is not None and params.params:
                out = _call_with(module, inputs, params.slots, made)
            else:
                out = module(inputs)
        _check_output(out, stage, name)
        out_leaves = leaves(out)
        wanted = [t.requires_grad for t in out_leaves]
        graph = StageGraph(wanted, boxes, anchor, made, release=hooks)
        graph.passed = _passed_through(out_leaves, taps, boxes)
        bypass = {j for j, _ in graph.passed}
        for j, t in enumerate(out_leaves):
            if not wanted[j] or j in bypass:
                graph.hands.append(None)
                continue
            box: list[torch.Tensor] = []
            graph.hands.append((_apply(_Hand, t, box), box))
    return out, graph


def _passed_through(
    out_leaves: list[torch.Tensor],
    taps: list[torch.Tensor],
    boxes: list[list[torch.Tensor] | None],
) -> list[tuple[int, int]]:
    """The outputs that are an input tap itself (returned unchanged) and whose input at most
    one operation of the stage reads: ``(output, input)`` pairs.

    Their gradient can bypass the engine: added to what the stage's own use contributes, it is
    the same two-term sum (addition commutes, so bitwise the same), and done by
    :func:`run_backward` it can be in place, where the engine, handed it as a root gradient
    that the caller also holds, adds out of place (one more tensor of the skip's size at the
    peak). With two or more uses inside the stage the engine's order of the terms is kept.
    """
    if not taps or not any(t.requires_grad for t in out_leaves):
        return []
    candidates: list[tuple[int, int]] = []
    for j, t in enumerate(out_leaves):
        for i, tap in enumerate(taps):
            if t is tap and boxes[i] is not None and t.requires_grad:
                candidates.append((j, i))
    if not candidates:
        return []
    returned = [i for _, i in candidates]
    skip = {j for j, _ in candidates}
    readers = [t.grad_fn for j, t in enumerate(out_leaves) if j not in skip]
    uses = _uses_of({id(taps[i].grad_fn): i for i in returned}, readers)
    return [(j, i) for j, i in candidates if returned.count(i) == 1 and uses.get(i, 0) <= 1]


def _uses_of(tap_nodes: dict[int, int], starts: list[Any]) -> dict[int, int]:
    """How many edges of the stage's graph, walked from the nodes ``starts``, lead to each tap
    node: the operations that read that input."""
    uses: dict[int, int] = {}
    seen: set[int] = set()
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if id(node) in tap_nodes:
            continue
        for child, _ in node.next_functions:
            if child is None:
                continue
            if id(child) in tap_nodes:
                index = tap_nodes[id(child)]
                uses[index] = uses.get(index, 0) + 1
            stack.append(child)
    return uses


def _tap(
    anchor: torch.Tensor, x: torch.Tensor, wanted: bool, boxes: list[list[torch.Tensor] | None]
) -> torch.Tensor:
    """The tensor the stage sees for input ``x``: a tap when its gradient is wanted (the
    gradient lands in a new box), else ``x`` detached."""
    plain = x.detach()
    if not wanted:
        boxes.append(None)
        return plain
    box: list[torch.Tensor] = []
    view: torch.Tensor = _apply(_Tap, anchor, plain, box)
    boxes.append(box)
    return view


def _call_with(
    module: nn.Module,
    inputs: Any,
    slots: tuple[tuple[dict[str, Any], str, int], ...],
    made: list[torch.Tensor],
) -> Any:
    """``module(inputs)`` with the parameters in ``slots`` replaced by ``made`` for the call
    (what :func:`torch.func.functional_call` does, without resolving the names every time)."""
    originals = [(owner, pname, owner[pname]) for owner, pname, _ in slots]
    try:
        for owner, pname, position in slots:
            owner[pname] = made[position]
        return module(inputs)
    finally:
        for owner, pname, original in originals:
            owner[pname] = original


def _handing_to(sink: Any, index: int) -> Any:
    def hand(leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        if sink is not None and grad is not None:
            sink(index, grad)

    return hand


def run_backward(
    graph: StageGraph,
    grad_outputs: list[torch.Tensor | None],
    *,
    params: bool = True,
    rebuilt: Any = None,
) -> list[torch.Tensor | None]:
    """Backpropagate through a stage's graph (once: it is freed). ``rebuilt``: the stage's
    input computed again, for a graph that released it (``release=True``); held until the
    backward ends.

    Takes the output gradients out of ``grad_outputs`` (its entries become None), so that
    autograd frees each as soon as the operation that reads it is done (see :class:`_Hand`);
    a gradient the caller still holds elsewhere lives as long as the caller holds it. Returns
    the gradient of each input tensor (None where none is wanted or none flows); when
    ``params``, each trainable parameter's gradient goes to the forward's ``sink`` as soon as
    autograd has it.
    """
    roots: list[torch.Tensor] = []
    for j, hand in enumerate(graph.hands):
        if hand is None or grad_outputs[j] is None:
            continue
        root, box = hand
        box.append(grad_outputs[j])  # type: ignore[arg-type]
        grad_outputs[j] = None
        roots.append(root)
    graph.hands = []
    if graph.release is not None:
        if rebuilt is None:
            raise RuntimeError("edgetrain: the backward of a released stage needs its input")
        graph.release.rebuilt = leaves(rebuilt)
    targets: list[torch.Tensor] = []
    if any(box is not None for box in graph.inputs) and graph.input_anchor is not None:
        targets.append(graph.input_anchor)
    if params:
        targets.extend(graph.params)
    if roots and targets:
        # torch.autograd.backward without its argument checks: the engine call it makes. Each
        # root is an empty tensor, its own (ignored) gradient.
        _engine_run_backward(
            tuple(roots),
            tuple(roots),
            False,  # retain_graph
            False,  # create_graph
            tuple(targets),
            allow_unreachable=True,
            accumulate_grad=True,
        )
    del roots
    if graph.release is not None:
        graph.release.rebuilt = None
    results = [None if box is None or not box else box.pop() for box in graph.inputs]
    for j, i in graph.passed:
        carried, grad_outputs[j] = grad_outputs[j], None
        if carried is None:
            continue
        own, results[i] = results[i], None
        results[i] = carried if own is None else _add(own, carried)
        del own, carried
    return results


def _add(own: torch.Tensor, carried: torch.Tensor) -> torch.Tensor:
    """``carried + own`` laid out as plain autograd lays out the sum (``InputBuffer``): a
    gradient carried past this stage comes from a later use of the tensor, so in plain autograd
    it arrived first and is the tensor accumulated into, in place when nothing else holds it,
    else ``carried + own``, which takes ``carried``'s layout unless it is broadcast (stride 0).
    The values are the same whichever is added into; the layout is not, and the backward of the
    operation before reads it (a channels-last BatchNorm backward handed a contiguous gradient
    sums in another order). Where ``own`` already has that layout it is added into when nothing
    else holds it: no new tensor, and no view's whole storage kept (``torch.cat``'s backward
    hands each input a view of one gradient). A ``carried`` broadcast along some dimensions and
    laid out unlike ``own`` along the others is added into ``own`` (no new tensor, which the
    profile would not count) though ``carried + own`` may order those dimensions as
    ``carried`` does."""
    with torch.no_grad():
        broadcast = any(
            s == 0 and n > 1 for s, n in zip(carried.stride(), carried.shape, strict=True)
        )
        if broadcast or _order(own) == _order(carried):
            if _stealable(own, carried):
                return own.add_(carried)
            if not broadcast and _stealable(carried, own):
                return carried.add_(own)
        elif _stealable(carried, own):
            return carried.add_(own)
        return carried + own


def _order(t: torch.Tensor) -> tuple[int, ...]:
    """The tensor's dimensions from the outermost in memory to the innermost (size-1 dimensions
    left out: their strides say nothing)."""
    return tuple(sorted((d for d in range(t.dim()) if t.shape[d] != 1), key=lambda d: -t.stride(d)))


def _stealable(t: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether ``t`` (the caller's name for it in :func:`_add`) may take ``other`` in place: a
    gradient the engine has just made, which nothing else holds, dense, of ``other``'s shape
    and dtype."""
    # References to ``t``: _add's caller's name, _add's argument, this function's argument and
    # getrefcount's.
    return (
        sys.getrefcount(t) <= 4
        and t._use_count() == 1
        and t._base is None
        and t.shape == other.shape
        and t.dtype == other.dtype
        and is_non_overlapping_and_dense_or_false(t)
        and torch._C._storage_Use_Count(t.untyped_storage()._cdata) == 2
    )


def _check_output(out: object, stage: int, name: str) -> None:
    if not leaves(out):
        raise InvalidInput(
            f"stage {stage} ({name}) returns {type(out).__name__}, not a tensor; "
            "edgetrain chains stages that each return a tensor (or a tuple or dict of tensors)"
        )


def module_key(module: nn.Module) -> str:
    """What a module computes, for memo keys: its repr, and the code of each captured segment
    in it (whose repr names only its submodules), itself or the segments a stage groups."""
    return repr(module) + "".join(str(getattr(m, "code", "")) for m in module.modules())


def empty_like(value: Any) -> Any:
    """An activation of the same structure, shapes and dtypes, uninitialised."""
    flat, spec = tree_flatten(value)
    return tree_unflatten(
        [torch.empty_like(t) if isinstance(t, torch.Tensor) else t for t in flat], spec
    )


def shapes(value: Any) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """Shapes and dtypes of an activation's tensors: equal exactly when :func:`signature` is."""
    return tuple((tuple(t.shape), t.dtype) for t in leaves(value))


def signature(value: Any) -> str:
    """Shapes and dtypes of an activation, for messages and memo keys."""
    parts = [f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in leaves(value)]
    return "shape " + parts[0] if len(parts) == 1 else "shapes " + ", ".join(parts)
