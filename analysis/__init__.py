"""Offline analysis of run files: never imports Lightning."""

from dynamics.analysis.overshoot import OvershootReport, detect_overshoot

__all__ = ["OvershootReport", "detect_overshoot"]
