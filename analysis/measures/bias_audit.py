"""The bias audit a run recorded (the ``BiasAudit`` probe); its report section is
:mod:`dynamics.analysis.pages.sections.bias_audit`."""

from __future__ import annotations

from dynamics.bias.audit_result import SETTINGS_KEY, AuditResult
from dynamics.store import Run, names

__all__ = ["recorded_audit"]


def recorded_audit(run: Run) -> AuditResult | None:
    """The audit stored in the run's probe settings, or ``None`` when no probe recorded one.

    Example::

        audit = recorded_audit(open_run("runs/audited.h5"))
        print("\n".join(audit.lines()) if audit else "no audit recorded")
    """
    for probe in run.attrs.get(names.ATTR_PROBES) or ():
        stored = (
            (probe.get("settings") or {}).get(SETTINGS_KEY) if isinstance(probe, dict) else None
        )
        if stored:
            return AuditResult.from_dict(stored)
    return None
