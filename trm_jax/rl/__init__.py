"""trm_jax.rl: the pure-function core of the RL learner.

  advantages  GRPO group-normalised advantages (with / without std; Dr.GRPO), baseline over
              all rollouts of a group by default (TRM-masked ones included, see the module).
  objectives  the OBJECTIVES registry: trm_surrogate | ppo_clip | tis | gspo | cispo, chosen
              by name (rl.objective); each takes TRM's sequence mask, four loss aggregation
              modes, optional k3 KL to a reference (token masking is the TRM criterion
              token_mask).
  dapo        DAPO's batch shaping: overlong penalty, dynamic sampling's group test and
              top-up plan (the trainer's step applies them).
  modes       the MODES registry of learner modes (smd.mode): off | dense | naive |
              sparse_rl | smd, what each scores, replays, distils and weights.
  optim       AdamW + warmup-cosine + global-norm clipping; gradient accumulation that equals
              one big batch; the non-finite update guard.
  sparse_rl   the Sparse-RL baseline's token weights, sequence veto and wasted fraction.

No model code lives here: the learner step composes these with the model and `trm_jax.trm`.
"""
from trm_jax.rl.advantages import drgrpo_advantages, group_advantages
from trm_jax.rl.modes import MODES, LearnerMode, get_mode, register_mode
from trm_jax.rl.objectives import (LOSS_AGG_MODES, OBJECTIVES, Objective, aggregate,
                                   compute_loss, get_objective, loss_normalizer,
                                   register_objective)
from trm_jax.rl.optim import (accumulate_gradients, all_finite, apply_if_finite,
                              make_optimizer, make_schedule)
from trm_jax.rl.sparse_rl import SparseRLWeights, sparse_rl_weights
