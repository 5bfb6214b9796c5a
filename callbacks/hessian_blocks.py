"""The top eigenvalues and the trace of each diagonal block ``H_bb`` of the Hessian, at each
``HessianSpectrum`` row, on the row's own operator restricted to the block's coordinates."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from dynamics.callbacks.fit import Fit
from dynamics.callbacks.hessian_measurement import HessianMeasurement, SpectrumProbe, SpectrumRow
from dynamics.callbacks.probe import SeriesSpec, parameter_shards
from dynamics.curvature import BlockOperator, lanczos, layout_coordinates
from dynamics.curvature.blocks import Coordinates
from dynamics.curvature.krylov import random_vectors
from dynamics.errors import ParameterError
from dynamics.params.globs import glob_any
from dynamics.params.layout import ParameterLayout
from dynamics.params.naming import unwrapped_name
from dynamics.store import names
from dynamics.store.views import standard_view

if TYPE_CHECKING:
    import pytorch_lightning as pl

#: How the blocks are chosen: per layer, per optimizer parameter group, or by name patterns.
Blocks = Literal["layers", "groups"] | Mapping[str, Sequence[str]]
#: The block of the parameters a model owns itself (not through a submodule), as in
#: :func:`dynamics.params.groups.group_parameters`.
ROOT = "(root)"


class BlockHessian(HessianMeasurement):
    """Group ``hessian_blocks``: for each block ``b`` of parameters, the top ``k`` eigenvalues
    of the diagonal block ``H_bb`` (``eigenvalues`` and ``residuals`` ``(blocks, k)``, the first
    of them ``lambda_max`` ``(blocks,)``, ``converged``) and its trace (``trace``,
    ``trace_stderr``), with ``n_hvp``, the products of ``H`` each block used; one column per
    block, named by it.

    ``H_bb`` is the Hessian with rows and columns outside the block dropped: the curvature of the
    loss when only the block moves. Each of its products is one product of the row's operator
    (:class:`~dynamics.curvature.blocks.BlockOperator`), so the blocks see the same loss, batch
    and averaging (over DDP ranks, over a probe set) as the row's spectrum. The eigenvalues are
    a cold, seeded thick-restart Lanczos per block (:func:`~dynamics.curvature.lanczos`); a
    block with fewer than ``k`` coordinates has its own size of them, NaN after. The trace is
    Hutchinson's estimate with ``trace_hvp`` Rademacher vectors ``z`` drawn at the operator's
    size and restricted to each block, ``zᵀ_b H_bb z_b``: the same probes for every block, so
    the block traces sum to the Hutchinson estimate of the block-diagonal part of ``H`` (whose
    trace is ``tr H`` when the blocks cover every parameter), or ``"exact"``: the sum of the
    diagonal entries, one product per coordinate (for small models).

    Blocks:

    - ``"layers"``: one block per module that directly owns trainable parameters (a ``Linear``'s
      weight and bias together; a module's own parameters apart from its children's), named by
      the module's dotted name, ``"(root)"`` for the model's own parameters.
    - ``"groups"``: one block per parameter group of the fit's optimizers, named by the group's
      ``"name"`` when it has one, else ``group_<i>`` (``optimizer_<j>.group_<i>`` with several
      optimizers); trainable parameters in no group are left out.
    - ``{block: [glob, ...]}``: the parameters whose dotted names match any of the block's
      patterns (:mod:`dynamics.params.globs`: ``*`` one segment, ``**`` any), e.g.
      ``{"attention": ["**.attn.**"], "mlp": ["**.mlp.**"]}``; parameters no pattern matches are
      left out.

    Blocks never overlap. Under FSDP the row's operator is on the whole parameters (the probe
    measures on a whole copy), and so are the blocks.

    Example::

        HessianSpectrum(k=5, measurements=[BlockHessian("layers", k=3, trace_hvp=20)])
        HessianSpectrum(measurements=[BlockHessian({"embed": ["wte.*", "wpe.*"]})])

    Args:
        blocks: ``"layers"``, ``"groups"`` or ``{block name: [glob, ...]}``.
        k: eigenvalues per block; None: the probe's ``k``.
        trace_hvp: Rademacher vectors of the trace estimate (each costs one product per block),
            ``"exact"`` for the exact trace, or 0 for no trace.
        tol: relative residual tolerance of each block's eigenpairs.
        max_hvp: product budget of each block's eigensolver.

    Attributes:
        block_names: the blocks, in the order of the series' columns (pattern blocks from the
            start, the others from setup on).
        members: ``{block: [parameter, ...]}``, the parameters of each (from setup on).

    Raises:
        ParameterError: an unknown kind of blocks, a pattern block without patterns; at setup,
            a pattern block that matches no parameter, blocks that overlap, ``"groups"`` without
            optimizers or with a parameter the model does not train.
    """

    def __init__(
        self,
        blocks: Blocks = "layers",
        *,
        k: int | None = None,
        trace_hvp: int | Literal["exact"] = 0,
        tol: float = 1e-4,
        max_hvp: int = 500,
    ) -> None:
        if isinstance(blocks, str):
            if blocks not in ("layers", "groups"):
                raise ParameterError(
                    "blocks", f"must be 'layers', 'groups' or {{name: [patterns]}}, got {blocks!r}"
                )
        elif isinstance(blocks, Mapping):
            _check_patterns(blocks)
        else:
            raise ParameterError(
                "blocks", f"must be 'layers', 'groups' or {{name: [patterns]}}, got {blocks!r}"
            )
        if k is not None and k < 1:
            raise ParameterError("k", f"must be at least 1, got {k}")
        if trace_hvp != "exact" and (
            not isinstance(trace_hvp, int) or trace_hvp < 0 or trace_hvp == 1
        ):
            raise ParameterError(
                "trace_hvp", f"must be 0, at least 2 or 'exact', got {trace_hvp!r}"
            )
        if max_hvp < 1:
            raise ParameterError("max_hvp", f"must be at least 1, got {max_hvp}")
        self.blocks = blocks
        self.k = k
        self.trace_hvp = trace_hvp
        self.tol = tol
        self.max_hvp = max_hvp
        # Known at setup (pattern blocks' names before it): the blocks and their coordinates.
        self.block_names: tuple[str, ...] = tuple(blocks) if isinstance(blocks, Mapping) else ()
        self.members: dict[str, list[str]] = {}
        self._coordinates: list[Coordinates] = []
        self._size = 0
        self._k = k or 0  # the probe's k when k is None (known at setup)

    def series(self, k: int, size: int) -> dict[str, dict[str, SeriesSpec]]:
        if not self.block_names:  # "layers" and "groups" are named at setup
            return {}
        k = self.k or k
        blocks, pairs = self.block_names, (len(self.block_names), k)
        columns = tuple(f"lambda_{i + 1}" for i in range(k))

        def view(series: str) -> Any:
            return standard_view(names.HESSIAN_BLOCKS, series)

        specs = {
            names.HESSIAN_BLOCKS_LAMBDA_MAX: SeriesSpec(
                (len(blocks),), columns=blocks, view=view(names.HESSIAN_BLOCKS_LAMBDA_MAX)
            ),
            names.HESSIAN_BLOCKS_EIGENVALUES: SeriesSpec(pairs, columns=columns),
            names.HESSIAN_BLOCKS_RESIDUALS: SeriesSpec(pairs, columns=columns),
            names.HESSIAN_BLOCKS_CONVERGED: SeriesSpec((len(blocks),), "int8", columns=blocks),
            names.HESSIAN_BLOCKS_N_HVP: SeriesSpec((len(blocks),), "int32", columns=blocks),
        }
        if self.trace_hvp:
            trace = view(names.HESSIAN_BLOCKS_TRACE)
            specs[names.HESSIAN_BLOCKS_TRACE] = SeriesSpec(
                (len(blocks),), "float64", columns=blocks, view=trace
            )
            specs[names.HESSIAN_BLOCKS_TRACE_STDERR] = SeriesSpec(
                (len(blocks),), "float64", columns=blocks
            )
        return {names.HESSIAN_BLOCKS: specs}

    def setup(self, probe: SpectrumProbe, fit: Fit, pl_module: pl.LightningModule) -> None:
        # The unsharded layout: the row's operator is on the whole parameters, in this order.
        layout = parameter_shards(fit, pl_module).layout
        if self.blocks == "layers":
            members = _layers(layout)
        elif self.blocks == "groups":
            members = _optimizer_groups(fit, pl_module, layout)
        else:
            members = _matched(self.blocks, layout)
        _check_disjoint(members)
        self._k = self.k or probe.k
        self.block_names = tuple(members)
        self.members = members
        self._coordinates = [layout_coordinates(layout, m) for m in members.values()]
        self._size = layout.size

    def measure(self, row: SpectrumRow) -> dict[str, dict[str, Any]]:
        if row.operator.size != self._size:
            raise ValueError(
                f"BlockHessian was set up for {self._size} parameters, the row's operator has "
                f"{row.operator.size}"
            )
        k = self._k
        blocks = [BlockOperator(row.operator, c) for c in self._coordinates]
        eigenvalues = np.full((len(blocks), k), np.nan)
        residuals = np.full((len(blocks), k), np.nan)
        converged = np.zeros(len(blocks), np.int8)
        n_hvp = np.zeros(len(blocks), np.int64)
        for b, block in enumerate(blocks):
            try:
                pairs = lanczos(
                    block, min(k, block.size), self.tol, max_hvp=self.max_hvp, seed=row.seed
                )
            except FloatingPointError as error:  # a product not finite: say in which block
                raise self._not_finite(row, b, str(error)) from None
            found = len(pairs.eigenvalues)
            eigenvalues[b, :found] = pairs.eigenvalues.numpy()
            residuals[b, :found] = pairs.residuals.double().cpu().numpy()
            converged[b] = pairs.converged
            n_hvp[b] = pairs.n_hvp
        values: dict[str, Any] = {
            names.HESSIAN_BLOCKS_LAMBDA_MAX: eigenvalues[:, 0].astype(np.float32),
            names.HESSIAN_BLOCKS_EIGENVALUES: eigenvalues.astype(np.float32),
            names.HESSIAN_BLOCKS_RESIDUALS: residuals.astype(np.float32),
            names.HESSIAN_BLOCKS_CONVERGED: converged,
        }
        if self.trace_hvp:
            trace, stderr, used = self._traces(row, blocks)
            if not np.isfinite(trace).all():  # products of other vectors than Lanczos's
                first = int(np.argmin(np.isfinite(trace)))
                raise self._not_finite(row, first, "the trace estimate is not finite")
            values[names.HESSIAN_BLOCKS_TRACE] = trace
            values[names.HESSIAN_BLOCKS_TRACE_STDERR] = stderr
            n_hvp += used
        values[names.HESSIAN_BLOCKS_N_HVP] = n_hvp.astype(np.int32)
        return {names.HESSIAN_BLOCKS: values}

    def _not_finite(self, row: SpectrumRow, block: int, problem: str) -> FloatingPointError:
        name = self.block_names[block]
        return FloatingPointError(f"BlockHessian at step {row.step}, block {name!r}: {problem}")

    def _traces(
        self, row: SpectrumRow, blocks: list[BlockOperator]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each block's trace, its standard error and the products used."""
        if self.trace_hvp == "exact":
            trace = np.array([_exact_trace(block) for block in blocks])
            return trace, np.zeros(len(blocks)), np.array([block.size for block in blocks])
        # One draw at the whole size, restricted to every block: the block estimates then sum
        # to Hutchinson's estimate of the block-diagonal part with these same vectors.
        # On the operator's device: one copy to the host at the end, not one per product.
        samples = torch.zeros(
            self.trace_hvp, len(blocks), dtype=torch.float64, device=row.operator.device
        )
        draws = random_vectors(self.trace_hvp, row.operator, row.seed, rademacher=True)
        for i, z in enumerate(draws):
            for b, block in enumerate(blocks):
                part = block.restrict(z)
                samples[i, b] = torch.dot(part, block.matvec(part)).double()
        trace = samples.mean(0)
        stderr = samples.std(0, correction=1) / self.trace_hvp**0.5
        return trace.cpu().numpy(), stderr.cpu().numpy(), np.full(len(blocks), self.trace_hvp)

    def teardown(self) -> None:
        self._coordinates = []


