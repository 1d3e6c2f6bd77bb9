"""The interpreter of a plan's operations inside autograd: one training step's state
(:class:`StepRun`, exactly what the plan holds between operations), the autograd function that
runs the forward phase and, in its backward, the backward phase (:class:`ScheduleFunction`), the
watch on a plan run as one graph (:class:`Watch`), and each executor's page store."""

from __future__ import annotations

import weakref
from collections import Counter
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from edgetrain.autograd.replay import (
    AutocastState,
    BufferSnapshot,
    RngState,
    autocast_state,
    autocasting,
    buffer_snapshot,
    check_backward,
    check_unchanged,
    recomputing,
    rng_state,
)
from edgetrain.autograd.stages import (
    StageGraph,
    differentiable,
    leaves,
    run_backward,
    run_forward,
    run_forward_with_grad,
)
from edgetrain.autograd.storage_counter import storage_key
from edgetrain.core.schedule import Op
from edgetrain.runtime.paging import PageStore
from edgetrain.runtime.peak_probe import PeakProbe


def gradients_kept(params: Any) -> bool:
    """Whether gradients can be added to in place: they exist and no hook must see them."""
    return all(
        p.grad is not None and not p._backward_hooks and not p._post_accumulate_grad_hooks
        for p in params
    )


@dataclass
class StepRun:
    """The state of one training step: exactly what the plan holds between operations."""

    net: Any  # the Checkpointed whose plan runs (its prepared stages, ops and costs)
    sample: Any
    trainable: list[int]  # indices of the parameters that require grad, in order
    plain: dict[int, Any] = field(default_factory=dict)
    graphs: dict[int, StageGraph] = field(default_factory=dict)
    grads: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)
    param_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    rng: dict[int, RngState] = field(default_factory=dict)
    runs: Counter[int] = field(default_factory=Counter)  # runs so far of stages run again
    snapshots: dict[int, BufferSnapshot] = field(default_factory=dict)
    wanted_params: set[int] = field(default_factory=set)
    in_place: dict[int, torch.Tensor] = field(default_factory=dict)  # index -> its .grad
    want_input: bool = True
    autocast: AutocastState = field(default_factory=list)
    out_spec: Any = None
    out_flat: list[Any] = field(default_factory=list)
    done: bool = False
    pages: PageStore | None = None
    writing: Any = None  # a paged-out value, held until the operation after its page-out ends
    probe: PeakProbe | None = None  # a measured step (Checkpointed.measuring)

    def output(self, outs: tuple[torch.Tensor, ...]) -> Any:
        """The caller's output: the function's tensors in the structure the model returned."""
        got = iter(outs)
        flat = [next(got) if isinstance(t, torch.Tensor) else t for t in self.out_flat]
        self.out_flat = []
        return tree_unflatten(flat, self.out_spec)

    def execute(self, ops: list[tuple[Op, int]], offset: int = 0) -> None:
        """Run ``ops``, the operations ``offset`` .. of the executed plan."""
        probe = self.probe
        look = -1 if probe is None else probe.position - offset
        for at, (kind, k) in enumerate(ops):
            if at == look and probe is not None:
                probe.before(self._held())
            # A page-out's write overlaps the next operation; its memory goes when that ends.
            written, self.writing = self.writing, None
            if self.pages is not None and at + 1 < len(ops) and ops[at + 1][0] == Op.PAGE_IN:
                self.pages.prefetch(str(ops[at + 1][1]))  # the kernel reads while this op runs
            if kind is Op.DISCARD:
                del self.plain[k]
            elif kind is Op.BACKWARD:
                self._backward(k)
            elif kind is Op.PAGE_OUT:
                self.writing = (k, self.plain.pop(k))
                self._pages().put(str(k), tree_map(detached, self.writing[1]))
            elif kind is Op.PAGE_IN:
                self.plain[k] = self._pages().take(str(k))
            else:
                self._forward(kind, k)
            if written is not None:
                # The kernel has the bytes (the fsync goes on in the background): drop ours.
                self._pages().wait_written(str(written[0]))
                del written
            if at == look and probe is not None:
                probe.after()

    def _held(self) -> dict[str, Any]:
        """What the step holds by the executor's own references, by category."""
        last = self.net._exec_length
        return {
            "output": self.plain.get(last),
            "checkpoint": [v for k, v in self.plain.items() if 0 < k < last],
            "activation gradients": list(self.grads.values()),
            "parameter gradients": list(self.param_grads.values()),
            "page-out being written": None if self.writing is None else self.writing[1],
        }

    def _pages(self) -> PageStore:
        if self.pages is None:
            assert self.net.page_dir is not None
            self.pages = page_store(self.net, self.net.page_dir)
        return self.pages

    def close_pages(self) -> None:
        """Delete the step's page files (after its backward, or when it is abandoned)."""
        self.writing = None
        if self.pages is not None:
            self.pages.clear()
            if self.pages.failed:
                _STORES.pop(self.net, None)
                self.pages.close()
            self.pages = None

    def _forward(self, kind: Op, k: int) -> None:
        x = self.plain[k]
        if k in self.rng or k in self.net._rerun or self.autocast:
            with self._replay(k), self._autocast():
                out = self._run_stage(kind, k, x)
        else:  # the common case: nothing to remember or replay, no autocast to enter
            out = self._run_stage(kind, k, x)
        del x
        self.plain[k + 1] = out
        del out
        if kind is not Op.FORWARD_CHECKPOINT and k > 0:
            del self.plain[k]

    def _run_stage(self, kind: Op, k: int, x: Any) -> Any:
        module = self.net._exec_stages[k]
        if not kind.builds_graph:
            return run_forward(module, x, stage=k)
        out, self.graphs[k] = run_forward_with_grad(
            module,
            x,
            needs_input_grad=self._needs(k, x),
            params=self.net._stage_params[k],
            sink=self.receive,
            stage=k,
            release=kind is Op.FORWARD_RELEASE,
        )
        return out

    def _needs(self, k: int, x: Any) -> list[bool]:
        """Which of stage k's input tensors need a gradient: the model input's as given; for
        later stages what the chain records, known once per plan (the input's shapes and dtypes
        are the plan's, and so are those of every activation)."""
        if k == 0:
            return [t.requires_grad for t in leaves(self.sample)]
        needs = self.net._needs.get(k)
        if needs is None:
            first = self.net._exec_first[k]
            wanted = self.net.chain.requires_grad(first)
            some = self.net.chain.tensors_needing_grad(first)
            needs = self.net._needs[k] = [
                wanted and differentiable(t) if some is None else i in some
                for i, t in enumerate(leaves(x))
            ]
        return needs

    def _backward(self, k: int) -> None:
        graph = self.graphs.pop(k)
        grad_out = self.grads.pop(k + 1)
        if k == 0 and not self.want_input:
            graph.inputs = [None] * len(graph.inputs)
        # A graph built by Fr k reads a[k] again, which the plan recomputed; B k drops it.
        rebuilt = None if graph.release is None else self.plain.pop(k) if k else self.plain[0]
        input_grads = run_backward(
            graph, grad_out, params=bool(self.wanted_params), rebuilt=rebuilt
        )
        del graph, grad_out, rebuilt
        self.grads[k] = input_grads

    def receive(self, index: int, grad: torch.Tensor) -> None:
        """A parameter's gradient from one stage, as autograd computes it: added in place to
        its ``.grad`` when the loop keeps gradients (as autograd would) and no other stage uses
        the parameter, else kept, summed over the stages that use it, for autograd to take
        (and add to ``.grad``) at the end of the step."""
        if index not in self.wanted_params:
            return
        if index in self.in_place:
            with torch.no_grad():
                self.in_place[index].add_(grad)
            return
        known = self.param_grads.get(index)
        # Out of place: the first gradient may alias another that is still in use.
        self.param_grads[index] = grad if known is None else known + grad

    def _replay(self, k: int) -> AbstractContextManager[None]:
        """First run of stage k: remember its RNG state (if the plan runs it again) and, for a
        stage whose result depends on buffers it changes, its buffers. Later runs: replay them,
        keep the model's buffers; the snapshot goes with the last run."""
        net = self.net
        if k not in net._rerun:
            return nullcontext()
        self.runs[k] += 1
        if k not in self.rng:
            self.rng[k] = rng_state()
            if k in net._snapshots:
                self.snapshots[k] = buffer_snapshot(net._submodules[k])
            return nullcontext()
        last = self.runs[k] == net._runs[k]
        snapshot = self.snapshots.pop(k, None) if last else self.snapshots.get(k)
        return recomputing(self.rng[k], net._submodules[k], snapshot)

    def _autocast(self) -> AbstractContextManager[None]:
        return autocasting(self.autocast) if self.autocast else nullcontext()


def detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def accumulates(view_node: Any) -> bool:
    """Whether the caller's backward writes this parameter's ``.grad`` (``loss.backward()``),
    rather than returning its gradient (``torch.autograd.grad``) or skipping it."""
    if view_node is None:
        return False
    accumulator = view_node.next_functions[0][0]
    try:
        return bool(torch._C._will_engine_execute_node(accumulator))
    except RuntimeError:  # autograd.grad(): the gradient is returned, not accumulated
        return False


class Watch(torch.autograd.Function):
    """The identity on a step's output tensors; its backward, the first of the step's, refuses
    to go on (before any gradient is made) when an input or parameter was changed in place since
    the forward, on a second backward and on double backward, as :class:`ScheduleFunction`
    does: the graph's rebuilds read the inputs and parameters again, once, without grad."""

    @staticmethod
    def forward(
        ctx: Any, watched: list[tuple[torch.Tensor, int]], *outs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.watched = watched
        ctx.done = False
        # An output the loss does not use hands back None, not zeros: its parameters' gradients
        # stay None, as plain autograd leaves them.
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        check_backward(ctx.done)
        check_unchanged(ctx.watched)
        ctx.watched, ctx.done = [], True
        return (None, *grads)


class ScheduleFunction(torch.autograd.Function):
    """Forward: the plan's forward phase. Backward: the rest of the plan.

    Its inputs are the input's tensors and the trainable parameters (as views, so that the
    backward can ask autograd which of them the caller's backward needs); its outputs the
    model's output tensors.
    """

    @staticmethod
    def forward(
        ctx: Any, run: StepRun, count: int, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        net = run.net
        flat, spec = tree_flatten(run.sample)
        given = iter(tensors[:count])
        run.plain[0] = tree_unflatten(
            [next(given).detach() if isinstance(t, torch.Tensor) else t for t in flat], spec
        )
        run.autocast = autocast_state()
        run.execute(net._forward_ops)
        out = run.plain.pop(net._exec_length)  # the caller's from now on
        run.out_flat, run.out_spec = tree_flatten(out)
        del out
        ctx.run = run
        ctx.backward_ops = net._backward_ops
        ctx.count = count
        ctx.watched = [(t, t._version) for t in tensors]
        ctx.set_materialize_grads(False)
        results = tuple(t.detach() for t in run.out_flat if isinstance(t, torch.Tensor))
        if run.probe is not None:
            run.probe.output_keys = tuple(storage_key(t) for t in results)
        ctx.mark_non_differentiable(*(t for t in results if not differentiable(t)))
        return results

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[Any, ...]:
        run: StepRun = ctx.run
        check_backward(run.done)
        check_unchanged(ctx.watched)
        count = ctx.count
        nexts = ctx.next_functions  # a new tuple at every access
        needed = [
            node is not None and torch._C._will_engine_execute_node(node) for node, _ in nexts
        ]
        run.want_input = any(needed[:count])
        params = run.net._params
        run.wanted_params = {
            i for i, want in zip(run.trainable, needed[count:], strict=True) if want
        }
        # Gradients that exist, watched by no hook, which the caller's backward accumulates:
        # add to them in place as plain autograd does, and hand autograd nothing for them. But
        # a parameter several stages use: autograd sums its gradients from every use, then
        # adds the sum to .grad; so the executor sums them and hands autograd the sum.
        kept = {
            i: params[i].grad
            for j, i in enumerate(run.trainable)
            if i in run.wanted_params
            and params[i].grad is not None
            and gradients_kept([params[i]])
            and accumulates(nexts[count + j][0])
        }
        run.net._grads_exist = len(kept) == len(run.wanted_params)
        shared = run.net._shared_params
        run.in_place = {i: grad for i, grad in kept.items() if i not in shared}
        run.grads[run.net._exec_length] = list(grad_outputs)
        if run.probe is not None:
            run.probe.output_grad_keys = tuple(
                storage_key(g) for g in grad_outputs if isinstance(g, torch.Tensor)
            )
        del grad_outputs
        run.execute(ctx.backward_ops, len(run.net._forward_ops))
        input_grads = run.grads.pop(0, None) or [None] * count
        results = [run.param_grads.pop(i, None) for i in run.trainable]
        run.in_place.clear()
        run.plain.clear()
        run.graphs.clear()
        run.grads.clear()
        run.param_grads.clear()
        run.close_pages()
        run.done = True
        ctx.watched = []
        return (None, None, *input_grads, *results)


_STORES: weakref.WeakKeyDictionary[Any, PageStore] = weakref.WeakKeyDictionary()


def page_store(net: Any, directory: Path) -> PageStore:
    """The page store of ``net``, kept from step to step (its threads start once), emptied of
    the pages a step abandoned; closed when ``net`` is garbage collected."""
    store = _STORES.get(net)
    if store is None or store.directory != directory:
        store = PageStore(directory)
        _STORES[net] = store
        weakref.finalize(net, store.close)
    store.clear()
    return store
