"""torch.fx tracing at the sample's concrete shapes: each proxy carries the value it stands for.

A plan is made for one input shape, dtype and state, so the capture traces at that shape. Each
:class:`ValueProxy` carries a meta tensor (shape, dtype, no data) computed alongside the trace,
the way ``torch.fx.experimental.meta_tracer`` and Hugging Face's ``HFTracer`` do: a shape
query (``x.shape``, ``x.size(1)``, ``x.dim()``, ``len(x)``, ``x.numel()``, ``x.dtype``,
``x.device``) returns a Python value, not a node, so ``B, T, C = x.shape`` gives three ints,
``token_type_ids[:, :seq_length]`` slices with an int, and ``if H % 2:`` takes its branch once.
Shapes are constants baked into the graph; they never live across a cut. What depends on a
tensor's *value* stays symbolic: ``bool(t)``, ``if (mask == 0).any():``, ``t.item()`` are
refused, as plain fx refuses them (:func:`edgetrain.frontend.fx_capture.capture` names the line
and the fix).

Why meta values inside fx rather than ``torch.export`` or ``make_fx``: the graph stays at the
level of the model's modules (a ``BatchNorm2d`` call updates its own statistics, a dropout call
draws from the RNG in order, a tied weight is one parameter, an in-place operation is kept), so
the executor runs the same modules as plain autograd; and meta tensors cost no memory and next
to no time, so a ResNet-152 is still traced in well under a second. A leaf module's value is its
forward run on meta copies of its parameters and buffers (``torch.func.functional_call``), so
its real buffers are untouched.

A function that draws random numbers (``torch.rand(B, T)``, ``torch.empty(n).normal_()``) is
recorded as a node even when none of its arguments is traced, so each step draws anew, in the
order ``forward()`` draws them, instead of baking one draw in. Other calls with only concrete
arguments (``torch.arange(T)``, ``torch.ones(T, T).tril()``) run once and are constants.
"""

from __future__ import annotations

import bisect
import contextlib
import dis
import inspect
import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx._symbolic_trace import _maybe_revert_all_patches
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

VALUE = "edgetrain_value"
"""Key of a traced node's meta tensor (or Python value) in ``node.meta``."""
UNKNOWN = object()
"""A node whose value could not be computed on meta tensors: its proxy is plain fx's."""
_DEVICE_FLAGS = {"is_cpu", "is_cuda", "is_meta", "is_mps", "is_xpu"}
_RANDOM = frozenset(
    [
        "rand",
        "randn",
        "randint",
        "randperm",
        "rand_like",
        "randn_like",
        "randint_like",
        "bernoulli",
        "normal",
        "poisson",
        "multinomial",
        "bernoulli_",
        "normal_",
        "uniform_",
        "exponential_",
        "geometric_",
        "cauchy_",
        "log_normal_",
        "random_",
    ]
)


class ValueProxy(fx.Proxy):
    """An fx Proxy that knows its value: shape queries on a tensor return Python values; an
    augmented assignment ``a += b`` is recorded as ``operator.iadd`` (in place, as eager runs it)
    where fx's own Proxy would record ``a = a + b``."""

    @property
    def value(self) -> Any:
        return self.node.meta.get(VALUE, UNKNOWN)

    def __getattr__(self, k: str) -> Any:
        value = self.node.meta.get(VALUE, UNKNOWN)
        if k.startswith("__") or not isinstance(value, torch.Tensor):
            return fx.proxy.Attribute(self, k)
        tracer: ValueTracer = self.tracer  # type: ignore[assignment]
        if k == "device":
            return tracer.device
        if k in _DEVICE_FLAGS:
            return k == f"is_{tracer.device.type}"
        attribute = getattr(value, k)
        if callable(attribute):
            return fx.proxy.Attribute(self, k)  # a method: recorded when called
        if isinstance(attribute, torch.Tensor):  # x.T, x.mT, x.real: a node
            return tracer.create_proxy("call_function", getattr, (self, k), {})
        return attribute  # shape, dtype, ndim, requires_grad, ...

    def __len__(self) -> int:
        value = self.value
        if isinstance(value, torch.Tensor | tuple | list):
            return len(value)
        return super().__len__()

    def __iter__(self) -> Iterator[Any]:
        # A tuple (a leaf's outputs, ``unbind``) is taken apart; a tensor only by unpacking
        # (``a, b = t``): a loop over a tensor's rows stays refused (its length is the batch's).
        value = self.value
        if isinstance(value, tuple | list):
            return iter([self[i] for i in range(len(value))])  # type: ignore[index]
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        if caller is not None:
            instructions = list(dis.get_instructions(caller.f_code))
            at = bisect.bisect_left(instructions, caller.f_lasti, key=lambda i: i.offset)
            if at < len(instructions) and instructions[at].opname == "UNPACK_SEQUENCE":
                return (self[i] for i in range(instructions[at].argval))  # type: ignore[index]
        return self.tracer.iter(self)