def _check_patterns(blocks: Mapping[str, Sequence[str]]) -> None:
    if not blocks:
        raise ParameterError("blocks", "names no block")
    for name, patterns in blocks.items():
        if not isinstance(name, str) or not name:
            raise ParameterError("blocks", f"must be named by non-empty strings, got {name!r}")
        if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
            raise ParameterError(
                "blocks", f"block {name!r}: give a list of glob patterns, got {patterns!r}"
            )
        if not patterns:
            raise ParameterError("blocks", f"block {name!r} has no pattern")


def _layers(layout: ParameterLayout) -> dict[str, list[str]]:
    """One block per module that directly owns parameters, in the layout's order."""
    members: dict[str, list[str]] = {}
    for name in layout.names:
        owner = name.rpartition(".")[0] or ROOT
        members.setdefault(owner, []).append(name)
    return members


def _optimizer_groups(
    fit: Fit, module: torch.nn.Module, layout: ParameterLayout
) -> dict[str, list[str]]:
    """One block per parameter group of the fit's optimizers."""
    optimizers = list(getattr(fit, "optimizers", None) or [])
    if not optimizers:
        raise ParameterError("blocks", "'groups' needs the fit's optimizers; this fit has none")
    trained = set(layout.names)
    named = {id(p): unwrapped_name(n) for n, p in module.named_parameters()}
    members: dict[str, list[str]] = {}
    for j, optimizer in enumerate(optimizers):
        for i, group in enumerate(optimizer.param_groups):
            label = str(group.get("name", f"group_{i}"))
            label = label if len(optimizers) == 1 else f"optimizer_{j}.{label}"
            found = [named.get(id(p)) for p in group["params"]]
            strangers = [n for n in found if n not in trained]
            if strangers:
                raise ParameterError(
                    "blocks",
                    f"'groups': group {label!r} holds a parameter the model does not train "
                    f"({strangers[0] or 'not one of its parameters'})",
                )
            if found:
                members[label] = [n for n in layout.names if n in set(found)]
    return members


