"""Initialisers to pass as a module's `init_method` / `output_layer_init_method`: the same seed gives the
same full weights at any tensor-parallel size (docs/parallelism.md, "Deferred and layout-independent
initialisation"). The implementation is te_parallel.module.init."""
from te_parallel.module.init import DEFAULT_INIT_STD, NormalInit, ShardedInit, counter_normal, normal_, scaled_normal_

__all__ = ["normal_", "scaled_normal_", "NormalInit", "ShardedInit", "counter_normal", "DEFAULT_INIT_STD"]
