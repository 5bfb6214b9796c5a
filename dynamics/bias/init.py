"""Bias initialization recipes: zeros, a constant, a small normal, the output layer's log-odds of
the class priors or mean target, and an open LSTM forget gate.

Each recipe is one call on a model, changes its biases in place and returns what it set, one
``BiasSet`` per parameter. ``init_biases(model, recipe, **kwargs)`` picks a recipe by name, for
configs. Bad input raises ``DynamicsError`` (a ``ValueError``) with one clear message before any
parameter changes.
"""

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from dynamics.bias.shift import pattern_list
from dynamics.errors import DynamicsError
from dynamics.params.globs import glob_any, matched
from dynamics.params.groups import is_bias


class BiasSet(NamedTuple):
    """One parameter a recipe changed: the module's name, the parameter's name, what was set.

    Example::

        for row in constant(model, 0.01):
            print(row.module, row.parameter, row.value)
    """

    module: str
    parameter: str
    value: str


def _bias_parameters(
    model: nn.Module, include: Sequence[str] = (), exclude: Sequence[str] = ()
) -> list[tuple[str, str, nn.Parameter]]:
    """Every bias parameter (:func:`is_bias`) of the modules whose names match ``include``
    (all when empty) and not ``exclude``."""
    include, exclude = pattern_list("include", include), pattern_list("exclude", exclude)
    named = [name for name, _ in model.named_modules()]
    unmatched = [p for p in (*include, *exclude) if not matched(p, named)]
    if unmatched:
        raise DynamicsError(f"bias recipe: pattern(s) {unmatched} match no module")
    found = [
        (module_name, name, parameter)
        for module_name, module in model.named_modules()
        if not (include and not glob_any(module_name, include))
        and not glob_any(module_name, exclude)
        for name, parameter in module.named_parameters(recurse=False)
        if is_bias(name)
    ]
    if not found:
        chosen = " among the modules the patterns choose" if include or exclude else ""
        raise DynamicsError(f"{type(model).__name__} has no bias parameters to initialize{chosen}")
    return found


def zeros(
    model: nn.Module, *, include: Sequence[str] = (), exclude: Sequence[str] = ()
) -> list[BiasSet]:
    """Set every bias parameter to 0, the standard practice.

    Every parameter :func:`is_bias` names: linear, convolution, normalization and
    recurrent layers alike. ``include`` and ``exclude`` choose modules by name pattern, as
    :func:`~dynamics.bias.shift_activations` does (``*``: one segment, ``**``: any depth):
    ``exclude=["head"]`` leaves the output layer's bias alone.

    Example::

        zeros(model, exclude=["head"])
    """
    return constant(model, 0.0, include=include, exclude=exclude)


def constant(
    model: nn.Module,
    value: float = 0.01,
    *,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
) -> list[BiasSet]:
    """Set every bias parameter (as in :func:`zeros`, with its ``include`` and ``exclude``) to
    ``value``; a small positive one (0.01) keeps ReLU units active at first.

    Example::

        constant(model, 0.01, include=["blocks.*.fc"])  # small positive biases for ReLU layers
    """
    table = []
    with torch.no_grad():
        for module_name, name, parameter in _bias_parameters(model, include, exclude):
            parameter.fill_(value)
            table.append(BiasSet(module_name, name, f"constant {value:g}"))
    return table


def normal(
    model: nn.Module,
    mean: float = 0.0,
    std: float = 0.01,
    *,
    seed: int = 0,
    generator: torch.Generator | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
) -> list[BiasSet]:
    """Draw every bias parameter (as in :func:`zeros`, with its ``include`` and ``exclude``)
    from N(mean, std²), reproducibly.

    The draws come from ``generator`` (a CPU generator), else from a new one seeded with ``seed``;
    the global random state is left alone.

    Example::

        normal(model, 0.0, 0.01, seed=0)  # its own generator: the global RNG is untouched
    """
    if std < 0:
        raise DynamicsError(f"normal needs std >= 0, got {std}")
    generator = generator if generator is not None else torch.Generator().manual_seed(seed)
    table = []
    with torch.no_grad():
        for module_name, name, parameter in _bias_parameters(model, include, exclude):
            draw = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            parameter.copy_(draw * std + mean)
            table.append(BiasSet(module_name, name, f"normal mean {mean:g} std {std:g}"))
    return table


def _output_layer(model: nn.Module, layer: str | None) -> tuple[str, nn.Linear]:
    """The named ``nn.Linear``, else the last one in module order; it must have a bias."""
    if layer is not None:
        head = dict(model.named_modules()).get(layer)
        if head is None:
            raise DynamicsError(f"{type(model).__name__} has no module named {layer!r}")
        if not isinstance(head, nn.Linear):
            raise DynamicsError(f"{layer!r} is a {type(head).__name__}, not an nn.Linear")
        name = layer
    else:
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        if not linears:
            raise DynamicsError(f"{type(model).__name__} has no nn.Linear output layer")
        name, head = linears[-1]
    if head.bias is None:
        raise DynamicsError(f"the output layer {name!r} has no bias (bias=False)")
    return name, head


