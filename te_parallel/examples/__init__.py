"""End-to-end examples shipped with the package (console command: te-parallel-train-gpt)."""
