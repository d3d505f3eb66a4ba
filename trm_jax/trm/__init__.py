"""trm_jax.trm: Trust Region Masking core, pure functions with no model code.

  bounds      compute_bounds(T, delta=, eps=, kl_seq=, tv_seq=, dbar=) -> the bound family + B*
  divergence  per-token KL(roll || theta) / TV (full logits, top-k + tail), k1/k2/k3,
              per-sequence reductions and batch estimates of the bound inputs
  masking     sequence-mask criteria in the CRITERIA registry (TRM's, and the seq_mis /
              geo_mean masks other frameworks ship), ANDed by apply_criteria
  monitors    rejection rates (overall / per criterion / by length), PPL gap, empirical B*,
              r + D_TV^seq

Plain-text versions of the paper lose the square roots of its KL-route bounds; this package
uses the restored formulas, which docs/trm.md derives and checks against the paper's Table 1.
"""
from trm_jax.trm.bounds import BOUND_NAMES, compute_bounds, pinsker_fill
from trm_jax.trm.divergence import (BatchEstimates, batch_estimates, k3, sample_estimators,
                                    seq_max, seq_mean, seq_sum, token_divergences,
                                    topk_tail_divergences)
from trm_jax.trm.masking import (CRITERIA, Criterion, MaskResult, TokenStats, apply_criteria,
                                 ln_trm_weights, register_criterion, token_stats)
from trm_jax.trm.monitors import (empirical_bounds, masked_token_fraction, ppl_gap,
                                  precondition_free_term, rejection_by_length, rejection_rate,
                                  trm_monitors)

__all__ = [
    "BOUND_NAMES", "compute_bounds", "pinsker_fill",
    "BatchEstimates", "batch_estimates", "k3", "sample_estimators", "seq_max", "seq_mean",
    "seq_sum", "token_divergences", "topk_tail_divergences",
    "CRITERIA", "Criterion", "MaskResult", "TokenStats", "apply_criteria", "ln_trm_weights",
    "register_criterion", "token_stats",
    "empirical_bounds", "masked_token_fraction", "ppl_gap", "precondition_free_term",
    "rejection_by_length", "rejection_rate", "trm_monitors",
]
