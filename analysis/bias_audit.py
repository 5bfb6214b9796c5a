"""The bias audit a run recorded (the ``BiasAudit`` probe), as a report section."""

from __future__ import annotations

import html

from dynamics.analysis.page import html_table
from dynamics.bias.audit_result import SETTINGS_KEY, AuditResult
from dynamics.store import Run, names

__all__ = ["bias_audit_html", "recorded_audit"]


def recorded_audit(run: Run) -> AuditResult | None:
    """The audit stored in the run's probe settings, or ``None`` when no probe recorded one."""
    for probe in run.attrs.get(names.ATTR_PROBES) or ():
        stored = (
            (probe.get("settings") or {}).get(SETTINGS_KEY) if isinstance(probe, dict) else None
        )
        if stored:
            return AuditResult.from_dict(stored)
    return None


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
