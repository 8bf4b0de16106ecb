"""Judging experiments: outcome feedback joined to the arm, and the per-arm readout."""