def log_odds(
    model: nn.Module, priors: Sequence[float] | torch.Tensor, *, layer: str | None = None
) -> list[BiasSet]:
    """Set the output layer's bias so that the initial prediction is the class priors.

    With K outputs (softmax over K classes) and K priors: ``bias_k = log p_k``, so
    softmax(bias) = p exactly. With one output (sigmoid, binary) and two priors
    ``(p_negative, p_positive)``: ``bias = log(p_positive / p_negative)``, so sigmoid(bias) =
    p_positive. The network's prediction equals the priors where the output layer's weights
    contribute nothing (zero weights or zero input); the step-0 cross-entropy is then the priors'
    entropy.

    Example::

        log_odds(model, [0.9, 0.1])  # initial softmax over 2 classes = (0.9, 0.1)

    Args:
        model: the model; its output layer is ``layer``, else the last ``nn.Linear``.
        priors: the class frequencies, positive, summing to 1.
        layer: the output layer's module name.
    """
    name, head = _output_layer(model, layer)
    p = torch.as_tensor(priors, dtype=torch.float64).flatten()
    if len(p) < 2:
        raise DynamicsError(f"log_odds needs at least 2 class priors, got {len(p)}")
    if not bool((p > 0).all()):
        raise DynamicsError(f"class priors must be positive, got {p.tolist()}")
    if not math.isclose(float(p.sum()), 1.0, abs_tol=1e-6):
        raise DynamicsError(f"class priors must sum to 1, they sum to {float(p.sum()):g}")
    outputs = head.out_features
    if outputs == len(p):
        bias, how = p.log(), "log prior (softmax)"
    elif outputs == 1 and len(p) == 2:
        bias, how = (p[1] / p[0]).log().reshape(1), "log odds (sigmoid)"
    else:
        raise DynamicsError(
            f"{len(p)} class priors for the output layer {name!r} with {outputs} outputs "
            f"(need {outputs} priors, or 2 for a single sigmoid output)"
        )
    with torch.no_grad():
        head.bias.copy_(bias.to(head.bias.dtype))
    return [BiasSet(name, "bias", how)]


def mean_target(model: nn.Module, y: torch.Tensor, *, layer: str | None = None) -> list[BiasSet]:
    """Set the output layer's bias to the per-output mean of the regression targets ``y``.

    ``y`` is (N,) for one output or (N, outputs). Where the output layer's input has zero mean
    over the data, the network's mean prediction at step 0 equals the mean target.

    Example::

        mean_target(model, y_train)  # the output layer starts at the mean target
    """
    name, head = _output_layer(model, layer)
    y = torch.as_tensor(y)
    targets = y.reshape(-1, 1) if y.dim() == 1 else y
    if targets.dim() != 2 or len(targets) == 0:
        raise DynamicsError(
            f"mean_target needs targets of shape (N,) or (N, outputs), got {tuple(y.shape)}"
        )
    if targets.shape[1] != head.out_features:
        raise DynamicsError(
            f"targets with {targets.shape[1]} outputs for the output layer {name!r} "
            f"with {head.out_features} outputs"
        )
    with torch.no_grad():
        head.bias.copy_(targets.to(torch.float64).mean(0).to(head.bias.dtype))
    return [BiasSet(name, "bias", "mean target")]


def lstm_forget_gate(model: nn.Module, value: float = 1.0) -> list[BiasSet]:
    """Open the forget gate of every ``nn.LSTM`` and ``nn.LSTMCell``: its effective bias = value.

    PyTorch stacks the gates as (input, forget, cell, output), each ``hidden_size`` long, in both
    ``bias_ih`` and ``bias_hh``, which add. The value goes into ``bias_ih``'s forget quarter and
    ``bias_hh``'s forget quarter becomes 0, so their sum is exactly ``value``; every other entry is
    left as it was. Commonly 1 or 2.

    Example::

        lstm_forget_gate(model, 1.0)
    """
    lstms = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.LSTM | nn.LSTMCell)]
    if not lstms:
        raise DynamicsError(f"{type(model).__name__} has no nn.LSTM or nn.LSTMCell")
    for name, lstm in lstms:
        if not lstm.bias:
            raise DynamicsError(f"the LSTM {name!r} has no biases (bias=False)")
    table = []
    with torch.no_grad():
        for module_name, lstm in lstms:
            forget = slice(lstm.hidden_size, 2 * lstm.hidden_size)
            for name, parameter in lstm.named_parameters(recurse=False):
                if name.startswith("bias_ih"):
                    parameter[forget] = value
                    table.append(BiasSet(module_name, name, f"forget gate {value:g}"))
                elif name.startswith("bias_hh"):
                    parameter[forget] = 0.0
                    table.append(BiasSet(module_name, name, "forget gate 0"))
    return table


RECIPES: dict[str, Callable[..., list[BiasSet]]] = {
    "zeros": zeros,
    "constant": constant,
    "normal": normal,
    "log_odds": log_odds,
    "mean_target": mean_target,
    "lstm_forget_gate": lstm_forget_gate,
}


def check_recipe(recipe: str, options: dict[str, Any]) -> None:
    """Refuse, in one message, an unknown recipe or options its function does not take."""
    if recipe not in RECIPES:
        raise DynamicsError(f"unknown bias recipe {recipe!r}; choose from {', '.join(RECIPES)}")
    signature = inspect.signature(RECIPES[recipe])
    try:
        signature.bind(None, **options)
    except TypeError as error:
        takes = ", ".join(list(signature.parameters)[1:]) or "no options"
        raise DynamicsError(f"bias recipe {recipe} takes {takes}: {error}") from None


def init_biases(model: nn.Module, recipe: str, **kwargs: Any) -> list[BiasSet]:
    """Apply the recipe named ``recipe`` (a key of ``RECIPES``) with its keyword arguments.

    Example::

        init_biases(model, "constant", value=0.01, exclude=["head"])  # as a config names it
    """
    check_recipe(recipe, kwargs)
    return RECIPES[recipe](model, **kwargs)
