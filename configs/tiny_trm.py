r"""The default main job: GRPO + Trust Region Masking on the synthetic running-sum task, on CPU.

  python -m trm_jax.train --config configs/tiny_trm.py --workdir /tmp/trm_tiny

A 2-layer decoder is first taught the task by a short supervised warm-up (cached under
warmup.cache_dir) on demonstrations of which 30 % give the answer alone and the rest work the
sum out line by line. The base therefore sometimes answers without working, which on a sum of
several operands is mostly wrong, and GRPO's visible gain in a few minutes is learning to work
the sum out (held-out avg@4 about +0.18 over its frozen control on three seeds,
docs/results.md). Then it is trained with GRPO. The rollout runs in bf16 with a little
logit noise while the learner is fp32, so pi_roll != pi_theta as in the TRM paper's setting, and
TRM-max (KL, exact from the rollout's full log-probs: the vocabulary is 31 tokens) masks the
sequences that leave the trust region. Finishes in a few minutes on 2 CPU cores.
"""
import ml_collections


def get_config(arg=None):
  del arg
  c = ml_collections.ConfigDict()
  c.seed = 0                       # RL prompts use stream `seed`, held-out problems `seed + 2`
  c.total_steps = 150              # RL steps (rollout batch + update)
  c.log_every = 1                  # console / TensorBoard / metrics.jsonl cadence (steps;
                                   #   evaluation steps and the last step always log)
  c.eval_every = 50                # held-out evaluation at step 0 and every k steps (eval/*
                                   #   in metrics.jsonl); 0 = only at the end
  c.eval_problems = 64             # held-out problems per evaluation (0 = no evaluation)
  c.eval_samples = 4               # greedy accuracy, and for k > 1 also avg@k and pass@k
                                   #   (fixed sampling key) at:
  c.eval_temperature = 1.0         #   evaluation sampling temperature
  c.eval_top_p = 1.0               #   evaluation nucleus (papers often evaluate at 0.95 while
                                   #   their training rollouts are untruncated)
  c.eval_batch_size = 256          # rows per evaluation generate call (problems x samples are
                                   #   sampled in chunks of at most this many, each rounded up
                                   #   to a multiple of the mesh's batch shards; 0 = all at once)
  c.ckpt_every = 50                # orbax checkpoint cadence (steps)
  c.keep_ckpts = 2                 # checkpoints kept
  c.export_hf = True               # write the final policy as an HF checkpoint (workdir/hf)
  c.plot = True                    # draw workdir/curves.png at the end (about 1.5 s: a sweep
                                   #   of many cells, whose runner plots them together, may
                                   #   turn it off)
  c.compilation_cache = "~/.cache/trm_jax/xla"  # JAX's persistent compilation cache: a rerun
                                   #   loads the programs it compiled before ("" = none;
                                   #   JAX_COMPILATION_CACHE_DIR names another directory,
                                   #   JAX_ENABLE_COMPILATION_CACHE=false turns it off)

  # Model
  c.model = ml_collections.ConfigDict()
  c.model.path = ""                # HF checkpoint dir; "" = the warm-up base model below
  c.model.dtype = "float32"        # learner compute dtype
  c.model.attn_impl = "auto"       # attention implementation (kernels.attention)
  c.model.remat = False            # rematerialise each block in the backward pass
  # LoRA (docs/lora.md): rank 0 trains every parameter; rank r > 0 trains only low-rank
  # adapters (y = W x + alpha / r * B A x) over the frozen base (model.path or the warm-up's)
  c.model.lora = ml_collections.ConfigDict()
  c.model.lora.rank = 0            # adapter rank r (0 = off: full fine-tuning)
  c.model.lora.alpha = 32.0        # adapter scale alpha / r (PEFT's lora_alpha)
  c.model.lora.targets = ("q", "k", "v", "o", "gate", "up", "down")  # projections adapted:
                                   #   attention q/k/v/o, dense MLPs' gate/up/down (MoE experts
                                   #   are never adapted)
  c.model.lora.base_quant = "none"  # frozen base storage: "none" (model.dtype), "int8", or
                                   #   "nf4" (QLoRA; qwix's quantization)
  c.model.lora.path = ""           # a PEFT adapter directory to start from ("" = new
                                   #   adapters: A random, B zero, i.e. the base itself)
  c.model.lora.export = "adapter"  # workdir/hf at the end: "adapter" (PEFT: adapter_config.json
                                   #   + adapter_model.safetensors) or "merged" (a full model)
  c.model.lora.sampler = "auto"    # rollouts and evaluations over W + (alpha / r) A B merged
                                   #   inside each sampler call ("merged": faster, measured in
                                   #   docs/lora.md; a full-precision copy of the weights while
                                   #   it runs), or over base + adapters ("unmerged"); "auto":
                                   #   merged over a full-precision base, unmerged over a
                                   #   quantized one (whose point is not to hold that copy)
  c.model.moe_chunk = 4096         # MoE with mesh.expert > 1: tokens per device per all-to-all
                                   #   (each chunk's receive buffer holds mesh.expert x chunk x
                                   #   top-k rows); more tokens are sent chunk by chunk
  c.model.arch = ml_collections.ConfigDict(dict(  # only used to build the warm-up model
      hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2,
      tie_word_embeddings=True, rope_theta=10000.0, max_position_embeddings=512))

  # Supervised warm-up (builds the base model when model.path is empty)
  c.warmup = ml_collections.ConfigDict()
  c.warmup.steps = 400             # SFT steps
  c.warmup.batch_size = 64
  c.warmup.lr = 3e-3
  c.warmup.seed = 0                # model init and warm-up data (stream warmup.seed + 1): one
                                   #   base for runs of every `seed`
  c.warmup.answer_only_frac = 0.3  # warm-up demonstrations written as the answer alone (no
                                   #   worked lines): the base then sometimes answers without
                                   #   working, mostly wrongly on long sums, and GRPO's gain is
                                   #   learning to work them out (docs/results.md, "Main job")
  c.warmup.cache_dir = "~/.cache/trm_jax/tiny_base"

  # Task
  c.task = ml_collections.ConfigDict()
  c.task.name = "synthetic"        # a registered task (trm_jax/data/tasks.py): synthetic |
                                   #   gsm8k | dapo_math | aime | tldr | govreport | hotpotqa
  c.task.path = ""                 # training data of the file-based tasks: a local
                                   #   jsonl/json/parquet file, a save_to_disk directory, or
                                   #   a Hugging Face dataset id (trm_jax/data/loaders.py)
  c.task.subset = ""               # the dataset's subset (hub config name, GSM8K's "main");
                                   #   "" = its default; files have none
  c.task.split = ""                # split of task.path to train on ("train"); "" = the only
                                   #   one (a file or a Dataset); a DatasetDict needs it
  c.task.eval_path = ""            # held-out data (same kinds as task.path); "" = a held-out
                                   #   split of task.path (task.eval_split), else
                                   #   eval_problems rows of task.path (a fixed-seed choice,
                                   #   trm_jax/data/task.py) that training never draws
  c.task.eval_subset = ""          # subset of task.eval_path; "" = its default
  c.task.eval_split = ""           # held-out split: of task.eval_path, or with eval_path ""
                                   #   another split of task.path ("test"); "" = the only
                                   #   one, or held-out rows as above
  c.task.eval_name = ""            # format of eval_path, a task that reads files (its reward
                                   #   and metrics score the held-out rows); "" = the same
                                   #   as task.name (dapo_math training, aime evaluation)
  c.task.synthetic = ml_collections.ConfigDict(dict(
      min_operands=2, max_operands=6, min_value=1, max_value=19, allow_subtraction=False,
      show_every=1, answer_format="####", filler=0, distinct=False))
  c.task.max_prompt_len = 0        # 0 = derived from the synthetic task (its longest
                                   #   chat-formatted prompt); file tasks must set it
  c.task.max_new_tokens = 0        # 0 = derived from the synthetic task (its longest
                                   #   solution + <eos>); file tasks must set it
  c.task.drop_long_prompts = False  # True: rows whose prompt is longer than max_prompt_len
                                   #   are left out (counted in the log); False: an error
                                   #   naming the row

  # Rollout
  c.rollout = ml_collections.ConfigDict()
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.top_k = 0
  c.rollout.dtype = "bfloat16"     # sampler compute dtype (mismatch knob: learner is fp32)
  c.rollout.logit_noise = 0.1      # std of additive logit noise (mismatch knob)
  c.rollout.router_noise = 0.0     # MoE router jitter (mismatch knob; MoE models only)
  c.rollout.routing_replay = False  # record the sampler's MoE expert choices and replay them in
                                    #   the learner (MoE models only; TRM then measures what
                                    #   mismatch remains)
  c.rollout.keep_full_logprobs = True   # exact token KL/TV for TRM (small vocabularies only)
  c.rollout.keep_topk_logprobs = 0
  c.rollout.slots = 16             # rows decoding at once (continuous batching: a finished
                                   #   row's slot takes the next row); 0 = all rows at once.
                                   #   16 measured fastest for this config (bench.trainer_settings)
  c.rollout.chunk = 16             # decode steps between refills and cache-bucket changes
  c.rollout.refill = 0             # load rows once this many slots are free (0 = slots // 8)
  c.rollout.bucket = 128           # granularity, in cache slots, of the lengths a decode step
                                   #   reads (at most 8 sizes, each one compiled loop)
  c.rollout.tail = 4               # once every row is loaded and <= slots // tail decode, pack
                                   #   them into slots // tail slots (1 = never)
  c.rollout.cache = ml_collections.ConfigDict(dict(
      policy="none", ratio=0.0, capacity=0, window=8, kernel=3, recent_frac=0.5, sinks=2))

  # RL
  c.rl = ml_collections.ConfigDict()
  c.rl.batch_size = 64             # sequences per rollout batch (prompts * group_size)
  c.rl.group_size = 8              # GRPO samples per prompt
  c.rl.num_minibatches = 1         # optimizer steps per rollout batch, per epoch
  c.rl.num_epochs = 1
  c.rl.num_microbatches = 1        # gradient accumulation inside a minibatch
  c.rl.score_microbatches = 1      # the scoring pass's rows in this many groups, one after
                                   #   another (less memory; > 1 scores in its own program,
                                   #   not inside the update)
  c.rl.objective = "trm_surrogate"  # trm_surrogate | ppo_clip | tis | gspo | cispo (token
                                   #   masking is the trm.criteria entry "token_mask"; the
                                   #   papers and usual settings: docs/algorithms.md)
  c.rl.loss_agg = "seq-mean-token-sum"  # the TRM surrogate E[M A sum_t rho_t]
  c.rl.normalize_std = True        # GRPO std normalisation (False: Dr.GRPO-style)
  c.rl.baseline = "all"            # GRPO group baseline: "all" rollouts, or only the TRM-kept
                                   #   ones ("kept"; masked rollouts get advantage 0)
  c.rl.clip_eps_low = 0.2          # ppo_clip
  c.rl.clip_eps_high = 0.2         # ppo_clip
  c.rl.dual_clip_c = 3.0           # ppo_clip dual clip
  c.rl.tis_cap = 2.0               # tis truncation C
  c.rl.gspo_clip_eps_low = 3e-4    # gspo's clip of the sequence ratio s = exp(mean_t log r):
  c.rl.gspo_clip_eps_high = 4e-4   #   the GSPO paper's 3e-4 / 4e-4 (a geometric mean of
                                   #   ratios sits far closer to 1 than one token's)
  c.rl.cispo_clip_eps_low = 1.0    # cispo's clip of its gradient-free IS weight: 1.0 = no lower
                                   #   bound (MiniMax-M1)
  c.rl.cispo_clip_eps_high = 4.0   #   weight capped at 1 + 4 = 5 (ScaleRL's epsilon_max)
  c.rl.chunk = 64                  # positions per vocabulary projection in the learner
  # DAPO (Yu et al. 2025; docs/algorithms.md):
  c.rl.dynamic_sampling = False    # drop groups whose rewards are all equal (no GRPO signal) and
                                   #   roll out more prompts until rl.batch_size rows have one
                                   #   (dapo/fill_rate); the data position advances by every
                                   #   prompt rolled out
  c.rl.dynamic_sampling_max_rounds = 4  # rollout calls per step at most (the batch, then
                                   #   top-ups of the missing groups); groups still missing
                                   #   stay in the batch as padding, out of the loss
  c.rl.overlong_buffer = 0         # soft overlong punishment: a penalty growing linearly over
                                   #   the last this many tokens before task.max_new_tokens
                                   #   (0 = off; DAPO: 4096 of 20480)
  c.rl.overlong_penalty = 1.0      # the penalty at task.max_new_tokens (DAPO: 1.0)
  c.rl.mask_truncated = False      # responses cut at task.max_new_tokens leave the loss but keep
                                   #   their reward in the group's baseline (DAPO's overlong
                                   #   filtering)
  c.rl.kl_beta = 0.0               # k3 KL penalty to the frozen starting policy (0 = off)
  c.rl.staleness = 0               # k: rollout batch t samples with the parameters after update
                                   #   t - 1 - k (0 = synchronous; k > 0 overlaps the next
                                   #   rollout with this step's updates)
  c.rl.max_staleness = -1          # drop (and count) a rollout batch more than this many
                                   #   updates old (-1 = no bound; else >= rl.staleness)
  c.rl.max_consecutive_skips = 10  # stop the run after this many consecutive steps whose
                                   #   updates were all skipped (non-finite, or every sequence
                                   #   masked): such a run cannot learn (0 = never stop)

  # TRM
  c.trm = ml_collections.ConfigDict()
  c.trm.criteria = ("trm_max_kl",)  # ANDed; see trm_jax/trm/masking.py for the list
  c.trm.delta = 0.02               # TRM-max KL threshold
  c.trm.eps = 0.15                 # TRM-max TV threshold
  c.trm.delta_avg = 0.01           # TRM-avg
  c.trm.delta_k2 = 0.05
  c.trm.delta_k3 = 0.01
  c.trm.delta_w = 0.05             # LN-TRM
  c.trm.delta_ser = 0.1            # SER
  c.trm.tau = 0.5                  # token_mask criterion: drop tokens with |log rho| > tau
  c.trm.seq_mis_cap = 2.0          # seq_mis: reject when prod_t rho_t > cap (verl's default)
  c.trm.geo_mean_tau = 0.001       # geo_mean: reject when |mean_t log rho_t| > tau (verl's
                                   #   geo_rs bounds 0.999 / 1.001 on exp(mean_t log rho_t))

  # SMD
  c.smd = ml_collections.ConfigDict()
  c.smd.mode = "off"               # off | dense | naive | sparse_rl | smd
  c.smd.lam = 0.1                  # distillation weight lambda

  # Optimizer
  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 3e-5
  c.optim.warmup_steps = 5
  c.optim.min_lr_ratio = 0.1
  c.optim.weight_decay = 0.0
  c.optim.b1 = 0.9
  c.optim.b2 = 0.99
  c.optim.eps = 1e-8
  c.optim.clip_norm = 1.0

  # Mesh (-1 = all remaining devices). rollout_devices = n > 0 puts the sampler on the first n
  # devices and the learner's (data, fsdp, expert, tensor) mesh on the rest (0 = colocated).
  # expert = n > 1 splits an MoE model's experts over n devices (it must divide them); tokens
  # travel to their experts and back (models/expert_parallel.py); outside the MoE layers the
  # axis splits the batch like data. 1 = every device holds every expert.
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, expert=1, tensor=1,
                                          rollout_devices=0))

  # Debug (fault-injection for tests; leave at 0)
  c.debug = ml_collections.ConfigDict()
  c.debug.nan_step = 0             # > 0: that RL step's advantages (so loss and gradients) are
                                   #   NaN; the learner must skip the update
  return c
