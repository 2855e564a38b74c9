"""``python -m experiments <name> [--quick] [--workdir DIR] [key=value ...]``."""

import sys

from mfopt.runner import main

if __name__ == "__main__":
  sys.exit(main())
