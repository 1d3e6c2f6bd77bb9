"""Chain and Stage: what each stage of a sequential model costs, in bytes and seconds.

A chain maps activation ``a[0]`` (the input) through stages ``0 .. L-1`` to ``a[L]`` (the output):
stage ``k`` reads ``a[k]`` and writes ``a[k+1]``. Every planner reads only these numbers, so a user
can plan for a board that has no torch on it. Pure data: no torch here.

Memory conventions (all in bytes, tensor storages deduplicated, measured the same way by
:mod:`edgetrain.frontend.profiling`):

* a *peak* is the most memory allocated during a call above what was allocated just before it, so
  it includes what the call leaves behind (its output, what autograd saves);
* autograd's record of a stage run with grad (its *graph*) holds ``saved_bytes`` of tensors of its
  own, the stage's input when ``saves_input`` and its output when ``saves_output``: exactly what
  autograd keeps for the backward, nothing more (a ``Linear`` saves its input, a ``Tanh`` its
  output, a ``BatchNorm`` its input and statistics);
* parameter gradients are created by the backward: ``gradient_bytes`` of a stage are the gradients
  first created by its backward (a parameter shared by several stages is counted at the last of
  them, whose backward runs first), and ``weight_bytes`` the parameters first used by it, so sums
  over a chain count a tied parameter once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from edgetrain.errors import CorruptFile, InvalidInput
from edgetrain.jsonfile import parse_json


@dataclass(frozen=True)
class Stage:
    """The costs of one stage (one child of an ``nn.Sequential``).

    Attributes:
        name: the child's name.
        output_bytes: size of the stage's output activation ``a[k+1]`` (its gradient has this size).
        saved_bytes: what autograd keeps for backward when the stage runs with grad, other than the
            stage's own input and output storages.
        saves_input: whether autograd also keeps the stage's input alive (a convolution does).
        saves_output: whether autograd keeps the stage's output alive (Tanh, Sigmoid, in-place
            ReLU).
        forward_peak_bytes: peak of a forward without grad, above what existed before it.
        forward_grad_peak_bytes: peak of a forward with grad (building the graph), likewise.
        backward_peak_bytes: peak of the stage's backward above what existed before it (the
            graph and the output gradient); includes the input gradient and the parameter
            gradients it leaves behind.
        weight_bytes: parameters the stage is the first to use.
        gradient_bytes: gradients its backward creates (trainable parameters whose gradient no
            later stage's backward created first).
        shared_gradient_bytes: of ``gradient_bytes``, those of parameters an earlier stage
            uses too (a tied weight). Autograd sums a parameter's gradients from all its uses
            before it adds the sum to an existing ``.grad`` (adding each in turn would differ in
            the last bits), so when the loop keeps gradients these are held too, from this
            stage's backward until the step ends.
        forward_seconds: one forward (median of several runs when measured; 1.0 for unit chains).
        backward_seconds: one backward, likewise.
        layer_output_bytes: outputs of the stage's convolution, normalisation, activation and linear
            layers added up: the activations of the paper's memory model (Tables I-III).
        buffer_bytes: non-parameter state (BatchNorm running statistics) the stage is the
            first to use, so that a sum over a chain counts a module run by several stages once.
        copied_buffer_bytes: all the buffers of the modules the stage runs, those an earlier
            stage ran too included (one BatchNorm applied twice): what a run of the stage
            again copies (see :attr:`recompute_buffer_bytes`). None: ``buffer_bytes`` (a saved
            chain without this field).
        saved_buffer_bytes: of those copies, the ones autograd saves for the backward (each
            whole: a graph that saves a view of a buffer keeps its copy): what the graph of a
            run again holds of them until its backward (BatchNorm's running statistics, read
            by its backward; not an attention mask that an addition reads, whose copy goes
            when the run ends). None: all of them (a saved chain without this field).
        span: how many consecutive children of the ``nn.Sequential`` the stage runs (a child that
            returns a view of its input or overwrites it in place is merged with its neighbour).
        output_requires_grad: whether the output needs a gradient (False for leading stages
            without trainable parameters when the input needs none: they have no backward).
        leaf_bytes: for an output of several tensors (a cut inside a residual block carries the
            trunk and the skip), the storage bytes of each; empty for one tensor.
        carried: ``(output tensor, input tensor)`` pairs: tensors passed through unchanged (the
            same storage in the input and the output).
        shared_leaves: ``(output tensor, earlier output tensor)`` pairs: tensors of the output
            that share one storage (``q, k, v = qkv.chunk(3)``), counted once.
        saved_inputs, saved_outputs: which input and output tensors the graph holds, when
            only some of them (None: all of them or none, as ``saves_input``/``saves_output``).
        outputs_needing_grad: which output tensors need a gradient, when only some of the
            floating-point ones do (an attention mask of zeros and ``-inf`` made from integer
            ids needs none); None: every floating-point one, or none, as
            ``output_requires_grad``.
        backward_peak_kept_bytes: the backward's peak when parameter gradients exist and are
            added to in place (None: as ``backward_peak_bytes``).
        reads_updated_buffers: whether what the stage hands on (its output, what autograd
            saves) depends on buffers its own forward changes (``spectral_norm``'s power
            iteration updates ``u`` and ``v`` and normalises the weight with them; not
            BatchNorm in training, whose output does not read its running statistics). A run
            of it again must start from the buffers as they were before its first run: a plan
            that runs it more than once keeps a copy of them (:attr:`recompute_buffer_bytes`)
            from its first run to its last (see :mod:`edgetrain.autograd.buffer_state`).
        retained_bytes: what its forward leaves alive besides its output and its graph: a
            tensor a module keeps as an attribute (``torch.nn.utils.spectral_norm`` and
            ``weight_norm`` set the weight their hook computes; the next forward replaces it).
            Held from the stage's first run in a step to the step's end.
        input_gradient_bytes: the distinct storages of the gradient its backward returns for
            its input (None: the input's size). Less than the input when tensors share one
            gradient: an addition hands its output's gradient to both of its inputs. With
            ``gradient_from``, only the storages its backward makes (not those it passes on).
        gradient_from: per input tensor, the output tensor whose gradient's storage its
            gradient is (passed on unchanged, as for a skip carried through, or a view of it, as
            ``torch.cat``'s backward returns), or -1 for a storage of its own; empty: all of
            their own. A gradient passed on keeps its whole storage alive: the U-Net's decoder
            concatenates the upsampled trunk and the skip, and the skip's gradient, a view of
            the concatenation's, holds both halves until the encoder consumes it.
        forward_scratch_bytes: heap the forward with grad takes beyond its tensors at its peak
            (a convolution's workspace, an attention kernel's buffers: memory a kernel
            allocates for itself and frees before it returns, which no tensor holds); measured
            on the device (0 from shapes alone, and in chains written without it).
        backward_scratch_bytes: likewise for the backward.
        caller_gradients: the model's last stage only: which of its output tensors (indexed as
            ``leaf_bytes``) the caller's backward starts from, the output's own loss (a Hugging
            Face output given ``labels``: ``out.loss.backward()``); its other tensors get their
            gradients inside the backward. None: every output tensor gets one from the caller.
    """

    name: str
    output_bytes: int
    saved_bytes: int
    saves_input: bool
    forward_peak_bytes: int
    forward_grad_peak_bytes: int
    backward_peak_bytes: int
    weight_bytes: int
    gradient_bytes: int
    forward_seconds: float
    backward_seconds: float
    layer_output_bytes: int = 0
    buffer_bytes: int = 0
    span: int = 1
    saves_output: bool = False
    output_requires_grad: bool = True
    leaf_bytes: tuple[int, ...] = ()
    carried: tuple[tuple[int, int], ...] = ()
    shared_leaves: tuple[tuple[int, int], ...] = ()
    saved_inputs: tuple[int, ...] | None = None
    saved_outputs: tuple[int, ...] | None = None
    backward_peak_kept_bytes: int | None = None
    input_gradient_bytes: int | None = None
    gradient_from: tuple[int, ...] = ()
    copied_buffer_bytes: int | None = None
    saved_buffer_bytes: int | None = None
    shared_gradient_bytes: int = 0
    reads_updated_buffers: bool = False
    retained_bytes: int = 0
    forward_scratch_bytes: int = 0
    backward_scratch_bytes: int = 0
    caller_gradients: tuple[int, ...] | None = None
    outputs_needing_grad: tuple[int, ...] | None = None

    def made_gradient_bytes(self, grads_exist: bool) -> int:
        """The gradient bytes the stage's backward leaves held until the step ends: those it
        creates or, with ``grads_exist``, only those still to be summed with an earlier
        stage's (the others are added to existing gradients in place)."""
        return self.shared_gradient_bytes if grads_exist else self.gradient_bytes

    @property
    def recompute_buffer_bytes(self) -> int:
        """Bytes of the buffer copies a run of the stage again works on (the executor keeps
        the model's BatchNorm statistics from being updated twice): every buffer of its
        modules, one used by an earlier stage too included."""
        if self.copied_buffer_bytes is None:
            return self.buffer_bytes
        return self.copied_buffer_bytes

    @property
    def recompute_saved_buffer_bytes(self) -> int:
        """Bytes of the buffer copies of a run again (:attr:`recompute_buffer_bytes`) that its
        graph holds until the stage's backward."""
        if self.saved_buffer_bytes is None:
            return self.recompute_buffer_bytes
        return min(self.saved_buffer_bytes, self.recompute_buffer_bytes)

    def backward_peak(self, grads_exist: bool) -> int:
        """The backward's peak when parameter gradients are created (held from then on) or,
        with ``grads_exist``, added in place to existing ones as they are computed."""
        if grads_exist and self.backward_peak_kept_bytes is not None:
            return self.backward_peak_kept_bytes
        return self.backward_peak_bytes

    def heap_transients(self, grads_exist: bool) -> tuple[int, int, int]:
        """The stage's transient peaks as the device's memory sees them: its forward without
        grad, its forward with grad and its backward (:meth:`backward_peak`), each its tensors'
        peak plus the scratch its kernels take beside them. What a budget holds; the
        planners add these on top of what is held while the stage runs."""
        return (
            self.forward_peak_bytes + self.forward_scratch_bytes,
            self.forward_grad_peak_bytes + self.forward_scratch_bytes,
            self.backward_peak(grads_exist) + self.backward_scratch_bytes,
        )

    @property
    def output_leaves(self) -> int:
        """How many tensors the output has (1 unless ``leaf_bytes`` says otherwise)."""
        return len(self.leaf_bytes) or 1

    @property
    def saves_whole_output(self) -> bool:
        """Whether the graph holds every tensor of the output."""
        if self.saved_outputs is None:
            return self.saves_output
        return len(set(self.saved_outputs)) == self.output_leaves

    def renamed(self, name: str) -> Stage:
        """The same costs under another name."""
        return replace(self, name=name)

    @property
    def graph_bytes(self) -> int:
        """What a forward with grad leaves held besides its input: the output and saved tensors."""
        return self.output_bytes + self.saved_bytes


@dataclass(frozen=True)
class Chain:
    """An ordered list of stages with the size of the input they start from.

    Attributes:
        stages: the stages in execution order.
        input_bytes: size of ``a[0]``; it is held by the caller, so planners do not count it.
        input_requires_grad: whether backward must produce a gradient for the input.
        name: a label for tables and files.
        autograd_peak_bytes: the peak of one step of the stages run as they are by plain
            autograd (bytes above what the step starts with; the output's gradient made by the
            caller and held until the backward ends), measured when the chain was profiled:
            ``(gradients created by the step, gradients kept from the step before)``. The
            store-all plan runs exactly that (no executor), so it is that plan's peak (see
            :func:`~edgetrain.core.simulator.simulate`): autograd's engine adds the two gradients of
            a
            tensor used twice into a new tensor where the executor adds in place, which no
            stage-by-stage count sees. None: not measured (a chain made by hand).
        autocast: the ``torch.autocast`` state the stages were measured under, as
            ``("cpu:bfloat16",)``; empty: none (every chain made from shapes: autocast does not
            cast meta tensors). Under autocast a step holds other dtypes and the weights'
            lower-precision copies, so a plan holds its budget only in the state its chain had.
    """

    stages: tuple[Stage, ...]
    input_bytes: int
    input_requires_grad: bool = False
    name: str = ""
    autograd_peak_bytes: tuple[int, int] | None = None
    autocast: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.stages:
            raise InvalidInput("a chain needs at least one stage; give a model with children")
        for stage in {id(s): s for s in self.stages}.values():
            for field in fields(Stage):
                value = getattr(stage, field.name)
                if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
                    raise InvalidInput(
                        f"stage {stage.name!r} has negative {field.name} ({value}); "
                        "costs are sizes and durations, use values >= 0"
                    )

    def __len__(self) -> int:
        return len(self.stages)

    def __iter__(self) -> Iterator[Stage]:
        return iter(self.stages)

    @property
    def length(self) -> int:
        """Number of stages, ``L``."""
        return len(self.stages)

    def activation_bytes(self, k: int) -> int:
        """Size of ``a[k]``: the input for ``k == 0``, else the output of stage ``k - 1``."""
        return self.input_bytes if k == 0 else self.stages[k - 1].output_bytes

    def leaf_sizes(self, k: int) -> list[int]:
        """Bytes of each tensor of ``a[k]``, 0 for a tensor that shares an earlier one's storage
        (so that a sum over any set of tensors counts each storage once)."""
        if k == 0:
            return [self.input_bytes]
        stage = self.stages[k - 1]
        sizes = list(stage.leaf_bytes) or [stage.output_bytes]
        for leaf, earlier in stage.shared_leaves:
            if earlier < leaf < len(sizes):
                sizes[leaf] = 0
        return sizes

    def saved_input_bytes(self, k: int) -> int:
        """Bytes of ``a[k]`` the graph of stage ``k`` holds (only the tensors it saves: the
        trunk a convolution reads, not the skip carried beside it)."""
        stage = self.stages[k]
        return _saved_bytes(stage.saved_inputs, stage.saves_input, self.leaf_sizes(k))

    def saved_output_bytes(self, k: int) -> int:
        """Bytes of ``a[k+1]`` the graph of stage ``k`` holds (the result Tanh or ReLU reads)."""
        stage = self.stages[k]
        return _saved_bytes(stage.saved_outputs, stage.saves_output, self.leaf_sizes(k + 1))

    def requires_grad(self, k: int) -> bool:
        """Whether ``a[k]`` needs a gradient (the input: as given; an output: as profiled)."""
        return self.input_requires_grad if k == 0 else self.stages[k - 1].output_requires_grad

    def tensors_needing_grad(self, k: int) -> tuple[int, ...] | None:
        """Which tensors of ``a[k]`` need a gradient, when only some of its floating-point ones
        do (see :attr:`Stage.outputs_needing_grad`); None: as :meth:`requires_grad` says."""
        return None if k == 0 else self.stages[k - 1].outputs_needing_grad

    def gradient_of_activation_bytes(self, k: int) -> int:
        """Bytes the gradient of ``a[k]`` holds (0 when it needs none): the storages the
        backward of stage ``k`` makes (see :attr:`Stage.input_gradient_bytes`, else the size of
        ``a[k]``) and those of later gradients it passes on (:attr:`Stage.gradient_from`)."""
        if not self.requires_grad(k):
            return 0
        return self._gradient_bytes()[k]

    def _gradient_bytes(self) -> list[int]:
        """Per activation, the bytes of the distinct storages its gradient holds, following
        each gradient passed on from the output's (the caller's, one storage per tensor)."""
        known: list[int] | None = self.__dict__.get("_gradient_bytes_memo")
        if known is not None:
            return known
        n = self.length
        last = self.stages[-1]
        sizes = list(last.leaf_bytes) or [last.output_bytes]  # pieces: one size each
        if last.caller_gradients is not None:  # only the loss's from the caller
            sizes = [b if i in last.caller_gradients else 0 for i, b in enumerate(sizes)]
        leaves = list(range(len(sizes)))  # a[n]'s tensors -> their gradient's piece
        result = [0] * (n + 1)
        result[n] = sum(sizes)
        for k in reversed(range(n)):
            stage = self.stages[k]
            own = stage.input_gradient_bytes
            own = self.activation_bytes(k) if own is None else own
            sources = stage.gradient_from or (-1,) * len(self.leaf_sizes(k))
            # A source out of range is a gradient of its own, as -1.
            sources = tuple(j if 0 <= j < len(leaves) else -1 for j in sources)
            first = len(sizes)
            sizes.extend(self._own_gradient_pieces(k, sources, own))
            inputs = [
                leaves[j] if j >= 0 else first + (i if len(sizes) - first > 1 else 0)
                for i, j in enumerate(sources)
            ]
            result[k] = sum(sizes[piece] for piece in set(inputs))
            leaves = inputs
        object.__setattr__(self, "_gradient_bytes_memo", result)
        return result

    def _own_gradient_pieces(self, k: int, sources: tuple[int, ...], own: int) -> list[int]:
        """The storages of the gradients stage ``k``'s backward makes for its input tensors
        (``own`` bytes in all): one per input tensor (indexed like the input, 0 for a tensor
        whose gradient is passed on) when each input tensor's gradient is a storage of its own
        the tensor's size, else one storage for all (an addition inside the stage hands one
        gradient to two inputs). Kept apart, the gradient of a skip passed on by an earlier
        stage is only the skip's, not also the trunk's its stage consumed."""
        mine = [i for i, j in enumerate(sources) if j < 0]
        shared_input = k > 0 and bool(self.stages[k - 1].shared_leaves)
        if len(mine) > 1 and not shared_input:
            sizes = self.leaf_sizes(k)
            if len(sizes) == len(sources) and sum(sizes[i] for i in mine) == own:
                return [sizes[i] if j < 0 else 0 for i, j in enumerate(sources)]
        return [own]

    @property
    def weight_bytes(self) -> int:
        """All parameters of the chain."""
        return sum(s.weight_bytes for s in self.stages)

    @property
    def gradient_bytes(self) -> int:
        """All parameter gradients of the chain."""
        return sum(s.gradient_bytes for s in self.stages)

    @property
    def buffer_bytes(self) -> int:
        """All non-parameter state of the chain."""
        return sum(s.buffer_bytes for s in self.stages)

    @property
    def forward_seconds(self) -> float:
        """One plain forward pass."""
        return sum(s.forward_seconds for s in self.stages)

    @property
    def backward_seconds(self) -> float:
        """One plain backward pass."""
        return sum(s.backward_seconds for s in self.stages)

    @property
    def layer_output_bytes(self) -> int:
        """The paper's activation count for this batch (see :attr:`Stage.layer_output_bytes`)."""
        return sum(s.layer_output_bytes for s in self.stages)

    def fingerprint(self) -> str:
        """A hash of everything a plan depends on: every byte count and flag, not names, times
        or kernel scratch (like times, the device's own: a chain from shapes has none).

        A chain measured on one device and its analytic twin share it; another model, batch,
        image size or dtype changes it.
        """
        data = [self.input_bytes, self.input_requires_grad] + [
            [
                s.output_bytes,
                s.saved_bytes,
                s.saves_input,
                s.saves_output,
                s.forward_peak_bytes,
                s.forward_grad_peak_bytes,
                s.backward_peak_bytes,
                s.gradient_bytes,
                s.output_requires_grad,
                s.span,
                list(s.leaf_bytes),
                [list(c) for c in s.carried],
                s.saved_inputs,
                s.saved_outputs,
                s.backward_peak_kept_bytes,
                *([[list(c) for c in s.shared_leaves]] if s.shared_leaves else []),
                *([s.input_gradient_bytes] if s.input_gradient_bytes is not None else []),
                *([list(s.gradient_from)] if s.gradient_from else []),
                *([s.shared_gradient_bytes] if s.shared_gradient_bytes else []),
                *(["reads updated buffers"] if s.reads_updated_buffers else []),
                *([["retained", s.retained_bytes]] if s.retained_bytes else []),
                *([["caller", list(s.caller_gradients)]] if s.caller_gradients is not None else []),
                *(
                    [["needing grad", list(s.outputs_needing_grad)]]
                    if s.outputs_needing_grad is not None
                    else []
                ),
            ]
            for s in self.stages
        ]
        return hashlib.sha256(json.dumps(data).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (see :meth:`from_dict`)."""
        return {
            "name": self.name,
            "input_bytes": self.input_bytes,
            "input_requires_grad": self.input_requires_grad,
            "stages": [asdict(s) for s in self.stages],
            **(
                {"autograd_peak_bytes": list(self.autograd_peak_bytes)}
                if self.autograd_peak_bytes is not None
                else {}
            ),
            **({"autocast": list(self.autocast)} if self.autocast else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Chain:
        """Rebuild a chain from :meth:`to_dict` output; raises :class:`CorruptFile` if malformed."""
        try:
            stages = tuple(Stage(**_tuples(s)) for s in data["stages"])
            autocast = data.get("autocast", [])
            if not isinstance(autocast, list):
                raise TypeError("autocast is not a list")
            return cls(
                stages=stages,
                input_bytes=int(data["input_bytes"]),
                input_requires_grad=bool(data.get("input_requires_grad", False)),
                name=str(data.get("name", "")),
                autograd_peak_bytes=_pair(data.get("autograd_peak_bytes")),
                autocast=tuple(str(a) for a in autocast),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptFile(
                f"not a chain description ({exc}); re-create it with profile"
            ) from exc

    def to_json(self) -> str:
        """The chain as a JSON document (see :meth:`from_json`)."""
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Chain:
        """Rebuild a chain from :meth:`to_json`; raises :class:`CorruptFile` if malformed."""
        data = parse_json(text, "chain", "write it with to_json")
        if not isinstance(data, dict):
            raise CorruptFile("not a chain description; write it with Chain.to_json")
        return cls.from_dict(data)


def _pair(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    created, kept = (int(v) for v in value)
    return created, kept


def _saved_bytes(which: tuple[int, ...] | None, whole: bool, sizes: list[int]) -> int:
    if which is None:
        return sum(sizes) if whole else 0
    return sum(sizes[j] for j in set(which) if j < len(sizes))


def _tuples(fields: dict[str, Any]) -> dict[str, Any]:
    """JSON lists back to the tuples a Stage holds."""
    out = dict(fields)
    for key in (
        "leaf_bytes",
        "saved_inputs",
        "saved_outputs",
        "gradient_from",
        "caller_gradients",
        "outputs_needing_grad",
    ):
        if isinstance(out.get(key), list):
            out[key] = tuple(int(v) for v in out[key])
    for key in ("carried", "shared_leaves"):
        if isinstance(out.get(key), list):
            out[key] = tuple((int(a), int(b)) for a, b in out[key])
    return out


def uniform_chain(
    length: int,
    activation_bytes: int = 1,
    forward_seconds: float = 1.0,
    backward_seconds: float = 1.0,
    *,
    weight_bytes: int = 0,
    name: str | None = None,
) -> Chain:
    """A homogeneous chain of ``length`` equal stages, as revolve and the paper's §VI assume.

    Each stage outputs ``activation_bytes``, keeps only its input for backward (nothing else),
    allocates its output in a forward and its input gradient in a backward, and holds
    ``weight_bytes`` of trainable parameters. The input is ``activation_bytes`` too.
    """
    if length < 1:
        raise InvalidInput(f"a chain needs at least one step, got {length}; use --steps >= 1")
    stage = Stage(
        name="step",
        output_bytes=activation_bytes,
        saved_bytes=0,
        saves_input=True,
        saves_output=False,
        forward_peak_bytes=activation_bytes,
        forward_grad_peak_bytes=activation_bytes,
        backward_peak_bytes=activation_bytes,
        weight_bytes=weight_bytes,
        gradient_bytes=weight_bytes,
        forward_seconds=forward_seconds,
        backward_seconds=backward_seconds,
        layer_output_bytes=activation_bytes,
    )
    # One shared Stage object: a 100 000-step chain costs no more than a pointer per step.
    return Chain(
        stages=(stage,) * length, input_bytes=activation_bytes, name=name or f"uniform{length}"
    )
