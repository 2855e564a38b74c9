# Sourced by scripts/quickstart.sh and scripts/test.sh: create .venv and install mfopt[dev] once
# (again whenever pyproject.toml changes). PYTHON picks the interpreter (Python >= 3.11).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
stamp="$VENV/.installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -e '.[dev]'
  touch "$stamp"
fi
PY="$VENV/bin/python"
