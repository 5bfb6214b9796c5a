"""The bias audit of any model (seed 000): how much of it is bias, whether it maps the origin to
the origin, which biases a constant input feature could absorb, which missing biases a
normalization's learned shift supplies, and the activation bias of every activation.

Structure is read from one traced forward on an example input, as data flow: a module *follows*
a layer when its input is that layer's output, unmodified (the same tensor, or a view of it
through ``reshape``/``flatten``/``Identity``, with no in-place change since the layer returned
it; dropout, which scales but never shifts, is passed through), decided by tensor storage and
version counter; a layer *reads the input* when its input is the example input so. Functional
code between two modules (a residual ``x + f(x)``, an activation called as ``F.gelu``) makes a
new tensor, so the module after it does not follow the layer: a normalization of
``x + proj(h)`` supplies no shift to ``proj`` alone. Without an example input the modules'
registration order stands in for the forward's (the next module registered follows a layer; the
first module reads the input), and the result says so.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.conv import _ConvNd
from torch.nn.modules.dropout import _DropoutNd

from dynamics.bias.activations import ShiftedActivation, expected_value
from dynamics.bias.audit_result import Activation, AuditResult, Layer, Origin, ParameterCount
from dynamics.bias.shift import ACTIVATION_MODULES, functional_activations
from dynamics.errors import DynamicsError, ParameterError, one_line
from dynamics.params.batch_tree import (
    ForwardArguments,
    call_forward,
    flatten_batch,
    named_tuple_classes,
    unflatten_batch,
)
from dynamics.params.groups import is_bias
from dynamics.params.naming import module_copy, named_modules
from dynamics.passes.isolation import side_effect_free
from dynamics.passes.loss_rule import LIGHTNING_RULE, LossRule

#: Layers that take a ``bias`` option in PyTorch: the rows of the layer table.
LAYER_TYPES: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Bilinear,
    _ConvNd,
    nn.RNNBase,
    nn.RNNCellBase,
    nn.MultiheadAttention,
)
#: Normalizations; one with a ``bias`` parameter has a learned shift. ``_NormBase`` is every
#: BatchNorm (also lazy, sync) and InstanceNorm.
NORM_TYPES: tuple[type[nn.Module], ...] = (_NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
#: Activations whose only kink sits at 0, so the quadrature of E[φ(z)] is exact (~1e-13).
EXPECTED_TYPES: tuple[type[nn.Module], ...] = (*ACTIVATION_MODULES, nn.SELU, nn.CELU)
#: Activations measured but given no E[φ(z)]: a learned slope, or kinks away from 0.
MEASURED_TYPES: tuple[type[nn.Module], ...] = (
    nn.PReLU,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Hardtanh,  # and ReLU6
)
#: Random weight draws of the origin check.
DEFAULT_DRAWS = 5

TRACED = "traced forward on the example input"
REGISTERED = (
    "registration order (no example input: the forward may call modules in another order, "
    "and functional code between them is not seen)"
)


def check_draws(draws: int) -> None:
    """Refuse fewer than one random weight draw for the origin check.

    Example::

        check_draws(5)  # returns; 0 raises ParameterError
    """
    if draws < 1:
        raise ParameterError("draws", f"must be at least 1, got {draws}")


def audit(
    model: nn.Module,
    example_input: Any = None,
    *,
    draws: int = DEFAULT_DRAWS,
    seed: int = 0,
    input_note: str = "",
) -> AuditResult:
    """Audit the biases of ``model``, leaving it, its mode and the random state as they were.

    Example::

        result = audit(model, example_input=torch.randn(8, 784))
        print(result.share())  # e.g. "906 of 567,434 = 0.16 %"
        result.to_dict()  # JSON-ready

    Args:
        model: any module.
        example_input: what ``model(example_input)`` takes (a tensor, or a tuple, list or dict
            of them), or the arguments of ``model(*args, **kwargs)`` as a
            :class:`~dynamics.params.batch_tree.ForwardArguments` (a Hugging Face model's
            ``input_ids=``). With it, one forward (no gradients; train/eval flags, buffers
            and random state restored) traces the data flow and measures the mean output of every
            activation module, another finds activations called as functions, and the origin
            check evaluates f at the input's zero. Without it, the parameter counts and the
            registration-order structure only.
        draws: random weight draws of the origin check.
        seed: seed of the origin check's own ``torch.Generator``.
        input_note: where ``example_input`` came from, kept with the result.

    Returns:
        The :class:`AuditResult`.

    Raises:
        DynamicsError: ``draws`` < 1, or the forward on ``example_input`` fails.
    """
    check_draws(draws)
    units = _units(model)
    traced = example_input is not None
    flow = _trace(model, units, example_input) if traced else _registered(units)
    functional = functional_activations(model, example_input) if traced else []
    return AuditResult(
        parameters=_parameters(model),
        origin=_origin(model, example_input, draws, seed),
        order=TRACED if traced else REGISTERED,
        layers=tuple(_layer(name, units, flow, traced) for name in units if _is_layer(units[name])),
        activations=_activations(units, flow, traced, functional),
        input_note=input_note,
    )


def audit_batch(
    module: nn.Module,
    batch: Any,
    *,
    draws: int = DEFAULT_DRAWS,
    seed: int = 0,
    source: str = "a training batch",
    rule: LossRule = LIGHTNING_RULE,
) -> AuditResult:
    """:func:`audit` of a module that takes training batches (a LightningModule), with the
    example input the loss rule's pass on ``batch`` gives its network (:func:`forward_input`).

    The network is audited when it holds all of ``module``'s parameters (``module`` itself, or
    a wrapped ``self.student``); otherwise (``self.head(self.encoder(x))``: no one network to
    trace), or when the batch gives no input, ``module`` is audited without an example input,
    and the result's ``input_note`` says why.

    Args:
        module: the module.
        batch: one of its training batches.
        draws: random weight draws of the origin check.
        seed: seed of the origin check's generator.
        source: where ``batch`` came from, for ``input_note``.
        rule: the loss rule of the loss pass (the run's: a Hugging Face model's
            ``model(**batch).loss``, a plain loop's function).
    """
    try:
        path, example = forward_input(module, batch, rule)
    except DynamicsError as error:
        return audit(module, None, draws=draws, seed=seed, input_note=f"none ({error})")
    network = module.get_submodule(path)
    held, total = (sum(p.numel() for p in m.parameters()) for m in (network, module))
    if held < total:
        note = (
            f"none (the loss pass calls {path} first, which holds {held:,} of the module's "
            f"{total:,} parameters: no one network to trace)"
        )
        return audit(module, None, draws=draws, seed=seed, input_note=note)
    note = source + (f", into {path}, which holds all the parameters" if path else "")
    return audit(network, example, draws=draws, seed=seed, input_note=note)


def forward_input(
    module: nn.Module, batch: Any, rule: LossRule = LIGHTNING_RULE
) -> tuple[str, Any]:
    """The network a loss pass on ``batch`` runs, and its input: how a LightningModule's
    training batch becomes an example input.

    The loss ``rule`` (:mod:`dynamics.passes.loss_rule`) takes ``module``'s loss on ``batch``
    once (no gradients; flags, buffers and random state restored). The network is the first
    module the pass calls from outside any other module's forward: ``module`` itself when the
    training step calls ``self(x)``, else the submodule it calls (``self.student(x)``).

    Returns:
        ``(path, input)``: the network's module path (``""``: ``module``) and what its forward
        got: the one positional argument, else all its arguments as
        :class:`~dynamics.params.batch_tree.ForwardArguments` (``self.model(input_ids=ids)``).

    Raises:
        DynamicsError: the loss cannot be taken on ``batch``, or no module is called.
    """
    calls: list[tuple[nn.Module, tuple, dict]] = []
    depth = [0]
    name = type(module).__name__

    def enter(m: nn.Module, args: tuple, kwargs: dict) -> None:
        if depth[0] == 0:
            calls.append((m, args, kwargs))
        depth[0] += 1

    def leave(m: nn.Module, args: tuple, output: Any) -> None:
        depth[0] -= 1

    handles = [
        handle
        for m in module.modules()
        for handle in (
            m.register_forward_pre_hook(enter, with_kwargs=True),
            m.register_forward_hook(leave),
        )
    ]
    try:
        with side_effect_free(module), torch.no_grad():
            rule(module, batch)
    except Exception as error:  # any failure of user code: no input to audit with
        raise DynamicsError(f"the loss of {name} on the batch failed: {one_line(error)}") from None
    finally:
        for handle in handles:
            handle.remove()
    if not calls:
        raise DynamicsError(f"the loss of {name} on the batch calls no module")
    network, args, kwargs = calls[0]
    path = next(n for n, m in module.named_modules() if m is network)
    if len(args) == 1 and not kwargs:
        return path, args[0]
    return path, ForwardArguments(tuple(args), dict(kwargs))


def token_embedding(model: nn.Module) -> tuple[str, nn.Embedding] | None:
    """``(path, module)`` of ``model``'s first module when it is an ``nn.Embedding`` (in
    registration order): a model that reads token ids, which no N(0, 1) input can be."""
    first = next(((n, m) for n, m in named_modules(model) if not next(m.children(), None)), None)
    return first if first is not None and isinstance(first[1], nn.Embedding) else None


@dataclass
class _Flow:
    """What the forward (or the registration order) says about the layers."""

    order: list[str] = field(default_factory=list)  # units, first call first
    followers: dict[str, list[str]] = field(default_factory=dict)
    readers: set[str] = field(default_factory=set)  # units reading the example input
    # activation: [sum, count, calls]; a module called twice is pooled and says so
    sums: dict[str, list[float]] = field(default_factory=dict)


def _units(model: nn.Module) -> dict[str, nn.Module]:
    """The modules the audit looks at, by path: leaves, and the attention and shifted
    activations whole (their submodules are their own business: ``MultiheadAttention`` calls
    ``out_proj``'s weight functionally, a shifted activation's φ is part of it)."""
    units: dict[str, nn.Module] = {}
    wholes: list[str] = []
    for name, module in named_modules(model):  # compiled or not, the model's own names
        if any(name.startswith(f"{w}.") or not w for w in wholes):
            continue
        if isinstance(module, (nn.MultiheadAttention, ShiftedActivation)):
            wholes.append(name)
            units[name] = module
        elif next(module.children(), None) is None:
            units[name] = module
    return units


def _is_layer(module: nn.Module) -> bool:
    return isinstance(module, LAYER_TYPES)


def _tensors(value: Any) -> list[torch.Tensor]:
    tree = value.tree if isinstance(value, ForwardArguments) else value
    return [t for t in flatten_batch(tree)[1] if t.numel()]


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _trace(model: nn.Module, units: dict[str, nn.Module], example_input: Any) -> _Flow:
    flow = _Flow()
    inputs = {_storage(t): t._version for t in _tensors(example_input)}
    producers: dict[int, tuple[str, int]] = {}  # storage -> (unit, version it left)
    arguments: list[dict[int, int]] = []  # storage -> version, per call in progress
    kept: list[torch.Tensor] = []  # alive until the end: no storage is reused mid-pass

    def before(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if name not in flow.followers:
                flow.order.append(name)
                flow.followers[name] = []
            tensors = _tensors((args, kwargs))
            kept.extend(tensors)
            for t in tensors:
                key = _storage(t)
                if inputs.get(key) == t._version:
                    flow.readers.add(name)
                source, version = producers.get(key, (None, None))
                if version == t._version and source != name:
                    if name not in flow.followers[source]:
                        flow.followers[source].append(name)
            arguments.append({_storage(t): t._version for t in tensors})

        return hook

    def after(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            given = arguments.pop()
            tensors = _tensors(output)
            kept.extend(tensors)
            for t in tensors:
                key = _storage(t)
                if given.get(key) == t._version or producers.get(key, (0, -1))[1] == t._version:
                    continue  # its input, or an earlier output, or a view of one, unchanged
                source = name
                if isinstance(module, _DropoutNd) and key not in given:
                    # A mask scales, never shifts: what follows dropout follows its input.
                    source = next(
                        (
                            producers[k][0]
                            for k, v in given.items()
                            if producers.get(k, (None, None))[1] == v
                        ),
                        name,
                    )
                producers[key] = (source, t._version)
            if name in flow.sums:
                total = flow.sums[name]
                total[2] += 1
                for t in tensors:
                    if t.is_floating_point():
                        total[0] += float(t.double().sum())
                        total[1] += t.numel()

        return hook

    for name, module in units.items():
        if isinstance(module, (*EXPECTED_TYPES, *MEASURED_TYPES, ShiftedActivation)):
            flow.sums[name] = [0.0, 0, 0]
    try:
        with _hooks(units, before, after), side_effect_free(model), torch.no_grad():
            call_forward(model, example_input)
    except Exception as error:  # any failure of user code: the example input does not fit
        raise DynamicsError(
            f"the forward of {type(model).__name__} on the example input failed: {one_line(error)}"
        ) from None
    return flow


@contextmanager
def _hooks(units: dict[str, nn.Module], before, after) -> Iterator[None]:
    handles = [
        handle
        for name, module in units.items()
        for handle in (
            module.register_forward_pre_hook(before(name), with_kwargs=True),
            module.register_forward_hook(after(name), with_kwargs=True),
        )
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _registered(units: dict[str, nn.Module]) -> _Flow:
    names = list(units)
    flow = _Flow(order=names)
    flow.followers = {name: names[i + 1 : i + 2] for i, name in enumerate(names)}
    flow.readers = set(names[:1])  # an embedding registered first reads the input, not a layer
    return flow


def _parameters(model: nn.Module) -> tuple[ParameterCount, ...]:
    """One row per module holding parameters; a tied parameter (an output layer sharing the
    embedding's weight) counts once, at the first module holding it, as ``parameters()``."""
    rows, seen = [], set()
    for name, module in named_modules(model):
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
        seen |= {id(p) for _, p in own}
        if own:
            bias = sum(p.numel() for n, p in own if is_bias(n))
            rows.append(
                ParameterCount(name, type(module).__name__, bias, sum(p.numel() for _, p in own))
            )
    return tuple(rows)


def _has_bias(module: nn.Module) -> bool:
    return any(is_bias(n.rpartition(".")[2]) and p.numel() for n, p in module.named_parameters())


def _learned_shift(norm: nn.Module) -> bool:
    return isinstance(getattr(norm, "bias", None), nn.Parameter)


def _layer(name: str, units: dict[str, nn.Module], flow: _Flow, traced: bool) -> Layer:
    module = units[name]
    followers = tuple(flow.followers.get(name, ()))
    called = name in flow.followers
    row = dict(module=name, kind=type(module).__name__, followed_by=followers)
    norms = [f for f in followers if isinstance(units[f], NORM_TYPES)]
    if _has_bias(module):
        absorbable, note = _absorption(module, name in flow.readers)
        cancelling = [f for f in norms if isinstance(units[f], _NormBase)]
        if cancelling:
            note += f"; redundant: {cancelling[0]} removes any per-channel constant"
        return Layer(
            **row, bias=True, absorbable=absorbable, shift_source=None, flagged=False, note=note
        )
    shifted = [f for f in norms if _learned_shift(units[f])]
    if shifted:
        source = shifted[0]
        if isinstance(units[source], _NormBase):
            note = f"a bias here would be redundant: {source} removes any per-channel constant"
        else:
            note = (
                f"{source}'s learned shift follows (a bias here would not be exactly redundant: "
                f"{source} removes only its mean over the normalized features)"
            )
        return Layer(
            **row, bias=False, absorbable=None, shift_source=source, flagged=False, note=note
        )
    if traced and not called:
        note = "not called by the forward on the example input: no verdict"
        return Layer(
            **row, bias=False, absorbable=None, shift_source=None, flagged=False, note=note
        )
    if norms:
        note = f"{norms[0]} follows but has no learned shift"
    elif traced and not followers:
        note = "no normalization follows (its output goes to functional code or out)"
    else:
        note = "no normalization with a learned shift follows"
    return Layer(**row, bias=False, absorbable=None, shift_source=None, flagged=True, note=note)


def _absorption(module: nn.Module, reads_input: bool) -> tuple[bool, str]:
    """Whether a constant input feature could replace ``module``'s bias exactly, and why."""
    if not reads_input:
        return False, "reads a hidden state, which has no constant coordinate to multiply"
    if isinstance(module, _ConvNd) and module.padding_mode == "zeros" and _pads(module):
        return False, "reads the input, but zero padding makes a constant channel 0 at the borders"
    if isinstance(module, nn.RNNBase) and module.num_layers > 1:
        return False, "layer 0's biases only; later layers read hidden states"
    if isinstance(module, nn.MultiheadAttention):
        return False, "the input projection's bias only; out_proj reads the attention output"
    return True, "reads the input: a constant input feature and one more weight column"


def _pads(conv: _ConvNd) -> bool:
    if isinstance(conv.padding, str):
        return conv.padding != "valid"
    return any(conv.padding)


def _origin(model: nn.Module, example_input: Any, draws: int, seed: int) -> Origin:
    def skipped(why: str) -> Origin:
        return Origin(False, 0, None, None, f"not checked ({why})")

    if example_input is None:
        return skipped("no example input")
    arguments = isinstance(example_input, ForwardArguments)
    tree, leaves = flatten_batch(example_input.tree if arguments else example_input)
    if not leaves or not all(t.is_floating_point() for t in leaves):
        return skipped("the input is not all floating point: token ids have no origin")
    try:
        live = example_input.tree if arguments else example_input
        zeros = [torch.zeros_like(t) for t in leaves]
        zero = unflatten_batch(tree, zeros, named_tuple_classes(live))
        zero = ForwardArguments(*zero) if arguments else zero
        twin = module_copy(model)
    except Exception as error:  # an unsupported batch type, a module that cannot be copied
        return skipped(f"cannot copy the model and zero its input: {one_line(error)}")
    generator = torch.Generator().manual_seed(seed)
    norms = []
    with side_effect_free(twin, "eval"), torch.no_grad():
        for _ in range(draws):
            for p in twin.parameters():
                fan_in = p[0].numel() if p.dim() >= 2 else 0
                draw = torch.randn(p.shape, generator=generator, dtype=torch.float64)
                p.copy_(draw / math.sqrt(fan_in) if fan_in else draw)
            try:
                output = _tensors(call_forward(twin, zero))
            except Exception as error:  # any failure of user code at the zero input
                return skipped(f"the forward at the zero input failed: {one_line(error)}")
            floats = [t for t in output if t.is_floating_point()]
            if not floats:
                return skipped("the output holds no floating-point tensor")
            norms.append(math.sqrt(sum(float(t.double().square().sum()) for t in floats)))
    nonzero = sum(1 for n in norms if n != 0)
    how = f"random weight draws (seed {seed}, eval mode, on a copy)"
    if not nonzero:
        note = f"f(0) = 0 in all {draws} {how}: the origin maps to the origin"
    else:
        note = f"‖f(0)‖ > 0 in {nonzero} of {draws} {how}, largest {max(norms):.4g}"
    return Origin(True, draws, nonzero == 0, max(norms), note)


def _activations(
    units: dict[str, nn.Module], flow: _Flow, traced: bool, functional: list[tuple[str, str]]
) -> tuple[Activation, ...]:
    rows = []
    for name, total in flow.sums.items():
        expected, note = _expected(units[name])
        measured = total[0] / total[1] if total[1] else None
        if not traced:
            note = "; ".join(filter(None, [note, "not measured: no example input"]))
        elif measured is None:
            note = "; ".join(filter(None, [note, "not called by the forward"]))
        elif total[2] > 1:
            pooled = f"called {total[2]} times in one forward: the mean of all its calls' outputs"
            note = "; ".join(filter(None, [note, pooled]))
        module = units[name]
        label = f"{type(module).__name__}({module.extra_repr()})"  # one line, unlike repr
        rows.append(Activation(name, label, expected, measured, note))
    rows += [
        Activation(
            where, function, None, None, f"not measured (functional call at {where or '<model>'})"
        )
        for where, function in functional
    ]
    return tuple(rows)


def _expected(module: nn.Module) -> tuple[float | None, str]:
    """E[out(z)], z ~ N(0, 1), of an activation module, or ``None`` and why not."""
    if isinstance(module, MEASURED_TYPES):
        return None, "E[φ(z)] not computed (learned slope or kinks away from 0)"
    if not isinstance(module, ShiftedActivation):
        return expected_value(module), ""
    if module.shift == "adaptive":
        return None, f"adaptive: each sample's mean over dim {module.dim} is 0"
    if module.shift == "expected":
        return 0.0, f"c = E[φ(z)] = {module.constant:.6f} subtracted"
    try:
        return expected_value(module.phi) - module.constant, ""
    except Exception as error:  # a φ that cannot run on float64
        return None, f"E[φ(z)] not computed: {one_line(error)}"
