"""The shipped experiment configs, installed as ``dynamics.configs``: ``dynamics configs`` lists
them and ``dynamics run NAME`` runs one (see :mod:`dynamics.experiments.shipped_configs`)."""
