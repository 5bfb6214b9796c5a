"""A due step's values per position (norms, means, flags), reduced over its real positions: the
padding mask, gradient accumulation's micro-batches and the ranks, without a host sync."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from dynamics.callbacks.output_axes import Axis

#: Which positions of a batch count: None finds ``attention_mask`` in a dict batch, False
#: counts every position, a callable returns the real positions of a batch (a bool tensor).
MaskRule = Callable[[Any], torch.Tensor] | bool | None


#: The per-position series a step accumulates, as :class:`StepValues` keys.
NORM, BIAS, NONFINITE = "norm", "bias", "nonfinite"


class StepValues:
    """A due step's per-position values (norms, means, non-finite flags), per series and
    column: those of the micro-batch in flight, and those of the micro-batches closed, as
    sums and counts over their real positions."""

    def __init__(self, columns: Mapping[str, Sequence[str]]) -> None:
        # One list per series and column for the whole fit, emptied at each due step: the
        # hooks append without building anything.
        self.pending = {s: {c: [] for c in cs} for s, cs in columns.items()}
        # Closed without a mask: kept whole, so the usual step is one stack and one mean.
        self.unmasked = {s: {c: [] for c in cs} for s, cs in columns.items()}
        self.masked: dict[str, dict[str, list[tuple[torch.Tensor, torch.Tensor]]]] = {}

    def clear(self) -> None:
        for lists in (*self.pending.values(), *self.unmasked.values()):
            for values in lists.values():
                values.clear()
        self.masked = {}

    def close(self, mask: torch.Tensor | None) -> dict[str, str]:
        """Close the micro-batch with its mask of real positions (None: all); the columns
        whose values do not line up with the mask, and why."""
        problems: dict[str, str] = {}
        for series, columns in self.pending.items():
            for column, values in columns.items():
                if mask is None:
                    self.unmasked[series][column].extend(values)
                    values.clear()
                    continue
                for value in values:
                    weights = position_weights(value.shape, mask)
                    if isinstance(weights, str):
                        problems[column] = weights
                    elif weights is None:
                        self.unmasked[series][column].append(value)
                    else:
                        kept = torch.where(weights, value, 0).sum(dtype=torch.float32)
                        count = weights.sum(dtype=torch.float32) * (value.numel() / weights.numel())
                        self.masked.setdefault(series, {}).setdefault(column, []).append(
                            (kept, count)
                        )
                values.clear()
        return problems

    def means(self, series: str, columns: Sequence[str], device: torch.device) -> torch.Tensor:
        """Each column's mean over its real positions (NaN for a column without values)."""
        calls = [self.unmasked.get(series, {}).get(c, ()) for c in columns]
        if series not in self.masked and all(len(c) == 1 for c in calls):
            shape = calls[0][0].shape
            if all(c[0].shape == shape for c in calls):  # the usual step: one op per series
                stacked = torch.stack([c[0] for c in calls])
                # Norms of 1-D outputs are scalars already (a mean over no dims would reduce
                # them all). (An int dim costs half what a tuple of dims does.)
                return stacked.flatten(1).mean(dim=1) if stacked.dim() > 1 else stacked
        return ratio(self.totals(series, columns, device), columns)

    def totals(self, series: str, columns: Sequence[str], device: torch.device) -> torch.Tensor:
        """Each column's sum, then each column's count: one (2 × columns,) float32 tensor."""
        unmasked, masked = self.unmasked.get(series, {}), self.masked.get(series, {})
        sums, counts = [], []
        zero = torch.zeros((), device=device)
        for column in columns:
            whole, parts = unmasked.get(column, ()), masked.get(column, ())
            sums.append(
                sum([v.sum(dtype=torch.float32) for v in whole] + [s for s, _ in parts], zero)
            )
            counts.append(sum([c for _, c in parts], zero) + float(sum(v.numel() for v in whole)))
        return torch.cat([torch.stack(sums), torch.stack(counts)]).float()


def position_weights(shape: torch.Size, mask: torch.Tensor) -> torch.Tensor | None | str:
    """Which entries of a per-position value of ``shape`` are real by ``mask`` (batch,
    positions): a bool tensor broadcastable to ``shape``; None where the value has no
    positions beyond the batch (a pooled output has no padding); or why they do not line up."""
    m = tuple(mask.shape)
    if tuple(shape[: len(m)]) == m:
        return mask.reshape(*m, *([1] * (len(shape) - len(m))))
    if len(shape) < len(m) and tuple(shape) == m[: len(shape)]:
        return None
    return (
        f"values per position of shape {tuple(shape)} do not start with the mask's shape {m} "
        "(batch, positions)"
    )


def describe_mask(mask: MaskRule, batch: Any) -> str:
    """Which positions count, in words, as stored in the run file and shown in the views."""
    if mask is False:
        return "off"
    if callable(mask):
        return f"mask={getattr(mask, '__qualname__', type(mask).__qualname__)}"
    if batch is None:
        return "batch['attention_mask'] where a dict batch has one"
    if isinstance(batch, Mapping) and isinstance(batch.get("attention_mask"), torch.Tensor):
        return "batch['attention_mask']"
    return "none: every position (the first batch has no attention_mask)"


def bias_dim(hidden: torch.Tensor, axis: Axis | None) -> int:
    ndim = hidden.dim()
    return axis.dim if axis is not None and -ndim <= axis.dim < ndim else -1


def per_position_mean(hidden: torch.Tensor, dim: int) -> torch.Tensor:
    """The mean across features at each position (the activation bias before averaging)."""
    if hidden.dim() < 2:
        return hidden.float()
    return hidden.mean(dim=dim, dtype=torch.float32)


def ratio(totals: torch.Tensor, columns: Sequence[str]) -> torch.Tensor:
    """Sums over counts per column (0/0: a module not called reads NaN)."""
    return totals[: len(columns)] / totals[len(columns) :]
