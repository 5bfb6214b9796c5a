"""A model's parameters as the toolkit sees them: their names (``torch.compile``'s wrapper left
out), layouts and flat vectors, parameter groups picked by name globs, and batch trees (the
structure of a stored batch)."""
