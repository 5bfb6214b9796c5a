"""``dynamics audit``: bias parameters, origin, absorption and shift sources of a model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynamics.cli.common import json_object, print_table
from dynamics.errors import DynamicsError, ParameterError

if TYPE_CHECKING:
    from dynamics.bias.audit_result import AuditResult


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``audit`` to ``commands``."""
    audit = commands.add_parser(
        "audit",
        help="bias parameters, origin, absorption, shift sources and activation bias of a model",
    )
    audit.add_argument(
        "target",
        metavar="MODEL|RUN.h5",
        help="a model class or factory (pkg.module:Class, path/to/file.py:Class or "
        "pkg.module.Class), or a run file (its recorded model at θ0)",
    )
    audit.add_argument(
        "--init-args",
        metavar="JSON",
        help="the class's init args (completing a run's recorded ones)",
    )
    audit.add_argument(
        "--input-shape",
        metavar="N,...",
        help="example input: an N(0, 1) batch of this shape, e.g. 8,784 (default for a run "
        "file: its stored probe batch, when it has one)",
    )
    audit.add_argument(
        "--vocab",
        type=int,
        metavar="V",
        help="with --input-shape: token ids drawn uniformly from 0..V-1 instead (language models)",
    )
    audit.add_argument(
        "--input-json",
        metavar="JSON",
        help='example input as JSON: an object of keyword arguments, e.g. \'{"input_ids": '
        "[[1, 2, 3]]}' (Hugging Face models), or an array, the one argument; integers stay "
        "integers, other numbers take the model's dtype",
    )
    audit.add_argument(
        "--input-file",
        type=Path,
        metavar="FILE",
        help="example input saved with torch.save (loaded with weights_only=True): a dict is "
        "keyword arguments, a list or tuple positional arguments, a tensor the one argument",
    )
    audit.add_argument(
        "--draws", type=int, help="random weight draws of the origin check (default 5)"
    )
    audit.add_argument("--json", action="store_true", help="machine-readable output")
    audit.add_argument(
        "--model",
        metavar="MODULE:NAME",
        help="with a run file: build its model with this class or factory instead",
    )
    audit.add_argument(
        "--trust-recorded-model",
        action="store_true",
        help="with a run file: import its recorded class and loss function even from outside "
        "the installed packages",
    )
    audit.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    """Audit a class, or a run's model at θ0 (its recorded audit when it has one)."""
    from dynamics.analysis.measures.bias_audit import recorded_audit
    from dynamics.bias.auditing import audit, audit_batch, check_draws
    from dynamics.model.probe_batch import probe_batch
    from dynamics.model.rebuild import build_module, rebuild_module, recorded_loss_rule
    from dynamics.store import names, open_run

    shape = _shape(args.input_shape)
    init_args = json_object(args.init_args, "--init-args")
    inputs = [
        option
        for option, value in (
            ("--input-shape", args.input_shape),
            ("--input-json", args.input_json),
            ("--input-file", args.input_file),
        )
        if value is not None
    ]
    if len(inputs) > 1:
        raise DynamicsError(f"{' and '.join(inputs)}: give one example input")
    if args.vocab is not None and (args.vocab < 1 or shape is None):
        raise DynamicsError(
            f"--vocab must be at least 1 and go with --input-shape, got {args.vocab}"
        )
    if args.draws is not None:
        check_draws(args.draws)  # before a run's model is rebuilt
    draws = {} if args.draws is None else {"draws": args.draws}
    example, note, result = None, "none (pass --input-shape)", None
    if args.target.endswith(".h5"):
        run = open_run(args.target)
        recorded = recorded_audit(run)
        if recorded is not None and not (inputs or args.model or init_args or draws):
            # The fit's own audit (BiasAudit, on its first batch): nothing to rebuild or guess.
            module = (run.attrs.get(names.ATTR_MODULE) or {}).get("class_path", "?")
            _print_audit(
                args, f"{module.rpartition('.')[2]}, recorded at θ0 by BiasAudit", recorded
            )
            return 0
        model = rebuild_module(run, args.model, init_args, args.trust_recorded_model)
        if not inputs:
            try:  # the batch GradientPlane stored, and the rule the probes took losses by
                batch = probe_batch(run)
                rule = recorded_loss_rule(run, args.trust_recorded_model)
            except DynamicsError as error:
                note = f"none ({error}); pass --input-shape"
            else:
                source = "the run's probe batch"
                result = audit_batch(model, batch, source=source, rule=rule, **draws)
    elif args.model or args.trust_recorded_model:
        raise DynamicsError("--model and --trust-recorded-model go with a run file")
    else:
        try:
            model = build_module(_class_spec(args.target), init_args)
        except ParameterError as error:
            if error.parameter != "model":
                raise
            raise DynamicsError(error.problem) from None  # the target given, not --model
    if inputs:
        example, note = _example_input(args, model, shape)
    if result is None:
        result = audit(model, example, input_note=note, **draws)
    _print_audit(args, type(model).__name__, result)
    return 0


