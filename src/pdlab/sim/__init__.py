"""The simulator: P/D serving at cluster scale, calibrated on local runs."""
