r"""Ahead-of-time compile of a config's training programs for a TPU slice or an NVIDIA node, on a
machine without one.

  pip install -e '.[tpu]'
  python -m trm_jax.aot --config configs/qwen3_8b_dapo_trm.py --topology v5p:4x4x4 \
      [--model Qwen3-8B | --model /ckpt/Qwen3-8B | --model path/to/config.json] \
      [--programs rollout,score,update,eval_greedy] [--out aot.json] [--config.rl.num_microbatches=4 ...]

Builds the config's mesh (`config.mesh`) over the devices of a named TPU topology (libtpu's
`jax.experimental.topologies`: v4, v5e, v5p, v6e) and compiles, through the real XLA:TPU and
Mosaic compilers, the programs the trainer runs for the config, at its shapes and shardings,
with abstract parameters (nothing is allocated, nothing runs). They are the trainer's own:
`programs.build` makes them for `step.make_context` and here alike, and this tool substitutes
only the topology's devices and abstract arrays (as MaxText's train_compile does):

  rollout        the sampler (prefill, then the decode loop with the config's KV-cache
                 policy, routing record, top-k log-probs), once per step over rl.batch_size
                 rows, on the sampler's own devices with mesh.rollout_devices;
  score          the learner's scoring pass over the whole batch (twice with rl.kl_beta);
  update         the learner's update (microbatch scan, optimizer, SMD teacher, routing
                 replay), rl.num_minibatches * rl.num_epochs times per step;
  eval_*         the held-out evaluations (greedy, sampled with eval_samples, and under the
                 rollout's cache policy), once per evaluation.

Each program compiles in a subprocess of its own, one at a time, so that its host memory is
released before the next (`--nosubprocess` compiles them all in one process); while one
compiles, a line every minute says how long and how much host memory it holds, and the report
is rewritten after each program. For each program the report records, per device (per chip;
v4 exposes two devices per chip, each with half the chip): XLA's `memory_analysis()`
(arguments, outputs, temporaries, generated code, donated bytes), the train-state buffers
that stay resident across the program (AdamW's moments during rollout and score, the full
rollout batch during the minibatch updates), their total against the chip's HBM, FLOPs and
bytes accessed with every loop body counted as many times as it runs (`trm_jax.aot.hlo_cost`;
XLA's own `cost_analysis()` counts a loop body once and is kept beside them), and a roofline
lower bound on its time, max(FLOPs / peak bf16 FLOP/s, bytes / HBM bandwidth), from the public
chip figures in `trm_jax.aot.tpu.CHIPS`; and the compile's wall time and its process's peak
host memory. The step bound sums the step's programs times their calls per step (the
evaluation's bound likewise, per evaluation). Loops with a trip count (scans over
microbatches, vocabulary chunks) count it exactly; the sampler's loops end when every row has
stopped, and are counted on the schedule in which every row generates task.max_new_tokens
(`rollout.sampler.decode_schedule`, stated in the report's `loop_bounds`): the most a rollout
can generate. The report also names the host and the git commit it was compiled at.

A program that does not fit (XLA refuses it, or it plus the resident state exceeds HBM) makes
the tool exit with status 1 after naming the knobs that change that program's memory; one
whose compiler process dies (e.g. killed for host memory) with status 3, after the others.

The model: `--model` (a published name in KNOWN_MODELS, a checkpoint directory or a
config.json), else config.model.path's config.json, else a published model named by the config
file (qwen3_8b_* -> Qwen3-8B), else the warm-up base model in warmup.cache_dir when built,
else that base model's architecture (config.model.arch: the tiny configs compile from a clean
checkout).
config.model.attn_impl="auto" resolves as on a TPU host (the Pallas TPU kernel), which
partitions itself over each chip's rows and kv heads (`kernels.partition`).

The subpackage, one job per module:

  compiler.py   the trainer's programs over an abstract model on a topology's devices;
                compile each, measure memory and loop-aware cost, the report (compile_config)
  cli.py        the command line above: flags, the report file, the exit status
  hlo_cost.py   FLOPs and bytes of a compiled program with loops counted per trip
  tpu.py        named TPU topologies (libtpu): devices, chip figures, compile_for_tpu
  gpu.py        named NVIDIA nodes (CUDA PJRT plugin): devices, GPU figures, compile_for_gpu

Importing the package runs nothing and sets nothing (bench/gpu_day.py imports hlo_cost on a
real GPU host); `cli` selects the CPU host backend before jax starts, as a compile-only tool must.
"""
