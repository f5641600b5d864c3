"""TE-compatible import path: `from te_parallel.common import recipe` (same classes as `te_parallel.recipe`)."""
