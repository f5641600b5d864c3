"""TE's `transformer_engine.pytorch.tensor.utils`: helpers for FP8 parameters under Megatron's distributed
optimizer (--fp8-param-gather). Import-only: te_parallel's FP8 parameters are written through
te_parallel.MasterWeights, not through these."""
from transformer_engine.pytorch._missing import missing_function

replace_raw_data = missing_function("tensor.utils.replace_raw_data", "replace_raw_data (FP8 parameter storage swap)")
cast_master_weights_to_fp8 = missing_function("tensor.utils.cast_master_weights_to_fp8",
                                              "cast_master_weights_to_fp8 (use te_parallel.MasterWeights)")

__all__ = ["replace_raw_data", "cast_master_weights_to_fp8"]