def _inplace_operator(function: Any) -> Any:
    def method(self: fx.Proxy, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", function, (self, other), {})

    return method


for _name in ("iadd", "isub", "imul", "itruediv"):
    setattr(ValueProxy, f"__{_name}__", _inplace_operator(getattr(operator, _name)))


class ValueTracer(fx.Tracer):
    """fx's tracer with :class:`ValueProxy`: traces ``root`` called on ``inputs`` (by name;
    keyword arguments when ``keywords``, else positional in order), every other argument of
    ``forward()`` at its default. ``leaf_types`` are module classes kept as one call each."""

    def __init__(
        self,
        inputs: Mapping[str, torch.Tensor],
        keywords: bool,
        leaf_types: tuple[type[nn.Module], ...] = (),
    ) -> None:
        super().__init__()
        self.inputs = dict(inputs)
        self.keywords = keywords
        self.leaf_types = leaf_types
        first = next(iter(self.inputs.values()), None)
        self.device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
        self._metas: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.computing_depth = 0  # > 0 while a value is computed on meta tensors

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, self.leaf_types) or super().is_leaf_module(m, module_qualified_name)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return ValueProxy(node, self)

    def create_arg(self, a: Any) -> Any:
        # A dict of another type (a Hugging Face ModelOutput) is rebuilt as that type, where
        # fx would give a plain dict: ``out.loss`` works on the captured model's output.
        if isinstance(a, dict) and type(a) is not dict and all(isinstance(k, str) for k in a):
            fields = {k: self.create_arg(v) for k, v in a.items()}
            return self.create_node("call_function", type(a), (), fields)
        return super().create_arg(a)

    def call_module(
        self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        try:
            self.path_of_module(m)
        except NameError:  # made in forward() (``CrossEntropyLoss()(logits, labels)``)
            with self.computing():
                stateless = not [*m.parameters(), *m.buffers()]
            if stateless:
                return forward(*args, **kwargs)  # its operations are traced as nodes
            raise
        return super().call_module(m, forward, args, kwargs)

    def create_args_for_root(
        self, root_fn: Any, is_module: bool, concrete_args: Any = None
    ) -> tuple[Any, list[Any]]:
        names = list(self.inputs)
        proxies = [self.create_proxy("placeholder", name, (), {}) for name in names]
        keywords = self.keywords

        def call(*args: Any) -> Any:
            own, given = (args[0], args[1:]) if is_module else ((), args)
            own = (own,) if is_module else ()
            if keywords:
                return root_fn(*own, **dict(zip(names, given, strict=True)))
            return root_fn(*own, *given)

        return call, ([self.root] if is_module else []) + proxies

    def create_proxy(
        self,
        kind: str,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None = None,
        type_expr: Any = None,
        proxy_factory_fn: Any = None,
    ) -> Any:
        if kind == "placeholder":
            value = self._meta(self.inputs[target])
        elif kind == "get_attr":
            value = self._meta_attribute(str(target))
        elif kind in ("call_function", "call_method", "call_module"):
            value = self._value_of(kind, target, args, kwargs)
            if value is not UNKNOWN and value is not None and not _holds_tensor(value):
                return value  # a shape, a dtype, a flag: a constant, not a node
            if kind == "call_method" and self._stays(target, args, kwargs, value):
                return args[0]  # ``t.to(t.device)``: the tensor itself, as eager returns it
            if kind == "call_method" and self._moves_home(target, args, kwargs, value):
                args, kwargs = _without_places(args, kwargs)  # ``t.to(t.device, torch.bool)``
        else:
            value = UNKNOWN
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if isinstance(proxy, fx.Proxy):
            proxy.node.meta[VALUE] = value
        return proxy

    def _stays(self, target: Any, args: Any, kwargs: dict[str, Any], value: Any) -> bool:
        """Whether ``args[0].to(...)`` (``.cpu()``) leaves the tensor where it is, as it is:
        eager returns the tensor itself, and the graph holds no device of its own."""
        if target not in ("to", "cpu") or not isinstance(value, torch.Tensor) or not args:
            return False
        source = args[0].node.meta.get(VALUE) if isinstance(args[0], fx.Proxy) else None
        if not isinstance(source, torch.Tensor) or source.dtype != value.dtype:
            return False
        if kwargs.get("copy") or kwargs.get("memory_format") is not None:
            return False
        return all(torch.device(p) == self.device for p in _places(args, kwargs)) and (
            target == "to" or self.device.type == "cpu"
        )

    def _moves_home(self, target: Any, args: Any, kwargs: dict[str, Any], value: Any) -> bool:
        """Whether ``args[0].to(...)`` names the device the tensor is on beside what it changes
        (``mask.to(device=t.device, dtype=torch.bool)``): recorded without the device, as
        eager runs it there, so that the graph holds no device of its own and sizes on meta."""
        if target != "to" or not isinstance(value, torch.Tensor) or not args:
            return False
        source = args[0].node.meta.get(VALUE) if isinstance(args[0], fx.Proxy) else None
        places = _places(args, kwargs)
        return (
            isinstance(source, torch.Tensor)
            and bool(places)
            and all(torch.device(p) == self.device for p in places)
        )

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """While a value is computed: fx's patches off (a leaf's forward runs as itself), and
        random draws inside it (a wrapped function's own) not recorded as nodes."""
        self.computing_depth += 1
        try:
            with _maybe_revert_all_patches():
                yield
        finally:
            self.computing_depth -= 1

    def _value_of(
        self, kind: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        try:
            with self.computing():
                margs, mkwargs = tree_map(self._meta_leaf, (args, kwargs))
                if "device" in mkwargs or _creates(target, args, kwargs):
                    mkwargs["device"] = "meta"
                if kind == "call_function":
                    return target(*margs, **mkwargs)
                if kind == "call_method":
                    if target in ("cpu", "cuda"):
                        return margs[0]
                    if target == "to":
                        margs = [a for a in margs if not isinstance(a, str | torch.device)]
                        mkwargs.pop("device", None)
                    return getattr(margs[0], target)(*margs[1:], **mkwargs)
                module = self.root.get_submodule(target)
                if isinstance(module, _SHAPE_KEEPING) and len(margs) == 1 and not mkwargs:
                    return _like(margs[0], module)  # a norm, an activation: no kernel run
                state = {
                    n: self._meta(t)
                    for n, t in [*module.named_parameters(), *module.named_buffers()]
                }
                kept = dict(vars(module))  # computing a value leaves the module as it was
                try:  # (an RNN refreshes its _flat_weights when its parameters are swapped)
                    return torch.func.functional_call(module, state, tuple(margs), mkwargs)
                finally:
                    vars(module).clear()
                    vars(module).update(kept)
        except Exception:  # no meta kernel, or a value read: the node stays symbolic
            return UNKNOWN

    def _meta_leaf(self, leaf: Any) -> Any:
        if isinstance(leaf, fx.Proxy):
            value = leaf.node.meta.get(VALUE, UNKNOWN)
            if value is UNKNOWN:
                raise LookupError(leaf.node.name)
            return value
        if isinstance(leaf, torch.Tensor):
            return self._meta(leaf)
        if isinstance(leaf, torch.device):
            return torch.device("meta")
        return leaf

    def _meta(self, tensor: torch.Tensor) -> torch.Tensor:
        known = self._metas.get(id(tensor))
        if known is None or known[0] is not tensor:
            meta = tensor.detach().to("meta").requires_grad_(tensor.requires_grad)
            known = self._metas[id(tensor)] = (tensor, meta)
        return known[1]

    def _meta_attribute(self, target: str) -> Any:
        value: Any = self.root
        with self.computing():
            for atom in target.split("."):
                value = getattr(value, atom, None)
        return self._meta(value) if isinstance(value, torch.Tensor) else UNKNOWN

    def run(self, root: nn.Module) -> fx.Graph:
        """The graph of ``root`` called on the inputs, random draws recorded (see the module
        docstring); the nodes' values dropped afterwards."""
        with _Draws(self):
            graph = self.trace(root)
        for node in graph.nodes:
            node.meta.pop(VALUE, None)
        self._metas.clear()
        return graph


_SHAPE_KEEPING = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.dropout._DropoutNd,
    nn.Identity,
    nn.ReLU,
    nn.ReLU6,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.LeakyReLU,
    nn.ELU,
    nn.Mish,
)
"""Leaf modules whose output has their input's shape and dtype (sized without running them)."""


def _like(value: Any, module: nn.Module) -> Any:
    if not isinstance(value, torch.Tensor):
        raise TypeError(type(value).__name__)
    grad = value.requires_grad or any(p.requires_grad for p in module.parameters())
    return torch.empty_like(value).requires_grad_(grad and torch.is_grad_enabled())


def _places(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[str | torch.device]:
    """The devices a ``t.to(...)`` call names (positionally or as ``device=``)."""
    return [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, str | torch.device)]


def _without_places(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A ``t.to(...)`` call's arguments without the devices it names."""
    kept = tuple(a for a in args[1:] if not isinstance(a, str | torch.device))
    return (args[0], *kept), {k: v for k, v in kwargs.items() if k != "device"}


def _holds_tensor(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(value)[0])


def _creates(target: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether ``target`` is a random draw that makes a tensor from no tensor (``torch.rand``):
    its value is made on the meta device, drawing nothing."""
    return getattr(target, "__name__", None) in _RANDOM and not _holds_tensor((args, kwargs))


def _initialises(value: Any) -> bool:
    """Whether a draw fills a parameter (``nn.init``, a module made in ``forward()``)."""
    return any(isinstance(leaf, nn.Parameter) for leaf in tree_flatten(value)[0])


def _traced(value: Any) -> bool:
    return any(isinstance(leaf, fx.Proxy) for leaf in tree_flatten(value)[0])


class _Draws(TorchFunctionMode):
    """Records a random draw (``torch.rand(B, T)``, ``t.normal_()``) with no traced argument
    as a node of the trace, as it would be with one."""

    def __init__(self, tracer: ValueTracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.tracer.computing_depth:  # a value computed on meta tensors draws nothing real
            return func(*args, **kwargs)
        name = getattr(func, "__name__", None)
        drawn = name in _RANDOM and not _traced((args, kwargs))
        if drawn and not _initialises((args, kwargs)):
            if torch.overrides.is_tensor_method_or_property(func):
                return self.tracer.create_proxy("call_method", name, args, kwargs)
            return self.tracer.create_proxy("call_function", func, args, kwargs)
        return func(*args, **kwargs)
