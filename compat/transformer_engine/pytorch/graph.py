"""TE's `transformer_engine.pytorch.graph`: make_graphed_callables is te_parallel's; the capture markers
Megatron's CUDA-graph code calls are not implemented."""
from te_parallel import make_graphed_callables

from transformer_engine.pytorch._missing import missing_function

set_capture_start = missing_function("graph.set_capture_start", "TE's CUDA-graph capture markers")
set_capture_end = missing_function("graph.set_capture_end", "TE's CUDA-graph capture markers")

__all__ = ["make_graphed_callables", "set_capture_start", "set_capture_end"]
