#!/usr/bin/env bash
# The main job: every algorithm on main, 8 workers, digits + mnist1d -> runs/quickstart/report.md.
# Extra arguments go to the runner, e.g. `num_steps=200`; runs/quickstart holds one config, so a
# different one needs `--restart` or its own `--workdir DIR` (the last --workdir given wins).
source "$(dirname "$0")/_venv.sh"
exec "$PY" -m experiments quickstart --workdir runs/quickstart "$@"
