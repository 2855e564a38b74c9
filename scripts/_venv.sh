# Sourced by scripts/quickstart.sh and scripts/test.sh: create .venv and install mfopt[dev] once
# (again whenever pyproject.toml changes). PYTHON picks the interpreter (Python >= 3.11).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
stamp="$VENV/.installed"
ok_python() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
has_pip() { "$1" -m pip --version >/dev/null 2>&1; }
# (re)install when the stamp is missing or stale, and also when the venv's interpreter is gone
# (a stamp left in a venv whose bin/ was removed made every run fail with 127)
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || ! ok_python "$VENV/bin/python"; then
  # no venv yet, one of an older Python, or one without pip (what `python3 -m venv` leaves
  # where ensurepip is missing: reused, every run failed with "No module named pip")
  if ! ok_python "$VENV/bin/python" || ! has_pip "$VENV/bin/python"; then
    if ! ok_python "$PYTHON"; then
      echo "mfopt needs Python >= 3.11; $PYTHON is $("$PYTHON" -V 2>/dev/null || echo 'not found')." \
           "Set PYTHON, e.g. PYTHON=python3.11 bash $0" >&2
      exit 1
    fi
    # --clear: a venv left by a failed first run (another Python) would keep its interpreter
    # (Debian's python3 -m venv without ensurepip fails outright under set -e: say why here)
    if ! "$PYTHON" -m venv --clear "$VENV" || ! has_pip "$VENV/bin/python"; then
      echo "$PYTHON -m venv did not make a venv with pip (on Debian/Ubuntu: apt install" \
           "python3-venv, or the python3.X-venv of your Python), then re-run." >&2
      exit 1
    fi
  fi
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -e '.[dev]'
  touch "$stamp"
fi
PY="$VENV/bin/python"
