"""The bias audit a run recorded, as a section of its report."""

from __future__ import annotations

import html

from dynamics.analysis.pages.page import html_table
from dynamics.bias.audit_result import AuditResult

__all__ = ["bias_audit_html"]


def bias_audit_html(audit: AuditResult) -> str:
    """The audit's verdicts, then its parameter, layer and activation tables; layers without a
    bias or a shift source are marked as flagged rows."""
    verdicts = "".join(f"<li>{html.escape(line)}</li>" for line in audit.lines())
    parts = [f"<ul>{verdicts}</ul>"]
    flagged = ["flag" if layer.flagged else "" for layer in audit.layers]
    for title, header, rows in audit.tables():
        if not rows:
            continue
        classes = flagged if title == "Layers" else ()
        parts.append(f"<h4>{html.escape(title)}</h4>{html_table(header, rows, classes)}")
    return "".join(parts)
