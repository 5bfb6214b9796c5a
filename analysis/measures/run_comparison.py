"""Comparison of runs, as numbers: alignment by step, loss crossover, config differences and
the ratio of top Hessian eigenvalues. No HTML and no plotting (the page is
:mod:`dynamics.analysis.pages.run_comparison`, its figures
:mod:`dynamics.analysis.figures.run_comparison`).

Series are aligned by optimizer step: the other run is read at the reference's recorded steps
inside the range both cover, linearly interpolated between its own records (exact where the
schedules agree, as they do for runs of one config).

Losses are compared after a centred moving average over ``2h + 1`` records with
``h = round(SMOOTH_FRACTION * n)`` (no smoothing for short series such as a handful of held-out
evaluations), so that step noise in the training loss does not produce spurious crossovers.

A comparison is only meaningful when the runs differ in the named variant alone. What each run
recorded about itself — parameter layout, θ0's hash, training loop, module class, init args,
loss rule, model edits (activations shifted and biases set by callbacks) and submodules,
optimizers, schedulers, precision, data, probes and config — is checked pair by pair
(:func:`comparability`) and summed up in one line (:func:`verdict`): "not comparable" when the
layouts differ, "different init", "differs in: …", and never agreement on what a run did not
record. Keys named in :data:`IGNORED_CONFIG_KEYS` name the variant.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from dynamics.analysis.measures.run_setup import (
    data_text,
    init_args_of,
    loop_of,
    loss_rule_of,
    loss_rule_text,
)
from dynamics.analysis.measures.smoothing import SMOOTH_FRACTION, moving_average
from dynamics.bias.audit_result import SETTINGS_KEY as AUDIT_SETTINGS_KEY
from dynamics.store import Metric, Run, names

__all__ = [
    "DIFFERS",
    "IGNORED_CONFIG_KEYS",
    "NOT_RECORDED",
    "SAME",
    "SMOOTH_FRACTION",
    "VARIANT",
    "Check",
    "ComparedLoss",
    "Crossover",
    "align",
    "comparability",
    "compared_loss",
    "config_differences",
    "crossing_text",
    "crossover",
    "differing_keys",
    "eigenvalue_ratio",
    "finite",
    "flatten_config",
    "loss_crossover",
    "smooth",
    "top_eigenvalue",
    "verdict",
]

#: Smoothing half-width as a fraction of a loss series' records: about 4% of the run per window,
#: the scale the overshoot detector smooths on as well.
#: Config keys (at any depth) that name the variant rather than change the experiment.
IGNORED_CONFIG_KEYS = frozenset({"variant", "shift", "run_name"})
#: The statuses of a :class:`Check`.
SAME, DIFFERS, VARIANT, NOT_RECORDED = "same", "differs", "variant", "not recorded"


@dataclass(frozen=True)
class Crossover:
    """Which of two runs ends ahead on a loss, and from which step on.

    Attributes:
        metric: the loss compared (``"held-out loss (val_loss)"`` or ``"train loss"``).
        first_leader: the run with the lower smoothed loss at the first aligned step, or None
            on a tie.
        winner: the run with the lower smoothed loss at the last aligned step, or None on a tie.
        step: the step where the winner overtook for good (linear interpolation of where the
            smoothed difference crosses zero), or None when it led at every aligned step.
        final_gap: the loser's final smoothed loss minus the winner's (>= 0).
        final_gap_relative: ``final_gap`` over the loser's final smoothed loss.
        bracket: the recorded steps either side of the crossing, of both runs' records (the
            last at or before it, the first after it): the records place the crossing only
            within them, ``step`` interpolates inside; None with ``step``.
    """

    metric: str
    first_leader: str | None
    winner: str | None
    step: float | None
    final_gap: float
    final_gap_relative: float
    bracket: tuple[int, int] | None = None


@dataclass(frozen=True)
class ComparedLoss:
    """The loss two runs are compared on, as each recorded it.

    Attributes:
        metric: what it is (``"held-out loss (val_loss)"`` or ``"train loss"``).
        reference: the reference run's.
        other: the other run's.
    """

    metric: str
    reference: Metric
    other: Metric


@dataclass(frozen=True)
class Check:
    """One comparability check of two runs.

    Attributes:
        name: what is compared (``"parameter layout"``, ``"θ0"``, ``"optimizer"``, ...).
        status: :data:`SAME`, :data:`DIFFERS`, :data:`VARIANT` (differs only in keys that
            name the variant, :data:`IGNORED_CONFIG_KEYS`) or :data:`NOT_RECORDED` (one run or
            both did not record it: nothing can be said).
        details: what differs, or what agrees, in a line.
    """

    name: str
    status: str
    details: str

    @property
    def differs(self) -> bool:
        """Whether the runs differ in it beyond the variant."""
        return self.status == DIFFERS


def smooth(values: ArrayLike, fraction: float = SMOOTH_FRACTION) -> np.ndarray:
    """:func:`moving_average` with a half-width of ``round(fraction * n)`` records."""
    x = np.asarray(values, dtype=float)
    return moving_average(x, round(fraction * len(x)))


def finite(step: ArrayLike, values: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """``(step, values)`` without the records whose value is NaN or infinite."""
    step, values = np.asarray(step), np.asarray(values, dtype=float)
    keep = np.isfinite(values)
    return step[keep], values[keep]


def align(
    step_a: ArrayLike, a: ArrayLike, step_b: ArrayLike, b: ArrayLike
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read series ``b`` at the steps of ``a`` that lie inside ``b``'s range.

    Returns:
        ``(steps, a at steps, b interpolated at steps)``; empty when the ranges do not meet.
    """
    step_a, a = np.asarray(step_a, dtype=float), np.asarray(a, dtype=float)
    step_b, b = np.asarray(step_b, dtype=float), np.asarray(b, dtype=float)
    if not len(step_a) or not len(step_b):
        return np.empty(0), np.empty(0), np.empty(0)
    inside = (step_a >= step_b[0]) & (step_a <= step_b[-1])
    steps = step_a[inside]
    return steps, a[inside], np.interp(steps, step_b, b)


