"""What a run was, in words: the training loop, module class and init args, the loss rule, what
callbacks did to the module (activations shifted, biases set), layout, optimizer, scheduler,
precision, data and probes, as the recorder stored them at the fit's first batch. The report and
comparison pages show these lines; a field a run did not record says so.

A run file from before other loops were recorded keeps neither its loop nor its loss rule: the
recorder (its ``module`` attribute is there) ran under Lightning then, by the Lightning rule.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from dynamics.store import Run, names

__all__ = [
    "NOT_RECORDED_TEXT",
    "data_text",
    "edits_text",
    "init_args_of",
    "loop_of",
    "loss_rule_of",
    "loss_rule_text",
    "setup_rows",
]

#: What a field a run did not record reads as.
NOT_RECORDED_TEXT = "not recorded"
#: The loop and the loss rule of a recorder's file that names neither (written before loops
#: other than Lightning were recorded).
_LIGHTNING_LOOP, _LIGHTNING_RULE = "lightning", {"rule": "lightning"}


def init_args_of(module: Mapping[str, Any]) -> dict[str, Any] | None:
    """The init args a module record holds, a Hugging Face model's config values as
    ``config``; None when it holds none (no saved hyperparameters)."""
    args = dict(module.get("init_args") or {})
    config = module.get("hf_config")
    if isinstance(config, Mapping):
        args["config"] = config.get("values")
    return args or None


def _init_args_text(module: Mapping[str, Any]) -> str:
    args = dict(module.get("init_args") or {})
    config = module.get("hf_config")
    if not isinstance(config, Mapping):
        return _json(args) if args else f"{NOT_RECORDED_TEXT} (no saved hyperparameters)"
    values = config.get("values") or {}
    text = f"config {_short(config.get('class_path'))} ({len(values)} values recorded)"
    return f"{_json(args)}; {text}" if args else text


def loop_of(run: Run) -> str | None:
    """The training loop that wrote ``run`` (``"lightning"``, ``"huggingface"``, ...); None
    for a file no recorder wrote.

    Example::

        loop_of(open_run("runs/a.h5"))  # 'huggingface'
    """
    loop = run.attrs.get(names.ATTR_LOOP)
    if loop is None and names.ATTR_MODULE in run.attrs:
        return _LIGHTNING_LOOP
    return None if loop is None else str(loop)


def loss_rule_of(run: Run) -> dict[str, Any] | None:
    """The loss rule ``run``'s probes took their losses by, as the file keeps it
    (``{"rule": "lightning" | "output" | "function", "function": path}``); None for a file no
    recorder wrote."""
    rule = run.attrs.get(names.ATTR_LOSS_RULE)
    if rule is None and names.ATTR_MODULE in run.attrs:
        return dict(_LIGHTNING_RULE)
    return rule if isinstance(rule, dict) else None


def loss_rule_text(rule: Mapping[str, Any] | None) -> str:
    """A loss rule (:func:`loss_rule_of`) in words.

    Example::

        loss_rule_text({"rule": "output"})  # 'model(**batch).loss'
    """
    if rule is None:
        return NOT_RECORDED_TEXT
    kind = rule.get("rule")
    if kind == "lightning":
        return "Lightning rule (dynamics_loss, else training_step)"
    if kind == "output":
        return "model(**batch).loss"
    if kind == "function":
        return f"loss_fn {rule.get('function')}"
    return f"unknown rule {kind!r}"


def setup_rows(run: Run) -> list[tuple[str, str]]:
    """``(field, text)`` for every part of the fit's setup, in the order pages show them."""
    attrs = run.attrs
    module = attrs.get(names.ATTR_MODULE) or {}
    layout = attrs.get(names.ATTR_LAYOUT)
    submodules = attrs.get(names.ATTR_SUBMODULES)
    optimizers = attrs.get(names.ATTR_OPTIMIZERS)
    schedulers = attrs.get(names.ATTR_SCHEDULERS)
    data = attrs.get(names.ATTR_DATA)
    probes = attrs.get(names.ATTR_PROBES)
    return [
        ("loop", loop_of(run) or NOT_RECORDED_TEXT),
        ("module", module.get("class_path") or NOT_RECORDED_TEXT),
        ("init args", _init_args_text(module)),
        ("loss rule", loss_rule_text(loss_rule_of(run))),
        (
            "model edits",
            edits_text(run.model_edits) if run.model_edits is not None else NOT_RECORDED_TEXT,
        ),
        ("parameter layout", _layout_text(layout) if layout else NOT_RECORDED_TEXT),
        (
            "submodules",
            f"{len(submodules)} (class and settings of each recorded)"
            if submodules is not None
            else NOT_RECORDED_TEXT,
        ),
        ("θ0 sha256", run.theta0_sha256 or NOT_RECORDED_TEXT),
        (
            "optimizer",
            "; ".join(map(_optimizer_text, optimizers)) or "none"
            if optimizers is not None
            else NOT_RECORDED_TEXT,
        ),
        (
            "scheduler",
            "; ".join(map(_scheduler_text, schedulers)) or "none"
            if schedulers is not None
            else NOT_RECORDED_TEXT,
        ),
        ("torch.compile", _compiled_text(attrs.get(names.ATTR_COMPILED))),
        ("precision", str(attrs.get(names.ATTR_PRECISION) or NOT_RECORDED_TEXT)),
        ("data", data_text(data) if data else NOT_RECORDED_TEXT),
        (
            "probes",
            ", ".join(
                f"{p.get('class')} (every {p.get('every_n_steps')})"
                for p in probes
                if isinstance(p, dict)
            )
            if probes
            else NOT_RECORDED_TEXT,
        ),
    ]


