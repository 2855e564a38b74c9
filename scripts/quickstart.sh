#!/usr/bin/env bash
# The main job: every algorithm on main, 8 workers, digits + mnist1d -> runs/quickstart/report.md.
# Extra arguments go to the runner, e.g. `bash scripts/quickstart.sh --quick` or `num_steps=200`.
source "$(dirname "$0")/_venv.sh"
exec "$PY" -m experiments quickstart --workdir runs/quickstart "$@"