def crossover(
    step_a: ArrayLike,
    loss_a: ArrayLike,
    step_b: ArrayLike,
    loss_b: ArrayLike,
    names: tuple[str, str] = ("a", "b"),
    metric: str = "loss",
    fraction: float = SMOOTH_FRACTION,
) -> Crossover | None:
    """Where the run that ends ahead on a loss took the lead for good.

    Non-finite records are dropped, each loss is smoothed (:func:`smooth`), and ``b`` is read
    at ``a``'s steps (:func:`align`).

    Args:
        step_a: steps of run a's loss.
        loss_a: run a's loss.
        step_b: steps of run b's loss.
        loss_b: run b's loss.
        names: the two runs' names, as the result names them.
        metric: what the loss is, as the result names it.
        fraction: smoothing half-width as a fraction of each series' records.

    Returns:
        The crossover, or None when fewer than two aligned steps remain.

    Example::

        result = crossover(steps_a, loss_a, steps_b, loss_b, names=("a", "b"))
        result.step, result.winner
    """
    sa, a = finite(step_a, loss_a)
    sb, b = finite(step_b, loss_b)
    steps, a, b = align(sa, smooth(a, fraction), sb, smooth(b, fraction))
    if len(steps) < 2:
        return None
    gap = a - b  # positive where b is lower, i.e. ahead
    sign = np.sign(gap)

    def leader(s: float) -> str | None:
        return None if s == 0 else names[1] if s > 0 else names[0]

    final = sign[-1]
    behind = np.flatnonzero(sign != final)
    step = bracket = None
    if final != 0 and behind.size:
        i = behind[-1]  # the winner is strictly ahead from record i + 1 on
        step = float(steps[i] + (steps[i + 1] - steps[i]) * gap[i] / (gap[i] - gap[i + 1]))
        # b was read between its records by interpolation: its own records bound it too.
        if gap[i] == 0:  # the tie is at a record
            bracket = (int(steps[i]), int(steps[i]))
        else:
            lo = min(x[x <= steps[i]][-1] for x in (sa, sb))
            hi = max(x[x >= steps[i + 1]][0] for x in (sa, sb))
            bracket = (int(lo), int(hi))
    loser_final = max(a[-1], b[-1])
    return Crossover(
        metric=metric,
        first_leader=leader(sign[0]),
        winner=leader(final),
        step=step,
        final_gap=float(abs(gap[-1])),
        final_gap_relative=float(abs(gap[-1]) / loser_final) if loser_final > 0 else float("nan"),
        bracket=bracket,
    )


