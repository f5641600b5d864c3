#!/usr/bin/env bash
# Install the pinned TE clients (.ci/client_requirements.txt) and the compat distribution into the
# active virtual environment, keeping its torch: pip may not replace it with another build.
set -euo pipefail
cd "$(dirname "$0")/.."
torch_version="$(python -c 'import torch; print(torch.__version__.split("+")[0])')"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==${torch_version}" > "$constraints"
python -m pip install -c "$constraints" -r .ci/client_requirements.txt
python -m pip install --no-deps ./compat