def _matched(blocks: Mapping[str, Sequence[str]], layout: ParameterLayout) -> dict[str, list[str]]:
    members = {}
    for name, patterns in blocks.items():
        members[name] = [n for n in layout.names if glob_any(n, patterns)]
        if not members[name]:
            raise ParameterError(
                "blocks",
                f"block {name!r}: no trainable parameter matches {list(patterns)} (patterns "
                f"match dotted parameter names, e.g. {layout.names[0]!r})",
            )
    return members


def _check_disjoint(members: Mapping[str, Sequence[str]]) -> None:
    owner: dict[str, str] = {}
    for block, parameters in members.items():
        for parameter in parameters:
            if parameter in owner:
                raise ParameterError(
                    "blocks",
                    f"{owner[parameter]!r} and {block!r} both hold {parameter!r}; blocks must "
                    "not overlap",
                )
            owner[parameter] = block


def _exact_trace(block: BlockOperator) -> float:
    """``Σ_i e_iᵀ H_bb e_i``, one product per coordinate."""
    total = torch.zeros((), dtype=torch.float64)
    unit = torch.zeros(block.size, dtype=block.dtype, device=block.device)
    for i in range(block.size):
        unit[i] = 1
        total += block.matvec(unit)[i].double().cpu()
        unit[i] = 0
    return total.item()
