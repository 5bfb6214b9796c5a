"""Parameters sharded across ranks (FSDP1, FSDP2's ``fully_shard``): which entries each rank
holds (:class:`ParameterShards`), and a plain copy of a sharded module holding its parameters
whole for the passes that cannot run through FSDP's wrapping (:func:`unsharded_copy`)."""

from dynamics.sharding.replica import unsharded_copy
from dynamics.sharding.shards import ParameterShards, UnsupportedSharding

__all__ = ["ParameterShards", "UnsupportedSharding", "unsharded_copy"]
