"""Supervised warm-up: builds the tiny base model that the main job's RL starts from.

RL from a random policy gets zero reward on any task worth the name, so the default job first
teaches a tiny decoder the synthetic task by teacher forcing on demonstrations (a fraction
`warmup.answer_only_frac` of them give the answer alone, the rest work the sum out), then
saves it as a Hugging Face checkpoint (config.json + safetensors + tokenizer files). The result
is an ordinary checkpoint: `trm_jax.models.from_pretrained` and transformers both load it.

The checkpoint directory carries `warmup.json` with the settings that produced it; the main
job reuses the directory when those settings match and rebuilds it otherwise.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from trm_jax import config as config_lib
from trm_jax.data import synthetic
from trm_jax.data.batching import make_sft_batch
from trm_jax.kernels import Visibility
from trm_jax.models import Decoder, ModelConfig, save_pretrained
from trm_jax.rl import optim

MARKER = "warmup.json"


def data_stream(c: ml_collections.ConfigDict) -> int:
  """The synthetic stream the warm-up's demonstrations come from: `warmup.seed + 1`, set by
  the warm-up's own settings only, so that the base is a function of its fingerprint and one
  base serves runs of every `seed` (a sweep over seeds compares RL from the same start). With
  the default warmup.seed 0 it is stream 1: run seed 1's RL prompts (problems that base saw
  worked), never a held-out stream (run seed k evaluates on stream k + 2)."""
  return int(c.warmup.seed) + 1


def _fingerprint(c: ml_collections.ConfigDict) -> dict:
  return {"arch": c.model.arch.to_dict(), "warmup": c.warmup.to_dict(),
          "task": c.task.synthetic.to_dict()}


def _what(fingerprint: dict) -> dict:
  """The fingerprint without `warmup.cache_dir`: where a base lives is not what it is, so a
  built base stays current when its directory is moved, copied or named by another config."""
  return {**fingerprint, "warmup": {k: v for k, v in fingerprint.get("warmup", {}).items()
                                    if k != "cache_dir"}}


def is_current(path: str, c: ml_collections.ConfigDict) -> bool:
  marker = os.path.join(path, MARKER)
  if not os.path.isfile(marker):
    return False
  with open(marker) as f:
    return _what(json.load(f)) == _what(json.loads(json.dumps(_fingerprint(c))))


def sft_loss(model: Decoder, tokens: jax.Array, loss_mask: jax.Array, lengths: jax.Array):
  """Mean next-token cross-entropy over the solution tokens. tokens [B, T] right padded."""
  vis = Visibility.from_lengths(lengths, tokens.shape[1])
  logits = model(tokens[:, :-1], visibility=Visibility(vis.segment_ids[:, :-1]))  # [B, T-1, V]
  logq = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logq, tokens[:, 1:, None], axis=-1)[..., 0]
  m = loss_mask[:, 1:]
  return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)


def base_model_config(c: ml_collections.ConfigDict, tok) -> ModelConfig:
  """The warm-up base model's architecture: config.model.arch over the synthetic tokenizer
  `tok` (its vocabulary and special ids)."""
  a = c.model.arch
  # An arch with num_experts > 0 builds a Qwen3-MoE-shaped model (every MLP sparse), the
  # setting where router jitter in the sampler flips expert choices (TRM paper Sec. 1).
  moe = ({"num_experts": a.num_experts, "num_experts_per_tok": a.num_experts_per_tok,
          "moe_intermediate_size": a.moe_intermediate_size}
         if a.get("num_experts", 0) else {})
  return ModelConfig(
      model_type="qwen3_moe" if moe else "qwen3", vocab_size=tok.vocab_size, hidden_size=a.hidden_size,
      intermediate_size=a.intermediate_size, num_layers=a.num_layers, num_heads=a.num_heads,
      num_kv_heads=a.num_kv_heads, head_dim=a.hidden_size // a.num_heads,
      tie_word_embeddings=a.tie_word_embeddings, qk_norm=True, rope_theta=a.rope_theta,
      max_position_embeddings=a.max_position_embeddings, bos_token_id=tok.bos_id,
      eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, **moe)


def build_base_model(c: ml_collections.ConfigDict, out_dir: str, *,
                     log: Callable[[str], None] = print) -> str:
  """Trains the tiny base model by SFT on the synthetic task; writes an HF checkpoint."""
  task_cfg = synthetic.from_config(c.task.synthetic)
  w = c.warmup
  tmp = tempfile.mkdtemp(prefix=".warmup-", dir=os.path.dirname(os.path.abspath(out_dir)))
  tok = synthetic.make_synthetic_tokenizer(tmp)
  mcfg = base_model_config(c, tok)
  model = Decoder(mcfg, rngs=nnx.Rngs(w.seed))
  tx = optim.make_optimizer(lr=w.lr, warmup_steps=max(1, w.steps // 20), total_steps=w.steps,
                            weight_decay=0.0, b1=0.9, b2=0.99, eps=1e-8,
                            min_lr_ratio=0.1, clip_norm=1.0)
  graphdef, params = nnx.split(model)
  opt_state = tx.init(params)
  T = synthetic.max_prompt_chars(task_cfg) + synthetic.max_completion_chars(task_cfg) + 8

  @jax.jit
  def step(params, opt_state, tokens, loss_mask, lengths):
    def loss_fn(p):
      return sft_loss(nnx.merge(graphdef, p), tokens, loss_mask, lengths)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  t0 = time.time()
  t1 = None   # when step 1 (which includes the compile) ended: the rate is measured from it
  for i in range(w.steps):
    problems = synthetic.demonstration_batch(task_cfg, data_stream(c), i * w.batch_size,
                                             w.batch_size, w.answer_only_frac)
    b = make_sft_batch(tok, problems, max_len=T)
    params, opt_state, loss = step(params, opt_state, jnp.asarray(b.tokens),
                                   jnp.asarray(b.loss_mask), jnp.asarray(b.lengths))
    # Step 1, an early estimate at step 5, every tenth of the run, and the last step.
    if i in (0, 4) or i % max(1, w.steps // 10) == 0 or i == w.steps - 1:
      loss = float(loss)
      now = time.time()
      t1 = now if t1 is None else t1
      left = (now - t1) / i * (w.steps - 1 - i) if 0 < i < w.steps - 1 else None
      log(f"[warmup] step {i + 1}/{w.steps} loss {loss:.4f} ({now - t0:.0f}s" +
          (f"; about {_duration(left)} left)" if left is not None else ")"))
  save_pretrained(nnx.merge(graphdef, params), tmp)
  with open(os.path.join(tmp, MARKER), "w") as f:
    json.dump(_fingerprint(c), f, indent=2)
  # Atomic publish: a crash mid-warm-up leaves no half-written base model behind.
  return _publish(tmp, out_dir)


def _duration(seconds: float) -> str:
  return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def _publish(tmp: str, out_dir: str) -> str:
  """Replaces out_dir by the finished directory tmp (a rename, after removing the old one)."""
  if os.path.exists(out_dir):
    shutil.rmtree(out_dir)
  os.replace(tmp, out_dir)
  return out_dir


def model_digest(path: str) -> str:
  """sha256 of a checkpoint directory's model.safetensors: which base a run started from."""
  import hashlib  # pylint: disable=g-import-not-at-top
  h = hashlib.sha256()
  with open(os.path.join(path, "model.safetensors"), "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def copy_base(src: str, dst: str) -> str:
  """Copies a base model directory to `dst` atomically (nothing when the two hold the same
  weights); returns dst."""
  if os.path.isdir(dst) and model_digest(dst) == model_digest(src):
    return dst
  os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
  tmp = dst + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  shutil.copytree(src, tmp)
  return _publish(tmp, dst)


def install_base(src: str, c: ml_collections.ConfigDict) -> str:
  """Puts a copy of a warm-up's output (`src`) where `c`'s warm-up caches its base, so runs of
  `c` start from it instead of warming up again. Warm-ups are not bitwise reproducible across
  CPUs (XLA:CPU's code differs by instruction set; the main job's base scores held-out avg@4
  0.504 warmed up on an Intel Xeon and 0.547 on an AMD EPYC), so a grid continued on another
  machine must carry its base. Refuses a base built with other warm-up settings; returns the
  cache path."""
  if c.model.path:
    raise config_lib.ConfigError(f"install_base: model.path={c.model.path!r} is set, so the "
                                 "config has no warm-up cache to install into")
  if not is_current(src, c):
    raise config_lib.ConfigError(f"{src} was not warmed up with this config's warm-up "
                                 f"settings ({MARKER} differs); it cannot stand in for its base")
  return copy_base(src, os.path.expanduser(c.warmup.cache_dir))


def ensure_base_model(c: ml_collections.ConfigDict, *, log: Callable[[str], None] = print,
                      ) -> str:
  """The config's `model.path`, or the cached warm-up checkpoint (built when missing/stale)."""
  if c.model.path:
    return c.model.path
  out = os.path.expanduser(c.warmup.cache_dir)
  if is_current(out, c):
    log(f"[warmup] reusing base model at {out}")
    return out
  log(f"[warmup] building base model at {out}: {c.warmup.steps} supervised steps of "
      f"{c.warmup.batch_size} demonstrations, once (later runs of these warm-up settings reuse "
      "it); the time left is estimated from step 5")
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  return build_base_model(c, out, log=log)
