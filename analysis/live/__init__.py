"""Following runs while they train: the local page of ``dynamics watch`` and the notebook
widget of :func:`dynamics.watch`, both fed by :class:`~dynamics.analysis.live.feed.Feed`."""
