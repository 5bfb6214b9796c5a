"""The decoded images a run stores (:mod:`dynamics.analysis.measures.decoded_images`) as
mosaics.

Each panel is a mosaic: the target row on top, then for each shown step the full decode, the
bias-only decode and the remainder-only decode, one column per example, all on one grey scale
(the targets' range) so a dim decode looks dim. The report draws one figure per run with a panel
per layer; the comparison one figure per layer with a panel per run, side by side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dynamics.analysis.measures.decoded_images import DECODES, DecodedImages, shown_rows

__all__ = ["decoded_images_figure"]

_TILE_PX = 16  # screen pixels per image pixel (8×8 digits: 128 px tiles)


def decoded_images_figure(
    panels: Mapping[str, tuple[DecodedImages, str]],
    *,
    title: str,
    rows: Sequence[int] | None = None,
) -> go.Figure:
    """Mosaics of decodes side by side, one per ``{panel title: (images, layer)}``.

    Args:
        panels: what each panel shows: a run's images and one of its layers.
        title: the figure's title.
        rows: indices of the stored rows to show (default :func:`shown_rows` of each panel).

    Example::

        images = decoded_images(open_run("runs/autoencoder.h5"))
        decoded_images_figure({layer: (images, layer) for layer in images.layers}, title="Decodes")
    """
    figure = make_subplots(
        rows=1, cols=len(panels), subplot_titles=list(panels), horizontal_spacing=0.08
    )
    targets = [images.target for images, _ in panels.values()]
    low = min(float(t.min()) for t in targets)
    high = max(float(t.max()) for t in targets)
    height = 0
    first_labels: list[str] | None = None
    for column, (images, layer) in enumerate(panels.values(), start=1):
        shown = list(rows) if rows is not None else shown_rows(images.step)
        z, labels = _mosaic(images, images.layers.index(layer), shown)
        first_labels = labels if first_labels is None else first_labels
        tile = images.target.shape[-2] + 1
        figure.add_trace(
            go.Heatmap(
                z=z,
                zmin=low,
                zmax=high,
                colorscale="Greys",
                showscale=column == 1,
                hovertemplate="%{z:.3f}<extra></extra>",
            ),
            row=1,
            col=column,
        )
        figure.update_yaxes(
            tickvals=[i * tile + (tile - 2) / 2 for i in range(len(labels))],
            ticktext=labels,
            # Rows labelled alike are labelled once: a second column's labels would overlap
            # the images of the column to its left.
            showticklabels=column == 1 or labels != first_labels,
            autorange="reversed",
            scaleanchor=f"x{column if column > 1 else ''}",
            showgrid=False,
            zeroline=False,
            row=1,
            col=column,
        )
        examples = images.target.shape[0]
        width = images.target.shape[-1] + 1
        figure.update_xaxes(
            tickvals=[i * width + (width - 2) / 2 for i in range(examples)],
            ticktext=[f"example {i + 1}" for i in range(examples)],
            showgrid=False,
            zeroline=False,
            row=1,
            col=column,
        )
        height = max(height, z.shape[0] * _TILE_PX // 2 + 160)
    figure.update_layout(
        title=title, height=height, plot_bgcolor="white", margin={"l": 170, "r": 30}
    )
    return figure


def _mosaic(images: DecodedImages, layer: int, shown: Sequence[int]) -> tuple[np.ndarray, list]:
    """The panel's grey values (tiles separated by one blank pixel) and its row labels."""
    tiles = [_grey(images.target)]
    labels = ["target"]
    for i in shown:
        for d, decode in enumerate(DECODES):
            tiles.append(_grey(images.decodes[i, layer, d]))
            labels.append(f"step {int(images.step[i])} · {decode}")
    examples, height, width = tiles[0].shape
    z = np.full((len(tiles) * (height + 1) - 1, examples * (width + 1) - 1), np.nan)
    for r, row in enumerate(tiles):
        for e in range(examples):
            z[
                r * (height + 1) : r * (height + 1) + height,
                e * (width + 1) : e * (width + 1) + width,
            ] = row[e]
    return z, labels


def _grey(images: np.ndarray) -> np.ndarray:
    """(examples, C, H, W) as (examples, H, W): colour images as the mean of their channels."""
    return np.asarray(images, dtype=float).mean(axis=1)