def compared_loss(reference: Run, other: Run) -> ComparedLoss | None:
    """The loss two runs are compared on: held-out when both have two finite values of it
    (it measures what the comparison is about), else training; None when neither is shared."""
    held = reference.heldout_loss(), other.heldout_loss()
    if all(h is not None and np.isfinite(h.values).sum() >= 2 for h in held):
        return ComparedLoss(f"held-out loss ({held[0].name})", *held)
    train = reference.train_loss(), other.train_loss()
    if None in train:
        return None
    return ComparedLoss("train loss", *train)


def loss_crossover(reference: Run, other: Run, names: tuple[str, str]) -> Crossover | None:
    """:func:`crossover` of the two runs on their :func:`compared_loss`, or None.

    Example::

        loss_crossover(open_run("runs/a.h5"), open_run("runs/b.h5"), ("a", "b"))
    """
    loss = compared_loss(reference, other)
    if loss is None:
        return None
    ref, oth = loss.reference, loss.other
    return crossover(ref.step, ref.values, oth.step, oth.values, names, loss.metric)


def top_eigenvalue(run: Run) -> Metric | None:
    """λ1, the first column of the recorded top Hessian eigenvalues, or None."""
    rows = run.recorded(names.HESSIAN)
    if rows is None or names.HESSIAN_EIGENVALUES not in rows.values:
        return None
    return Metric("lambda_1", rows.step, rows[names.HESSIAN_EIGENVALUES][:, 0])


def eigenvalue_ratio(reference: Run, other: Run) -> tuple[np.ndarray, np.ndarray] | None:
    """``(steps, λ1 of other / λ1 of reference)`` where the reference's λ1 is positive."""
    ref, oth = top_eigenvalue(reference), top_eigenvalue(other)
    if ref is None or oth is None:
        return None
    steps, a, b = align(*finite(ref.step, ref.values), *finite(oth.step, oth.values))
    positive = a > 0
    if not positive.any():
        return None
    return steps[positive], b[positive] / a[positive]


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{dotted key: value}``."""
    flat = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, path + "."))
        else:
            flat[path] = value
    return flat


def config_differences(
    a: Mapping[str, Any], b: Mapping[str, Any], keep_variant: bool = False
) -> dict[str, tuple[Any, Any]]:
    """Dotted config keys whose values differ, ``{key: (value in a, value in b)}``.

    Keys in :data:`IGNORED_CONFIG_KEYS` (at any depth) are left out unless ``keep_variant``;
    a key present in one config only differs, with None for the missing side.
    """
    flat_a, flat_b = flatten_config(a), flatten_config(b)
    return {
        key: (flat_a.get(key), flat_b.get(key))
        for key in sorted(flat_a.keys() | flat_b.keys())
        if (keep_variant or key.rsplit(".", 1)[-1] not in IGNORED_CONFIG_KEYS)
        and (key not in flat_a or key not in flat_b or flat_a[key] != flat_b[key])
    }


def differing_keys(configs: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Dotted keys whose values are not the same in all configs, with each config's value as
    JSON (``null`` where a config lacks the key); variant keys included."""
    flats = [flatten_config(config) for config in configs]
    values = {key: [_json(flat.get(key)) for flat in flats] for key in sorted(set().union(*flats))}
    return {key: texts for key, texts in values.items() if len(set(texts)) > 1}


