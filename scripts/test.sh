#!/usr/bin/env bash
# The whole test suite on 8 fake CPU devices (tests/conftest.py), 2 pytest-xdist workers.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k averaging`.
source "$(dirname "$0")/_venv.sh"
# (no arguments: all of tests/; pyproject.toml's testpaths picks tests/ when only options are given)
exec "$PY" -m pytest -n "${JOBS:-2}" --durations=30 "$@"
