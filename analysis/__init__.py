"""Offline analysis of run files: never imports Lightning."""