def comparability(
    reference: Run, other: Run, labels: tuple[str, str] = ("the reference", "the other run")
) -> list[Check]:
    """What two runs share and where they differ, check by check, from what each recorded.

    The checks: the parameter layout (names and shapes), θ0's hash, the training loop (a
    difference is shown, and is no reason on its own not to compare), the module's class, its
    init args (saved hyperparameters; a Hugging Face model's config), its loss rule (another
    rule is another loss), the model edits (each editing callback's class and
    settings, e.g. ``ShiftActivations(shift=...)``: a run shifted and one not differ there),
    its submodules (class and settings of each), the
    optimizers and schedulers (class and hyperparameters), the precision, the data (the
    config's ``data`` section and the recorded description), the probes' settings and the rest
    of the config. Something one run did not record is ``"not recorded"``, never the same.

    Args:
        reference: one run; its values come first in every ``a vs b`` of the details.
        other: the other run.
        labels: the two runs' names, as the details name a run that lacks a record.

    Example::

        checks = comparability(open_run("runs/b.h5"), open_run("runs/a.h5"), ("b", "a"))
        verdict(checks)  # 'comparable' or what differs
    """
    a, b = reference.attrs, other.attrs
    layout = _layout_check(a.get(names.ATTR_LAYOUT), b.get(names.ATTR_LAYOUT), labels)
    module_a, module_b = (x.get(names.ATTR_MODULE) or {} for x in (a, b))
    args = init_args_of(module_a), init_args_of(module_b)
    # A module that saves no hyperparameters records {}: nothing to compare.
    init_args = _check("init args", *args, labels, absent="no saved hyperparameters")
    edit_settings = [_edit_settings(run.model_edits) for run in (reference, other)]
    edits = _check("model edits", *edit_settings, labels)
    variant = [
        key.rsplit(".", 1)[-1]
        for key in (_flat_differences(*args) if None not in args else {})
        if key.rsplit(".", 1)[-1] in IGNORED_CONFIG_KEYS
    ]
    if edits.status == VARIANT:  # ShiftActivations(shift=...) explains the shifted modules
        variant += [key.rsplit(".", 1)[-1] for key in _flat_differences(*edit_settings)]
    differences = config_differences(reference.config, other.config, keep_variant=True)
    rest = {k: v for k, v in differences.items() if k.split(".", 1)[0] != "data"}
    rules = [loss_rule_of(run) for run in (reference, other)]
    loss_rule = _check("loss rule", *rules, labels)
    if loss_rule.status in (SAME, DIFFERS):  # the rule's own words, not its record's keys
        words = (
            [loss_rule_text(rules[0])] if loss_rule.status == SAME else map(loss_rule_text, rules)
        )
        loss_rule = Check(loss_rule.name, loss_rule.status, " vs ".join(words))
    return [
        layout,
        _theta0_check(reference.theta0_sha256, other.theta0_sha256, labels),
        _check("loop", loop_of(reference), loop_of(other), labels),
        _check("module", module_a.get("class_path"), module_b.get("class_path"), labels),
        init_args,
        loss_rule,
        edits,
        _submodules_check(
            a.get(names.ATTR_SUBMODULES), b.get(names.ATTR_SUBMODULES), labels, variant
        ),
        _check("optimizer", a.get(names.ATTR_OPTIMIZERS), b.get(names.ATTR_OPTIMIZERS), labels),
        _check("scheduler", a.get(names.ATTR_SCHEDULERS), b.get(names.ATTR_SCHEDULERS), labels),
        _check("precision", a.get(names.ATTR_PRECISION), b.get(names.ATTR_PRECISION), labels),
        _data_check(
            a.get(names.ATTR_DATA),
            b.get(names.ATTR_DATA),
            reference.config.get("data"),
            other.config.get("data"),
            labels,
        ),
        _check(
            "probes", _by_name(a.get(names.ATTR_PROBES)), _by_name(b.get(names.ATTR_PROBES)), labels
        ),
        _config_check(reference.config, other.config, rest, labels),
    ]


