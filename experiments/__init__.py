"""mfopt experiments: one module per paper table or figure; run with ``python -m experiments NAME``."""
