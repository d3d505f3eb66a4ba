"""Experiment configs (big_vision style): Python files with `get_config(arg=None)`.

  python -m trm_jax.train --config configs/tiny_trm.py --workdir /tmp/run \
      --config.optim.lr=1e-4

  tiny_trm            the default main job: GRPO + TRM-max on the synthetic task, CPU, minutes
  tiny_smd            Shadow Mask Distillation with 50 % H2O-compressed rollouts, CPU
  tiny_trm_long       a long-horizon task (running sums of 14-22 operands, 140-265-token
                      responses): the base of experiments/trm_long_horizon.py, CPU
  tiny_moe_mismatch   a Qwen3-MoE-shaped tiny policy with router jitter in the sampler
  tiny_dapo           DAPO's dynamic sampling and overlong shaping on the main job's task
  qwen3_8b_dapo_trm   the TRM paper's run: Qwen3-8B on DAPO-Math-17k (an accelerator pod)
  qwen3_30b_a3b_trm   the same recipe on Qwen3-30B-A3B: routing replay, experts split over
                      mesh.expert (a TPU slice)
  qwen3_4b_smd_gsm8k  the SMD paper's run: Qwen3-4B on GSM8K (an accelerator pod)
  qwen3_4b_smd_tldr, qwen3_4b_smd_govreport, qwen3_4b_smd_hotpotqa
                      the SMD paper's other tasks: Reddit TL;DR and GovReport (ROUGE-L),
                      HotpotQA (answer F1)

`tiny_trm` holds every setting with its one default and a comment; the others start from it
(`tiny_trm = config_lib.shipped_module("tiny_trm")`) and change what their experiment needs. A
config of your own can live anywhere: `--config path/to/my_config.py`. `--config tiny_trm` (a
name without a directory) resolves to the shipped file, in a checkout and from an installed
wheel, which carries these files as `trm_jax/configs/` (`trm_jax.config.resolve_config`).
"""