def verdict(checks: Sequence[Check]) -> str:
    """One line saying whether two runs can be compared and how they differ.

    ``"not comparable: the parameter layouts differ"`` or ``"different init (θ0 differs)"``,
    each followed by the other checks that differ; else ``"differs in: …"`` naming every check
    that differs with its details, ``"differs only in the variant: …"``, or no difference in
    what was recorded. The checks a run did not record follow (``"not recorded: …"``), so a
    missing record never reads as agreement.
    """
    by_name = {check.name: check for check in checks}
    differing = [c for c in checks if c.status == DIFFERS]
    unknown = [c.name for c in checks if c.status == NOT_RECORDED]
    variant = [c for c in checks if c.status == VARIANT]
    if by_name.get("parameter layout", _UNSEEN).status == DIFFERS:
        text = "not comparable: the parameter layouts differ"
        shown = [c for c in differing if c.name not in ("parameter layout", "θ0")]
    elif by_name.get("θ0", _UNSEEN).status == DIFFERS:
        text = "different init (θ0 differs)"
        shown = [c for c in differing if c.name != "θ0"]
    elif differing:
        text, shown = "", differing
    elif variant:
        text = "differs only in the variant: " + "; ".join(
            f"{c.name} ({c.details})" for c in variant
        )
        shown = []
    elif unknown:
        text, shown = "no difference in what both runs recorded", []
    else:
        text, shown = "no difference in anything recorded", []
    if shown:
        listed = "; ".join(f"{c.name} ({c.details})" for c in shown)
        text = f"{text}; also differs in: {listed}" if text else f"differs in: {listed}"
    if unknown:
        text += f"; not recorded: {', '.join(unknown)}"
    return text


def _check(
    name: str, a: Any, b: Any, labels: tuple[str, str], absent: str = "not recorded"
) -> Check:
    """Two recorded values: same, differing (what differs, key by key), or not recorded."""
    if a is None or b is None:
        return Check(name, NOT_RECORDED, _missing(a, b, labels, absent))
    if a == b:
        return Check(name, SAME, _agreement(a))
    if not all(isinstance(x, (dict, list)) for x in (a, b)):
        return Check(name, DIFFERS, f"{a} vs {b}")
    if a == [] or b == []:  # no scheduler in one run: what the other has is the difference
        return Check(name, DIFFERS, f"{_classes(a)} vs {_classes(b)}")
    differences = _flat_differences(a, b)
    if differences and all(k.rsplit(".", 1)[-1] in IGNORED_CONFIG_KEYS for k in differences):
        return Check(name, VARIANT, _describe(differences))
    return Check(name, DIFFERS, _describe(differences) or f"{_json(a)} vs {_json(b)}")


def _submodules_check(a: Any, b: Any, labels: tuple[str, str], variant: list[str]) -> Check:
    """Each submodule's class and settings (``extra_repr``), matched by name.

    A difference only in the settings of modules whose settings name a variant key that the
    init args differ in (``shift=...`` when the runs differ in ``shift``) is the variant.
    """
    name = "submodules"
    if a is None or b is None:
        return Check(name, NOT_RECORDED, _missing(a, b, labels, "not recorded"))
    if a == b:
        return Check(name, SAME, f"{len(a)} submodules agree in class and settings")
    keys = sorted(a.keys() | b.keys(), key=_natural)
    changed = {k: (a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)}

    def explained(pair: tuple[Any, Any]) -> bool:
        x, y = pair
        return (
            x is not None
            and y is not None
            and x[0] == y[0]
            and any(f"{key}=" in x[1] and f"{key}=" in y[1] for key in variant)
        )

    shown = {k: (_module_text(x, y), _module_text(y, x)) for k, (x, y) in changed.items()}
    details = "; ".join(f"{k}: {x} vs {y}" for k, (x, y) in list(shown.items())[:4])
    if len(shown) > 4:
        details += f"; and {len(shown) - 4} more"
    status = VARIANT if all(map(explained, changed.values())) else DIFFERS
    return Check(name, status, details)


