"""Experiment scripts, run from the repository root as modules:

  python -m experiments.bounds_table      # TRM Table 1 and every bound against T
  python -m experiments.trm_mismatch      # off-policy corrections under MoE router jitter
  python -m experiments.smd_compression   # SMD vs the baselines under KV-cache compression

`report` holds what the scripts share (seed statistics, markdown tables, the grid runner).
Committed outputs are in experiments/results/.
"""
