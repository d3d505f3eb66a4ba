r"""The TRM paper's recipe on an MoE model: Qwen3-30B-A3B-Base on DAPO-Math-17k with TRM-max and
routing replay, evaluated avg@32 on AIME25.

  python -m trm_jax.train --config configs/qwen3_30b_a3b_trm.py --workdir /mnt/gcs/qwen3_30b_trm \
      --config.model.path=/ckpt/Qwen3-30B-A3B-Base --config.task.path=/data/dapo-math-17k.parquet \
      --config.task.eval_path=/data/aime25.jsonl

Every setting of `qwen3_8b_dapo_trm` (group 16, 32 prompts, lr 1e-6, prompt 1024 + 4096 new
tokens, bf16 sampler, untruncated training rollouts, TRM-max at delta = 0.05), plus:

  * routing replay (`rollout.routing_replay`): the sampler records the 8 experts each of the
    48 MoE layers ran for every token and the learner runs exactly those, so the MoE routing
    flip, the TRM paper's sharpest source of mismatch, leaves the trust-region test; what TRM
    still measures is the bf16 sampler's arithmetic and staleness;
  * expert parallelism (`mesh.expert = 4`): each layer's 128 experts are split over 4 devices
    (32 each) and every token's pairs travel to their experts and back
    (`models/expert_parallel.py`); the other devices (fsdp = -1) shard parameters, optimizer
    state and rows as in the 8B run. 4 lies along one axis of a v5p slice (jax.make_mesh
    refuses an axis that would split a physical one: 8 on a 4x4x4 slice), and keeps each
    device's receive buffer (mesh.expert x model.moe_chunk x 8 rows of D) at 0.5 GiB.

`python -m trm_jax.aot --config configs/qwen3_30b_a3b_trm.py --topology v5p:4x4x4` compiles
every program with the published Qwen3-30B-A3B architecture (the base checkpoint has the same
shapes); docs/results.md has its memory and roofline. Needs an accelerator pod.
"""
from trm_jax import config as config_lib

qwen3_8b_dapo_trm = config_lib.shipped_module("qwen3_8b_dapo_trm")


def get_config(arg=None):
  c = qwen3_8b_dapo_trm.get_config(arg)
  c.model.path = ""                  # must be set: a local Qwen3-30B-A3B-Base HF checkpoint
  c.rollout.routing_replay = True    # learner runs the sampler's experts (R3)
  c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.tensor = 1, -1, 4, 1
  return c