def _module_text(mine: Any, theirs: Any) -> str:
    """``Class(settings)``, with the class's full path when the short names would agree."""
    if mine is None:
        return "absent"
    path, settings = mine
    short = path.rsplit(".", 1)[-1]
    if theirs is not None and theirs[0] != path and theirs[0].rsplit(".", 1)[-1] == short:
        short = path
    return f"{short}({settings})"


def _layout_check(a: Any, b: Any, labels: tuple[str, str]) -> Check:
    name = "parameter layout"
    if not a or not b:
        return Check(name, NOT_RECORDED, _missing(a or None, b or None, labels, "not recorded"))
    shapes = [dict(zip(x["names"], map(tuple, x["shapes"]))) for x in (a, b)]
    sizes = [sum(int(np.prod(s)) for s in x.values()) for x in shapes]
    counts = f"{len(shapes[0])} tensors, {sizes[0]:,} parameters"
    if list(shapes[0].items()) == list(shapes[1].items()):
        return Check(name, SAME, counts)
    first = next(
        (
            f"{k}: {shapes[0].get(k, 'absent')} vs {shapes[1].get(k, 'absent')}"
            for k in [*shapes[0], *shapes[1]]
            if shapes[0].get(k) != shapes[1].get(k)
        ),
        "same tensors in another order",
    )
    other = f"{len(shapes[1])} tensors, {sizes[1]:,} parameters"
    return Check(name, DIFFERS, f"{counts} vs {other}; first difference {first}")


def _theta0_check(a: str | None, b: str | None, labels: tuple[str, str]) -> Check:
    if a is None or b is None:
        return Check("θ0", NOT_RECORDED, _missing(a, b, labels, "θ0 hash not recorded"))
    if a == b:
        return Check("θ0", SAME, f"sha256 {a[:12]}… in both")
    return Check("θ0", DIFFERS, f"sha256 {a[:12]}… vs {b[:12]}…")


def _data_check(a: Any, b: Any, config_a: Any, config_b: Any, labels: tuple[str, str]) -> Check:
    """The data: the recorded description (DataModule, loaders) and the config's ``data``
    section. Agreement is agreement of descriptions: the samples are never compared."""
    described = _check("data", a or None, b or None, labels, absent="no data description")
    config = None
    if config_a and config_b:
        config = config_differences({"data": config_a}, {"data": config_b})
    if config:
        details = _describe(config)
        if described.status == DIFFERS:
            details += "; " + described.details
        return Check("data", DIFFERS, details)
    if described.status == DIFFERS:
        return described
    agreed = ["the configs' data sections agree"] if config is not None else []
    if described.status == SAME:
        agreed.append(f"same description: {data_text(a)}")
    elif agreed:
        agreed.append(described.details)
    if not agreed:
        return described
    return Check("data", SAME, "; ".join(agreed) + "; samples not compared")


def _config_check(
    a: Mapping[str, Any],
    b: Mapping[str, Any],
    differences: dict[str, tuple[Any, Any]],
    labels: tuple[str, str],
) -> Check:
    """The recorder's ``config=`` outside its data section; an empty one was not given."""
    if not a or not b:
        return Check("config", NOT_RECORDED, _missing(a or None, b or None, labels, "no config="))
    variant = {k: v for k, v in differences.items() if k.rsplit(".", 1)[-1] in IGNORED_CONFIG_KEYS}
    if len(variant) < len(differences):
        rest = {k: v for k, v in differences.items() if k not in variant}
        return Check("config", DIFFERS, _describe(rest))
    if variant:
        return Check("config", VARIANT, _describe(variant))
    return Check("config", SAME, f"{len(flatten_config(a))} keys agree")


