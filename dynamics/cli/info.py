"""``dynamics info``: what a run file holds, in a few lines or as JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dynamics.cli.overrides import overrides_text


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``info`` to ``commands``."""
    info = commands.add_parser("info", help="summarize a run file")
    info.add_argument("run", type=Path)
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    """Print the run's status, training loop and loss rule, parameters, events, series,
    snapshots, vectors and config."""
    from dynamics.analysis.measures.run_setup import loop_of, loss_rule_of
    from dynamics.store import open_run

    run = open_run(args.run)
    setup = {"loop": loop_of(run), "loss_rule": loss_rule_of(run)}
    summary = run.summary() | {"setup": setup, "parameters": _parameters(run)}
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    print(f"{summary['path']}  (run {summary['run_name']}, schema v{summary['schema_version']})")
    print(f"  status {_status_line(summary['status'])}")
    print(f"  {_setup_line(setup)}")
    print(f"  parameters {_parameters_line(summary['parameters'])}")
    if summary["diverged_at"] is not None:
        print(f"  diverged at step {summary['diverged_at']}: its loss or parameters not finite")
    for event in summary["events"]:
        print(f"  event  step {event['step']} {event['probe']} {event['kind']}: {event['message']}")
    for group, info in summary["series"].items():
        shapes = ", ".join(f"{n}{tuple(s) if s else ''}" for n, s in info["series"].items())
        span = f"steps {info['first_step']}..{info['last_step']}" if info["rows"] else "empty"
        print(f"  {group:<18} {info['rows']:>7} rows  {span:<20} {shapes}")
    snapshots = _snapshot_line(summary)
    if snapshots:
        print(f"  snapshots {snapshots}")
    for name, shape in summary["vectors"].items():
        print(f"  vector {name:<11} {tuple(shape)}")
    config = summary["attrs"].get("config")
    overrides = overrides_text(config if isinstance(config, dict) else None)
    if overrides:
        print(f"  overrides: {overrides}")
    if config:
        print(f"  config {json.dumps(config, sort_keys=True)}")
    return 0


def _setup_line(setup: dict) -> str:
    """``loop huggingface, loss rule model(**batch).loss``."""
    from dynamics.analysis.measures.run_setup import NOT_RECORDED_TEXT, loss_rule_text

    loop = setup["loop"] or NOT_RECORDED_TEXT
    return f"loop {loop}, loss rule {loss_rule_text(setup['loss_rule'])}"


def _parameters(run) -> dict:
    """The model the run recorded, as the unsharded model has it (a sharded fit's file holds
    the same layout and hashes as an unsharded one's): sizes, tensors and hashes."""
    from dynamics.store import names

    layout, buffers = run.layout, run.buffer_layout
    return {
        "trainable": layout.size if layout is not None else None,
        "tensors": len(layout.names) if layout is not None else None,
        "theta0_sha256": run.theta0_sha256,
        "frozen_sha256": run.attrs.get(names.ATTR_FROZEN_SHA256),
        "buffers": sum(buffers.sizes().values()) if buffers is not None else None,
        "buffer_tensors": len(buffers.names) if buffers is not None else None,
    }


def _parameters_line(parameters: dict) -> str:
    """``848 trainable in 16 tensors (θ0 sha256 1a2b3c4d5e6f), frozen ones too; buffers 17
    in 3 tensors``."""
    if parameters["trainable"] is None:
        return "not recorded"
    line = f"{parameters['trainable']} trainable in {parameters['tensors']} tensors"
    if parameters["theta0_sha256"]:
        line += f" (θ0 sha256 {parameters['theta0_sha256'][:12]})"
    if parameters["frozen_sha256"]:
        line += f", frozen ones too (sha256 {parameters['frozen_sha256'][:12]})"
    if parameters["buffer_tensors"]:
        line += f"; buffers {parameters['buffers']} in {parameters['buffer_tensors']} tensors"
    return line


def _snapshot_line(summary: dict) -> str:
    """``19 of θ (every 11 steps, 3.6 MiB; default budget 4 MiB)``: what `plane` can draw
    from; empty for a run without ParameterDisplacement's plan."""
    from dynamics.store import names

    probes = summary["attrs"].get(names.ATTR_PROBES)
    plans = [
        probe.get("settings", {}).get("snapshots")
        for probe in (probes if isinstance(probes, list) else [])
        if isinstance(probe, dict) and isinstance(probe.get("settings"), dict)
    ]
    plan = next((p for p in plans if isinstance(p, dict)), None)
    if plan is None:
        return ""
    count = summary["series"].get(names.SNAPSHOTS, {}).get("rows", 0)
    if not count:
        return "0 of θ (θ0 and θT only)"
    bytes_each = plan.get("bytes_each") or 0
    budget = plan.get("budget_mb")
    kind = "default budget" if plan.get("budget") == "default" else "budget"
    limit = f"; {kind} {budget:g} MiB" if isinstance(budget, (int, float)) else ""
    return (
        f"{count} of θ (every {plan.get('period')} steps, "
        f"{count * bytes_each / 2**20:.1f} MiB{limit})"
    )


def _status_line(status: dict) -> str:
    """``finished at step 1999 after 93.2 s``, ``crashed (ValueError: ...)``, ..."""
    line = status["state"]
    if status["exception"]:
        line += f" ({status['exception']})"
    if status["last_step"] is not None:
        line += f", last flushed step {status['last_step']}"
    if status["wall_time_s"] is not None:
        line += f", {status['wall_time_s']:.1f} s"
    return line
