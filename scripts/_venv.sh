# Sourced by scripts/quickstart.sh and scripts/test.sh: create .venv and install mfopt[dev] once
# (again whenever pyproject.toml changes). PYTHON picks the interpreter (Python >= 3.11).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
stamp="$VENV/.installed"
ok_python() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  if ! ok_python "$VENV/bin/python"; then  # no venv yet, or one of an older Python
    if ! ok_python "$PYTHON"; then
      echo "mfopt needs Python >= 3.11; $PYTHON is $("$PYTHON" -V 2>/dev/null || echo 'not found')." \
           "Set PYTHON, e.g. PYTHON=python3.11 bash $0" >&2
      exit 1
    fi
    # --clear: a venv left by a failed first run (another Python) would keep its interpreter
    "$PYTHON" -m venv --clear "$VENV"
  fi
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -e '.[dev]'
  touch "$stamp"
fi
PY="$VENV/bin/python"