def _compiled_text(compiled: Any) -> str:
    """Which parts of the module ``torch.compile`` compiled (``""``: the whole module)."""
    if compiled is None:
        return NOT_RECORDED_TEXT
    if not compiled:
        return "not compiled"
    return ", ".join("the whole module" if n == "" else n for n in compiled) + " compiled"


def data_text(description: Mapping[str, Any]) -> str:
    """A recorded data description in words: the DataModule's class and hyperparameters, and
    each training loader's dataset class, length, batch size and sampler."""
    parts = []
    datamodule = description.get("datamodule")
    if datamodule:
        args = datamodule.get("init_args")
        parts.append(_short(datamodule.get("class_path")) + (f" {_json(args)}" if args else ""))
    for loader in description.get("train", []):
        if "dataset" not in loader:
            parts.append(_short(loader.get("iterable")))
            continue
        length = loader.get("length")
        parts.append(
            f"{_short(loader['dataset'])}"
            + (f" of {length}" if length is not None else " (no length)")
            + _batch_text(loader.get("batch_size"))
            + f", {_short(loader.get('sampler'))}"
            + (", last batch dropped" if loader.get("drop_last") else "")
        )
    return "; ".join(parts)


def edits_text(edits: list[Mapping[str, Any]]) -> str:
    """What callbacks did to the module, in words: each callback with its settings, and each
    activation shifted (by how much) or bias set, grouped by what was done; ``none``."""
    return "; ".join(map(_edit_text, edits)) or "none"


def _edit_text(edit: Mapping[str, Any]) -> str:
    settings = edit.get("settings") or {}
    head = f"{_short(edit.get('class_path'))}({_settings_text(settings)})"
    rows = edit.get("table") or []
    if edit.get("edit") == names.EDIT_SHIFT:
        done = _grouped(
            (
                f"{row['activation']} − {row['c']:.6g}"
                if row.get("c") is not None
                else f"{row['activation']} − its {row.get('note') or 'mean'}",
                row["module"] or "<model>",
            )
            for row in rows
            if row.get("replaced")
        )
        left = _grouped(
            (f"{row['activation']} not shifted ({row.get('note')})", row["module"] or "<model>")
            for row in rows
            if not row.get("replaced")
        )
        return f"{head}: " + "; ".join(filter(None, [done, left]))
    if edit.get("edit") == names.EDIT_INIT_BIASES:
        return f"{head}: " + _grouped(
            (row["value"], f"{row['module']}.{row['parameter']}".lstrip(".")) for row in rows
        )
    return f"{head}: {len(rows)} changes"


def _grouped(pairs: Any) -> str:
    """``what at where, where; other at where``: places grouped by what was done there."""
    places: dict[str, list[str]] = {}
    for what, where in pairs:
        places.setdefault(what, []).append(where)
    return "; ".join(f"{what} at {', '.join(where)}" for what, where in places.items())


def _settings_text(settings: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={_json(v)}" for k, v in settings.items() if v not in ([], {}, None))


def _batch_text(batch_size: Any) -> str:
    # A loader without a batch size passes on what its dataset yields, batches included.
    return ", batched by the dataset" if batch_size is None else f", batch {batch_size}"


def _layout_text(layout: Mapping[str, Any]) -> str:
    size = sum(int(np.prod(shape)) for shape in layout["shapes"])
    return f"{len(layout['names'])} tensors, {size:,} parameters"


def _optimizer_text(optimizer: Mapping[str, Any]) -> str:
    groups = [
        ", ".join(f"{k}={_json(v)}" for k, v in sorted(group.items()) if v is not None)
        for group in optimizer.get("param_groups", [])
    ]
    return _short(optimizer.get("class_path")) + "".join(f"({g})" for g in groups)


def _scheduler_text(scheduler: Mapping[str, Any]) -> str:
    state = ", ".join(f"{k}={_json(v)}" for k, v in sorted(scheduler.get("state", {}).items()))
    every = f"every {scheduler.get('frequency')} {scheduler.get('interval')}(s)"
    return f"{_short(scheduler.get('class_path'))}({state}) {every}"


def _short(path: Any) -> str:
    return str(path).rsplit(".", 1)[-1]


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)
