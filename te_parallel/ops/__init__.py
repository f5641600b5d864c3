"""Stateless ops (casts, FP8 GEMM, norms, activations, the linear autograd Function), each with an fp64 reference."""