def _example_input(args: argparse.Namespace, model: Any, shape: tuple[int, ...] | None) -> tuple:
    """The one example input given (``--input-json``, ``--input-file`` or ``--input-shape``)
    and the note that says where it came from."""
    import torch

    from dynamics.bias.auditing import token_embedding

    if args.input_json is not None:
        return _json_input(args.input_json, model)
    if args.input_file is not None:
        from dynamics.analysis.measures.loss_barrier import load_batch

        loaded = load_batch(args.input_file, what="--input-file")
        return _arguments(loaded.batch), f"{args.input_file} (--input-file)"
    generator = torch.Generator().manual_seed(0)
    dims = ",".join(map(str, shape))
    embedding = token_embedding(model) if args.vocab is None else None
    if embedding is not None:
        name, table = embedding
        raise DynamicsError(
            f"{type(model).__name__} reads token ids (its first module, {name}, is an "
            f"embedding of {table.num_embeddings} tokens), not N(0, 1) values: pass "
            f"--vocab {table.num_embeddings} with --input-shape, or --input-json"
        )
    if args.vocab is not None:
        example = torch.randint(0, args.vocab, shape, generator=generator)
        return example, f"token ids from 0..{args.vocab - 1} of shape {dims} (--vocab, seed 0)"
    example = torch.randn(shape, generator=generator, dtype=_floating_dtype(model))
    return example, f"N(0, 1) of shape {dims} (--input-shape, seed 0)"


def _floating_dtype(model: Any) -> Any:
    """The dtype of the model's first floating parameter (torch's default without one)."""
    import torch

    return next(
        (p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype()
    )


def _json_input(text: str, model: Any) -> tuple[Any, str]:
    """``--input-json``: an object of keyword arguments or an array (the one argument), as
    tensors: integers as int64 (token ids), other numbers in the model's floating dtype."""
    import torch

    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise DynamicsError(f"--input-json is not JSON: {error}") from None
    dtype = _floating_dtype(model)

    def tensor(name: str, data: Any) -> torch.Tensor:
        try:
            found = torch.tensor(data)
        except (TypeError, ValueError, RuntimeError) as error:
            raise DynamicsError(
                f"--input-json {name}: not a number or a regular array of numbers ({error})"
            ) from None
        return found.to(dtype) if found.is_floating_point() else found

    if isinstance(value, dict) and value:
        keywords = {key: tensor(key, data) for key, data in value.items()}
        return _arguments(keywords), f"keyword arguments {', '.join(keywords)} (--input-json)"
    if isinstance(value, list):
        return tensor("array", value), "the array of --input-json"
    raise DynamicsError(f"--input-json must be a JSON object of arguments or an array, got {text}")


def _arguments(batch: Any) -> Any:
    """An example input file's content as the forward's arguments: a dict as keywords, a list
    or tuple as positional arguments, anything else as the one argument."""
    from dynamics.params.batch_tree import ForwardArguments

    if isinstance(batch, dict):
        return ForwardArguments((), batch)
    if isinstance(batch, (list, tuple)):
        return ForwardArguments(tuple(batch))
    return batch


def _print_audit(args: argparse.Namespace, what: str, result: AuditResult) -> None:
    if args.json:
        print(json.dumps({"model": args.target, **result.to_dict()}, indent=2))
        return
    print(f"{args.target}  ({what})")
    for line in result.lines():
        print(f"  {line}")
    for title, header, rows in result.tables():
        print(f"\n{title}")
        if rows:
            print_table(header, rows)
        else:
            print("  none")


def _class_spec(target: str) -> str:
    """``pkg.module:Class`` for ``pkg.module.Class`` (how run files name a class); other forms
    as given."""
    if ":" in target:
        return target
    module, _, name = target.rpartition(".")
    if not module:
        raise DynamicsError(
            f"name the model as pkg.module:Class or path/to/file.py:Class, got {target!r}"
        )
    return f"{module}:{name}"


def _shape(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        shape = tuple(int(n) for n in text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise DynamicsError(f"--input-shape must be positive integers like 8,784, got {text!r}")
    return shape
