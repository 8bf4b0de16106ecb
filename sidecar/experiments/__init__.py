"""Experiments: the Assignment API, outcome feedback joined to the arm, the per-arm readout,
the sample-ratio check, and what a config change does to running experiments."""
