"""Running a test's Triton kernels on the CPU: Triton reads TRITON_INTERPRET when it is first imported, so a
test that needs its interpreter runs its checks in a fresh Python process with the variable set."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(module: str, function: str, timeout: int = 600) -> None:
    """Call `module.function()` in a new process under TRITON_INTERPRET=1 (from the repository root); fails
    the calling test with that process's output when it fails."""
    code = f"from {module} import {function}; {function}()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
