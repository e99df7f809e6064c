"""Analytic, calibration-aware cost models (no solver code, no areal/torch imports)."""
