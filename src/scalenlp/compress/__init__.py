"""Model compression: quantized layers (int8, int4), AWQ, pruning, and the calibration text they read."""