def _missing(a: Any, b: Any, labels: tuple[str, str], what: str) -> str:
    if a is None and b is None:
        return f"{what} in either run"
    return f"{what} in {labels[0] if a is None else labels[1]}"


def _edit_settings(edits: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Each model edit's callback and settings; its table follows from them and the module,
    which other checks compare."""
    if edits is None:
        return None
    return [{k: e.get(k) for k in ("class_path", "settings")} for e in edits]


def _by_name(probes: Any) -> dict[str, Any] | None:
    """The probes' records keyed by probe name, so they are matched whatever their order."""
    if not isinstance(probes, list):
        return None
    return {str(p.get("name")): _setup_of(p) for p in probes if isinstance(p, dict)}


def _setup_of(probe: dict[str, Any]) -> dict[str, Any]:
    """A probe's record without what it measured: BiasAudit keeps its audit of θ0 in its
    settings, which differs between seeds of the same setup."""
    settings = probe.get("settings")
    if not isinstance(settings, dict) or AUDIT_SETTINGS_KEY not in settings:
        return probe
    return {**probe, "settings": {k: v for k, v in settings.items() if k != AUDIT_SETTINGS_KEY}}


def _flat_differences(a: Any, b: Any) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (a's, b's)}`` where two recorded values differ; lists are indexed by
    position (``param_groups.0.lr``), except that one-element lists on both sides are not."""
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b) == 1:
        a, b = a[0], b[0]
    flat_a, flat_b = _flat(a), _flat(b)
    keys = [
        key
        for key in sorted(flat_a.keys() | flat_b.keys(), key=_natural)
        if key not in flat_a or key not in flat_b or flat_a[key] != flat_b[key]
    ]
    # Classes first, then what both record differently, then what one records alone.
    keys.sort(key=lambda k: (not k.endswith("class_path"), k not in flat_a or k not in flat_b))
    return {key: (flat_a.get(key, _ABSENT), flat_b.get(key, _ABSENT)) for key in keys}


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, list) and value and all(isinstance(v, (dict, list)) for v in value):
        value = {str(i): v for i, v in enumerate(value)}
    if isinstance(value, Mapping) and value:
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(_flat(item, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip(".") or "value": value}


def _natural(key: str) -> list[tuple[int, int | str]]:
    """Sort key of a dotted key: numeric parts in numeric order (``blocks.2`` < ``blocks.10``)."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in key.split(".")]


def _agreement(value: Any) -> str:
    """What two runs that agree recorded, in a short line."""
    if value == []:
        return "none in either run"
    if isinstance(value, list) and all(isinstance(v, dict) and "class_path" in v for v in value):
        classes = ", ".join(v["class_path"].rsplit(".", 1)[-1] for v in value)
        return f"{classes}; every recorded hyperparameter agrees"
    if isinstance(value, (dict, list)):
        return f"all {len(_flat(value))} recorded values agree"
    return str(value)


def _classes(value: Any) -> str:
    """The classes a recorded list of optimizers or schedulers names, or ``none``."""
    return ", ".join(str(v.get("class_path")).rsplit(".", 1)[-1] for v in value) or "none"


def _describe(differences: dict[str, tuple[Any, Any]]) -> str:
    shown = [f"{k}: {_text(a)} vs {_text(b)}" for k, (a, b) in list(differences.items())[:6]]
    more = len(differences) - len(shown)
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")


_UNSEEN = Check("", NOT_RECORDED, "")  # a check absent from a comparison
_ABSENT = object()  # a key one run records and the other does not


def _text(value: Any) -> str:
    return "absent" if value is _ABSENT else _json(value)


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def crossing_text(result: Crossover) -> str:
    """``between 100 and 200 (interpolated 185)``: the records bracket the crossing, and an
    interpolated step alone would claim a precision evaluations every 100 steps do not have."""
    lo, hi = result.bracket
    if hi - lo <= 1:
        return f"{result.step:.0f}"
    return f"between {lo} and {hi} (interpolated {result.step:.0f})"
