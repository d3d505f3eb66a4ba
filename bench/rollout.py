"""Rollout throughput: our sampler vs transformers `generate` and Tunix's `Sampler`, quietly.

  python -m bench.rollout                 # full protocol, writes bench/results/rollout.json
  python -m bench.rollout --quick         # 32 new tokens, 2 repeats, prompt 1024 for SnapKV
  python -m bench.rollout --wait-quiet 600   # first wait (up to 600 s) for a 1-minute load < 0.5

One random Qwen3 checkpoint (4 layers, d 512, 8/4 heads, vocab 32000; every parameter drawn by
transformers' initialiser) is written by `save_pretrained` and loaded by every contender in
each dtype, so all run the same weights: ours (`trm_jax.rollout.generate`), transformers
(`generate`, do_sample), and Tunix 0.1.7 (`tunix.generate.sampler.Sampler`, loaded with its own
safetensors loader) when `google-tunix` is importable (the `bench` extra). Batch 8, prompt 128,
128 new tokens, temperature 1, no truncation, no EOS (every row generates every token).

Protocol. Each contender is called once for warm-up (compiles) with 1 and with N new tokens.
Then, per round (two by default), `repeats` times: every contender, in an order rotated each
repeat, generates N tokens and 1 token. Per round and contender the median times give
  end-to-end new tokens/s  B * N / t(N)          (prompt in, tokens on the host out)
  decode tokens/s          B * (N - 1) / (t(N) - t(1))   (prefill and first token cancel)
and the round's ratios ours / theirs. The matmul-only loop (`matmul_loop_ms`: a fori_loop of
the same model's matmuls, no attention, no sampling, both weight layouts) runs in each round
too, so the decode step is compared with it in the same conditions.

Hygiene (`bench.hygiene`): every timed call records the load and the CPU time other processes
used during it; a round with any contended call is reported under `contended_rounds`, never
under `results`. Only same-run ratios mean anything: absolute rates change with the CPU model and its load.

The SnapKV comparison (prompt 2048, batch 2, 50% of the prompt kept) times the decode loop
alone (`run_phase("decode")`), since the prefill is identical for both and several times longer.

Long-horizon modes, each with its own JSON file; neither runs the fixed-shape one:

  python -m bench.rollout --grpo [--quick]    # bench/results/rollout_grpo.json
  python -m bench.rollout --curve [--quick]   # bench/results/rollout_curve.json

Both use a smaller random Qwen3 (`SMALL_ARCH`: 4 layers, d 256, d_ff 768, 4/2 heads of 64,
vocab 4096, fp32) written by `save_pretrained` and loaded by every contender.

--grpo: a GRPO-shaped batch, 32 prompts x 8 rollouts = 256 rows (a group's rows adjacent and
  identical), prompt 32, at most 1024 new tokens, lengths set by EOS (id `EOS_ID` = 1; prompt
  ids avoid it and pad 0). `plant_eos` gives the random checkpoint an EOS sampled with a
  near-constant per-step probability 1/137 (hidden dimension 0 is made a constant of the
  residual stream and the EOS row of lm_head reads only it, scaled by a bisected weight), so
  lengths are about geometric: mean ~137, median ~95, the longest of 256 rows typically
  600-1000. Contenders, each generating all rows: ours with continuous batching
  (`ours_slots{S}_g8`: slots S in --grpo-slots, default 32 64 128, group_size 8), ours all at
  once (`ours_all_g8`: slots 0, group_size 8; `ours_all_g1`: every row prefilled), transformers
  `generate` (all rows in one call), transformers' continuous batching `generate_batch`
  (`transformers_cb`, one request per row, its defaults), Tunix's `Sampler`. Each is called
  once to warm up (compiles), then per round (--rounds, default 1) --grpo-repeats (default 3)
  times, order rotated, every contender with the same seed within a repeat. Per contender:
  median wall seconds for all rows, generated tokens, useful tokens/s, response-length stats
  (mean/median/p90/max); speedups t(other) / t(ours_slots{S}) and, for the fastest S, the
  goals (`GRPO_GOALS`: >= 3x ours all at once, >= 4x transformers and Tunix, ahead of
  transformers' continuous batching). While `generate` takes no `slots` / `group_size` (the
  continuous-batching sampler not landed; `inspect.signature`), only `ours_all_g1` of ours
  runs and the JSON says "slots_supported": false. A contender that cannot run is listed
  under `unavailable` with the reason. --no-cb skips `generate_batch`.
  --quick: 8 x 8 rows, at most 256 new tokens, EOS mean 40, S in (16, 32), 2 repeats.

--curve: no EOS (every row generates every token), prompt 32; per cell (rows, new tokens N)
  of --curve-rows x --curve-new (default (8, 32, 128, 256) x (128, 512, 1024, 2048, 4096,
  8192)), ours (slots 0) and transformers in the same cell: a first call of N (and, once per
  rows, of 1 token), then --curve-repeats (default 3; 2 where a call is predicted over 15 s)
  warm calls of N and of 1 token, interleaved and rotated. Decode ms/step = (t(N) - t(1)) /
  (N - 1) of the medians (`rates`); compile seconds = first call minus the median warm call
  (ours compiles one program per (rows, N); for transformers, which does not compile, the same
  difference is first-call overhead). Cells run by N, then rows, ascending; a contender skips a
  cell, recorded under `skipped` with the reason, when rows x N > --curve-max-product (default
  256 x 1024), when its fp32 KV cache would exceed --curve-max-cache-gb (3), when one call,
  predicted from its own smaller cells (ms/step linear in the cache length), would exceed
  --curve-max-call-s (45, ours) or --curve-max-call-s-transformers (30), or when the cell
  would end after --curve-budget-s (1320: the whole run stays under ~25 minutes). A contended
  cell is measured once more and, if still contended, listed under `contended_cells`, never
  under `results`. --quick: rows (8, 32) x N (128, 512), 2 repeats, no retry.

Tunix can be imported from a separate directory (--tunix-path DIR or TRM_BENCH_TUNIX_PATH):
`pip install google-tunix==0.1.7` into this venv would downgrade transformers (5.24 -> 5.12.1,
Tunix pins safetensors < 0.8) and huggingface_hub, so instead `pip install --no-deps --target
DIR google-tunix==0.1.7 google-metrax clu wrapt jaxtyping perfetto wadler_lindig` (its
imports that the venv lacks) leaves every installed package as it is.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Optional

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402

from bench import hygiene  # noqa: E402
from trm_jax.models import from_pretrained  # noqa: E402
from trm_jax.rollout import CacheConfig, SamplingConfig, generate, run_phase  # noqa: E402

ARCH = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-6,
            max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=None,
            eos_token_id=None, pad_token_id=0)
RESULTS = os.path.join(os.path.dirname(__file__), "results")
DTYPES = {"float32": (jnp.float32, torch.float32), "bfloat16": (jnp.bfloat16, torch.bfloat16)}


def write_checkpoint(path: str) -> str:
  torch.manual_seed(0)
  model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**ARCH)).eval()
  model.save_pretrained(path)
  return path


def prompts(B: int, P: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(1, ARCH["vocab_size"], (B, P)).astype(np.int32)


# ------------------------------------------------------------------------------ contenders
class Ours:
  name = "ours"

  def __init__(self, path, dtype):
    self.model = from_pretrained(path, dtype=DTYPES[dtype][0])

  def __call__(self, ids, n, seed):
    lens = np.full((ids.shape[0],), ids.shape[1], np.int32)
    r = generate(self.model, ids, lens, max_new_tokens=n, key=jax.random.key(seed), eos_ids=())
    out = np.asarray(r.tokens)                                   # on the host, as the others
    assert out.shape == (ids.shape[0], ids.shape[1] + n)


class Transformers:
  name = "transformers"

  def __init__(self, path, dtype):
    self.model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[dtype][1]).eval()

  def __call__(self, ids, n, seed):
    torch.manual_seed(seed)
    x = torch.as_tensor(np.array(ids), dtype=torch.long)
    with torch.no_grad():
      out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=True,
                                temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=n,
                                min_new_tokens=n, pad_token_id=0)
    assert out.shape[1] == ids.shape[1] + n


class _IdTokenizer:
  """Tunix's Sampler takes strings: prompts are space-separated ids, outputs are not decoded."""

  def encode(self, text, **_):
    return [int(t) for t in text.split()]

  def decode(self, ids, **_):
    return ""

  def bos_id(self):
    return None

  def eos_id(self):
    return -1                                                    # never sampled: no EOS

  def pad_id(self):
    return 0


class Tunix:
  name = "tunix"

  def __init__(self, path, dtype, *, max_len):
    from tunix.generate import sampler as tsampler
    from tunix.models.qwen3 import model as tmodel
    from tunix.models.qwen3 import params as tparams
    jdt = DTYPES[dtype][0]
    cfg = tmodel.ModelConfig(
        num_layers=ARCH["num_hidden_layers"], vocab_size=ARCH["vocab_size"],
        embed_dim=ARCH["hidden_size"], hidden_dim=ARCH["intermediate_size"],
        num_heads=ARCH["num_attention_heads"], head_dim=ARCH["head_dim"],
        num_kv_heads=ARCH["num_key_value_heads"], rope_theta=10_000,
        norm_eps=ARCH["rms_norm_eps"], use_tied_embedding=False, dtype=jdt, param_dtype=jdt)
    # Tunix's own loader reads the same safetensors: every parameter is the checkpoint's random
    # draw (a freshly constructed Tunix Qwen3 starts its MLP kernels at zero).
    model = tparams.create_model_from_safe_tensors(path, cfg, dtype=jdt)
    self.sampler = tsampler.Sampler(model, _IdTokenizer(), tsampler.CacheConfig(
        cache_size=max_len, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim))

  def __call__(self, ids, n, seed):
    out = self.sampler([" ".join(map(str, row)) for row in ids], max_generation_steps=n,
                       max_prompt_length=ids.shape[1], temperature=1.0, top_p=1.0, top_k=None,
                       seed=seed, eos_tokens=[-1])
    assert all(len(t) == n for t in out.tokens)


def tunix_available() -> bool:
  return tunix_import_error() is None


def tunix_import_error() -> Optional[str]:
  """None when Tunix's sampler imports, else why not."""
  try:
    import tunix.generate.sampler  # noqa: F401
    return None
  except Exception as e:  # any import failure means "not installed beside this jax": skip it
    return f"{type(e).__name__}: {e}"


# ------------------------------------------------------------------------------ matmul floor
def matmul_loop_ms(dtype: str, *, B: int, steps: int = 64, repeats: int = 3) -> dict:
  """ms per step of a fori_loop running only the model's matmuls (4 layers' q, k, v, o, gate,
  up, down and the vocabulary projection) at batch B: the floor a decode step is compared
  with. Weights [in, out] (our layout) and [out, in] (torch's); activations cast to the
  compute dtype after each matmul, fp32 accumulation."""
  jdt = DTYPES[dtype][0]
  D, F, V = ARCH["hidden_size"], ARCH["intermediate_size"], ARCH["vocab_size"]
  NH, KH = ARCH["num_attention_heads"] * ARCH["head_dim"], ARCH["num_key_value_heads"] * ARCH["head_dim"]
  rng = np.random.default_rng(0)
  out = {}
  for layout in ("in_out", "out_in"):
    def w(i, o):
      shape = (i, o) if layout == "in_out" else (o, i)
      return jnp.asarray(0.02 * rng.standard_normal(shape, np.float32), jdt)
    layers = [dict(q=w(D, NH), k=w(D, KH), v=w(D, KH), o=w(NH, D), g=w(D, F), u=w(D, F),
                   d=w(F, D)) for _ in range(ARCH["num_hidden_layers"])]
    head = w(D, V)
    eq = "bi,io->bo" if layout == "in_out" else "bi,oi->bo"
    mm = lambda x, m: jnp.einsum(eq, x, m, preferred_element_type=jnp.float32).astype(jdt)

    @jax.jit
    def loop(layers, head, x):
      def body(_, c):
        x, acc = c
        for p in layers:
          a = mm(x, p["q"])
          kv = mm(x, p["k"]) + mm(x, p["v"])
          x = x + mm(a, p["o"]) + jnp.tile(kv, (1, NH // KH)) * 0
          x = x + mm(jax.nn.silu(mm(x, p["g"])) * mm(x, p["u"]), p["d"])
        logits = jnp.einsum(eq, x, head, preferred_element_type=jnp.float32)
        return x * 0.5 + logits[:, :D].astype(jdt), acc + logits[:, 0]
      return jax.lax.fori_loop(0, steps, body, (x, jnp.zeros((B,), jnp.float32)))
    x = jnp.full((B, D), 0.1, jdt)
    jax.block_until_ready(loop(layers, head, x))
    times, probes = [], []
    for _ in range(repeats):
      t, info, _ = hygiene.timed(lambda: jax.block_until_ready(loop(layers, head, x)))
      times.append(t)
      probes.append(info)
    out[layout] = dict(ms_per_step=round(statistics.median(times) / steps * 1e3, 3),
                       contended=any(p["contended"] for p in probes), probes=probes)
  best = min(("in_out", "out_in"), key=lambda k: out[k]["ms_per_step"])
  out["best_layout"] = best
  out["best_ms_per_step"] = out[best]["ms_per_step"]
  return out


# ------------------------------------------------------------------------------ protocol
def rates(t_full, t_one, B, N):
  return dict(end_to_end_tokens_per_s=round(B * N / t_full, 2),
              decode_tokens_per_s=round(B * (N - 1) / max(t_full - t_one, 1e-9), 2),
              decode_ms_per_step=round((t_full - t_one) / (N - 1) * 1e3, 3),
              seconds_n_tokens=round(t_full, 4), seconds_1_token=round(t_one, 4))


def bench_dtype(path, dtype, *, B, P, N, repeats, rounds, with_tunix) -> dict:
  contenders = [Ours(path, dtype), Transformers(path, dtype)]
  if with_tunix:
    contenders.append(Tunix(path, dtype, max_len=P + N))
  ids = prompts(B, P)
  warm = {}
  for c in contenders:                                   # compile / warm every program
    t0 = time.perf_counter()
    c(ids, 1, 0)
    c(ids, N, 0)
    warm[c.name] = round(time.perf_counter() - t0, 2)
  out_rounds = []
  for rnd in range(rounds):
    calls = {c.name: {"N": [], "1": []} for c in contenders}
    for rep in range(repeats):
      order = contenders[rep % len(contenders):] + contenders[:rep % len(contenders)]
      for c in order:
        for n, slot in ((N, "N"), (1, "1")):
          t, info, _ = hygiene.timed(c, ids, n, 1000 * rnd + rep + 1)
          calls[c.name][slot].append(info)
    floor = matmul_loop_ms(dtype, B=B)
    med = {name: {s: statistics.median(i["wall_s"] for i in v[s]) for s in v}
           for name, v in calls.items()}
    r = {name: rates(m["N"], m["1"], B, N) for name, m in med.items()}
    contended = (any(i["contended"] for v in calls.values() for s in v.values() for i in s)
                 or floor["in_out"]["contended"] or floor["out_in"]["contended"])
    ratios = {}
    for other in r:
      if other != "ours":
        for k in ("end_to_end_tokens_per_s", "decode_tokens_per_s"):
          ratios[f"{k.replace('_tokens_per_s', '')}_ours_over_{other}"] = round(
              r["ours"][k] / r[other][k], 3)
    ratios["decode_step_over_matmul_loop"] = round(
        r["ours"]["decode_ms_per_step"] / floor["best_ms_per_step"], 3)
    out_rounds.append(dict(
        round=rnd, contended=contended, rates=r, ratios=ratios,
        matmul_loop_ms=floor, max_other_cores=max(
            i["other_cores"] or 0 for v in calls.values() for s in v.values() for i in s),
        calls={name: {s: [dict(wall_s=i["wall_s"], other_cores=i["other_cores"],
                               load_before=i["load_before"][0], contended=i["contended"])
                          for i in v[s]] for s in v} for name, v in calls.items()}))
    print(f"{dtype} round {rnd}: {'CONTENDED' if contended else 'quiet'} "
          f"{json.dumps({k: v['end_to_end_tokens_per_s'] for k, v in r.items()})} e2e tok/s; "
          f"{json.dumps(ratios)}", flush=True)
  return dict(dtype=dtype, batch=B, prompt=P, new_tokens=N, repeats=repeats,
              contenders=[c.name for c in contenders], warmup_seconds=warm,
              rounds=out_rounds)


def bench_snapkv(path, *, B, P, N, repeats, rounds) -> dict:
  """Dense vs 50% SnapKV at a long prompt: the decode loop timed on its own (`run_phase`),
  because the prefill (identical for both) is several times the decode time."""
  model = from_pretrained(path)
  graphdef, state = nnx.split(model)
  ids = jnp.asarray(prompts(B, P, seed=1))
  lens = jnp.full((B,), P, jnp.int32)
  scfg = SamplingConfig(max_new_tokens=N, eos_ids=())
  configs = {"dense": CacheConfig(), "snapkv_50": CacheConfig(policy="snapkv", ratio=0.5)}
  carries, info = {}, {}
  for name, cc in configs.items():
    kw = dict(key=jax.random.key(0), sampling_config=scfg, cache_config=cc)
    carries[name] = jax.block_until_ready(run_phase("prefill", graphdef, state, ids, lens, **kw))
    r = jax.block_until_ready(run_phase("decode", graphdef, state, ids, lens,
                                        carry=carries[name], **kw))       # compile
    info[name] = dict(cache_bytes=r.stats.cache_bytes, cache_slots=r.stats.cache_slots)

  def decode(name):
    return jax.block_until_ready(run_phase(
        "decode", graphdef, state, ids, lens, key=jax.random.key(0), sampling_config=scfg,
        cache_config=configs[name], carry=carries[name]).tokens)
  out_rounds = []
  for rnd in range(rounds):
    calls = {name: [] for name in configs}
    for rep in range(repeats):
      for name in (list(configs) if rep % 2 == 0 else list(configs)[::-1]):
        calls[name].append(hygiene.timed(decode, name)[1])
    tps = {name: round(B * (N - 1) / statistics.median(i["wall_s"] for i in v), 2)
           for name, v in calls.items()}
    contended = any(i["contended"] for v in calls.values() for i in v)
    out_rounds.append(dict(round=rnd, contended=contended, decode_tokens_per_s=tps,
                           decode_speed_ratio=round(tps["snapkv_50"] / tps["dense"], 3),
                           calls={n: [dict(wall_s=i["wall_s"], other_cores=i["other_cores"],
                                           contended=i["contended"]) for i in v]
                                  for n, v in calls.items()}))
    print(f"snapkv round {rnd}: {'CONTENDED' if contended else 'quiet'} {tps}", flush=True)
  return dict(batch=B, prompt=P, new_tokens=N, repeats=repeats, **info,
              cache_bytes_ratio=round(info["snapkv_50"]["cache_bytes"]
                                      / info["dense"]["cache_bytes"], 4),
              target_cache_bytes_ratio=0.55, target_decode_speed_ratio=1.0, rounds=out_rounds)


def summarize(by_dtype: dict, snap: dict) -> dict:
  """Quiet rounds only; contended ones are listed apart and never summarised."""
  results, contended = {}, {}
  for dtype, d in by_dtype.items():
    quiet = [r for r in d["rounds"] if not r["contended"]]
    contended[dtype] = [dict(round=r["round"], ratios=r["ratios"],
                             max_other_cores=r["max_other_cores"])
                        for r in d["rounds"] if r["contended"]]
    if quiet:
      results[dtype] = dict(
          quiet_rounds=len(quiet),
          end_to_end_tokens_per_s={k: [r["rates"][k]["end_to_end_tokens_per_s"] for r in quiet]
                                   for k in d["contenders"]},
          decode_tokens_per_s={k: [r["rates"][k]["decode_tokens_per_s"] for r in quiet]
                               for k in d["contenders"]},
          decode_ms_per_step_ours=[r["rates"]["ours"]["decode_ms_per_step"] for r in quiet],
          matmul_loop_ms_per_step=[r["matmul_loop_ms"]["best_ms_per_step"] for r in quiet],
          ratios={k: [r["ratios"][k] for r in quiet] for k in quiet[0]["ratios"]})
  quiet_snap = [r for r in snap["rounds"] if not r["contended"]]
  if quiet_snap:
    results["snapkv_50_prompt_2048"] = dict(
        cache_bytes_ratio=snap["cache_bytes_ratio"],
        decode_speed_ratio=[r["decode_speed_ratio"] for r in quiet_snap])
  contended["snapkv"] = [dict(round=r["round"], decode_speed_ratio=r["decode_speed_ratio"])
                         for r in snap["rounds"] if r["contended"]]
  return dict(results=results, contended_rounds=contended)


# ============================================================== long-horizon workloads
SMALL_ARCH = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
                  max_position_embeddings=16384, tie_word_embeddings=False, bos_token_id=None,
                  eos_token_id=None, pad_token_id=0)
EOS_ID = 1              # prompts draw ids from [FIRST_PROMPT_ID, vocab): never pad 0 nor EOS
FIRST_PROMPT_ID = 2
EOS_CONSTANT = 1.0      # the value hidden dimension 0 holds in the residual stream (plant_eos)
# Speedup of ours with slots (wall time for all rows) aimed at, per other contender;
# transformers' continuous batching: ahead of it.
GRPO_GOALS = {"ours_all": 3.0, "transformers": 4.0, "tunix": 4.0, "transformers_cb": 1.0}


def plant_eos(model, mean_length: float, *, seed: int = 0) -> dict:
  """Gives a random transformers Qwen3 an EOS (id EOS_ID) sampled with a near-constant
  probability 1 / mean_length per step, whatever the context, so that response lengths are
  about geometric with that mean.

  Hidden dimension 0 becomes a constant of the residual stream: every embedding holds
  EOS_CONSTANT there and no layer writes to it (row 0 of every o_proj and down_proj is zeroed),
  so after the final RMSNorm it is nearly the same at every position (it still enters every
  layer's attention and MLP, as any dimension does). The EOS row of lm_head reads only that
  dimension, scaled by alpha; alpha is bisected so that the mean softmax probability of EOS over
  random contexts (uniform ids, 8 x 1024, which is what a near-uniform random model samples) is
  1 / mean_length. Returns the planting's settings and the per-step probability it measured."""
  with torch.no_grad():
    model.model.embed_tokens.weight[:, 0] = EOS_CONSTANT
    for layer in model.model.layers:
      layer.self_attn.o_proj.weight[0, :] = 0.0
      layer.mlp.down_proj.weight[0, :] = 0.0
    model.lm_head.weight[EOS_ID] = 0.0
    V = model.config.vocab_size
    ids = torch.as_tensor(np.random.default_rng(seed).integers(FIRST_PROMPT_ID, V, (8, 1024)))
    h = model.model(input_ids=ids).last_hidden_state                 # after the final norm
    logits = model.lm_head(h)

    def p_eos(alpha):
      lg = logits.clone()
      lg[..., EOS_ID] = alpha * h[..., 0]
      return torch.softmax(lg, dim=-1)[..., EOS_ID]
    lo, hi = 0.0, 64.0
    for _ in range(60):
      mid = 0.5 * (lo + hi)
      lo, hi = (mid, hi) if p_eos(mid).mean().item() < 1.0 / mean_length else (lo, mid)
    alpha = 0.5 * (lo + hi)
    model.lm_head.weight[EOS_ID, 0] = alpha
    p = p_eos(alpha)
  return dict(eos_token_id=EOS_ID, target_mean_length=mean_length, residual_constant=EOS_CONSTANT,
              lm_head_eos_weight=round(alpha, 6),
              hidden0_after_norm=dict(mean=round(h[..., 0].mean().item(), 4),
                                      std=round(h[..., 0].std().item(), 4)),
              per_step_p_eos=dict(mean=float(f"{p.mean().item():.6g}"),
                                  std=float(f"{p.std().item():.4g}"),
                                  min=float(f"{p.min().item():.4g}"),
                                  max=float(f"{p.max().item():.4g}")),
              measured_on="softmax at 8 x 1024 positions of uniform random ids")


def write_small_checkpoint(path: str, *, eos_mean: Optional[float] = None) -> dict:
  """The SMALL_ARCH random checkpoint (same draw with or without EOS); with eos_mean its config
  names EOS_ID as eos_token_id and `plant_eos` sets its probability. Returns what was planted."""
  torch.manual_seed(0)
  arch = dict(SMALL_ARCH, eos_token_id=EOS_ID if eos_mean else None)
  model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**arch)).eval()
  info = plant_eos(model, eos_mean) if eos_mean else dict(eos_token_id=None)
  model.save_pretrained(path)
  return dict(arch, model_type="qwen3", eos=info)


def group_prompts(groups: int, group_size: int, P: int, seed: int = 0) -> np.ndarray:
  """[groups * group_size, P] ids: each group's rows adjacent and identical; no pad, no EOS."""
  ids = np.random.default_rng(seed).integers(FIRST_PROMPT_ID, SMALL_ARCH["vocab_size"],
                                             (groups, P))
  return np.repeat(ids, group_size, axis=0).astype(np.int32)


def slots_supported() -> bool:
  """Whether `generate` takes the continuous-batching arguments (`slots`, `group_size`)."""
  params = inspect.signature(generate).parameters
  return "slots" in params and "group_size" in params


def length_stats(lens, max_new: int) -> dict:
  lens = np.asarray(lens)
  return dict(rows=int(lens.size), total=int(lens.sum()), mean=round(float(lens.mean()), 2),
              median=float(np.median(lens)), p90=float(np.percentile(lens, 90)),
              max=int(lens.max()), min=int(lens.min()), at_max_new=int((lens >= max_new).sum()))


def _lengths_to_eos(gen: np.ndarray, n: int, eos: bool) -> np.ndarray:
  """Response lengths (EOS included) of generated tokens [B, <= n] (a row without EOS: all of
  them, n if the call stopped early because every other row had finished)."""
  if not eos:
    return np.full((gen.shape[0],), gen.shape[1], np.int64)
  hit = gen == EOS_ID
  return np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, n if gen.shape[1] == n else
                  gen.shape[1])


class OursLong:
  """`generate` on all rows, with `slots` / `group_size` when the sampler has them. Returns the
  rows' response lengths; tokens come to the host, as the others'."""

  def __init__(self, model, *, slots: int = 0, group_size: int = 1, eos: bool = True):
    self.model = model
    self.kw = dict(slots=slots, group_size=group_size) if slots_supported() else {}
    if not self.kw and (slots or group_size != 1):
      raise ValueError("generate takes no slots / group_size (continuous batching not landed)")
    self.eos_ids = (EOS_ID,) if eos else ()
    self.name = f"ours_slots{slots}_g{group_size}" if slots else f"ours_all_g{group_size}"

  def __call__(self, ids, n, seed):
    lens = np.full((ids.shape[0],), ids.shape[1], np.int32)
    r = generate(self.model, ids, lens, max_new_tokens=n, key=jax.random.key(seed),
                 eos_ids=self.eos_ids, **self.kw)
    np.asarray(r.tokens)
    out = np.asarray(r.response_lengths)
    assert out.shape == (ids.shape[0],)
    return out


class TransformersLong:
  """`model.generate` on all rows in one call, as a user would (equal prompt lengths)."""
  name = "transformers"

  def __init__(self, path, *, eos: bool = True):
    self.model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32).eval()
    self.eos = eos

  def __call__(self, ids, n, seed):
    torch.manual_seed(seed)
    x = torch.as_tensor(np.array(ids), dtype=torch.long)
    stop = dict(eos_token_id=EOS_ID) if self.eos else dict(min_new_tokens=n)
    with torch.no_grad():
      out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=True,
                                temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=n,
                                pad_token_id=0, **stop)
    return _lengths_to_eos(out[:, ids.shape[1]:].numpy(), n, self.eos)


class TransformersCB:
  """transformers' continuous batching, `model.generate_batch` (one request per row; its
  scheduler, paged cache and attention switch are its defaults on this device)."""
  name = "transformers_cb"

  def __init__(self, path):
    self.model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32).eval()
    if not hasattr(self.model, "generate_batch"):
      raise RuntimeError(f"transformers {transformers.__version__} has no generate_batch")
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    self._cb_config = ContinuousBatchingConfig

  def __call__(self, ids, n, seed):
    gc = transformers.GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                       max_new_tokens=n, eos_token_id=EOS_ID, pad_token_id=0)
    with torch.no_grad():
      out = self.model.generate_batch(inputs=[[int(t) for t in row] for row in ids],
                                      generation_config=gc, progress_bar=False,
                                      continuous_batching_config=self._cb_config(seed=seed))
    res = list(out.values())
    errors = [r.error for r in res if r.error is not None]
    if len(res) != ids.shape[0] or errors:
      raise RuntimeError(f"generate_batch returned {len(res)} of {ids.shape[0]} rows; "
                         f"errors: {errors[:3]}")
    lens = []
    for r in res:   # generated_tokens end with the EOS when the row stopped on it
      g = list(r.generated_tokens)
      lens.append(g.index(EOS_ID) + 1 if EOS_ID in g else len(g))
    return np.asarray(lens)


class _IdTokenizerEos(_IdTokenizer):
  def __init__(self, eos_id):
    self._eos = eos_id

  def eos_id(self):
    return self._eos


class TunixLong:
  """Tunix 0.1.7's `Sampler` on the SMALL_ARCH checkpoint (its own safetensors loader), all
  rows in one call, EOS_ID as its eos token."""
  name = "tunix"

  def __init__(self, path, *, max_len, eos: bool = True):
    from tunix.generate import sampler as tsampler
    from tunix.models.qwen3 import model as tmodel
    from tunix.models.qwen3 import params as tparams
    a = SMALL_ARCH
    cfg = tmodel.ModelConfig(
        num_layers=a["num_hidden_layers"], vocab_size=a["vocab_size"], embed_dim=a["hidden_size"],
        hidden_dim=a["intermediate_size"], num_heads=a["num_attention_heads"],
        head_dim=a["head_dim"], num_kv_heads=a["num_key_value_heads"], rope_theta=10_000,
        norm_eps=a["rms_norm_eps"], use_tied_embedding=False, dtype=jnp.float32,
        param_dtype=jnp.float32)
    model = tparams.create_model_from_safe_tensors(path, cfg, dtype=jnp.float32)
    self.eos = [EOS_ID] if eos else [-1]
    self.sampler = tsampler.Sampler(model, _IdTokenizerEos(self.eos[0]), tsampler.CacheConfig(
        cache_size=max_len, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim))

  def __call__(self, ids, n, seed):
    out = self.sampler([" ".join(map(str, row)) for row in ids], max_generation_steps=n,
                       max_prompt_length=ids.shape[1], temperature=1.0, top_p=1.0, top_k=None,
                       seed=seed, eos_tokens=self.eos)
    # tokens stop before the first EOS (or are all n generated): count the EOS as ours does
    return np.asarray([len(t) + 1 if len(t) < n else n for t in out.tokens])


def _probe_row(info: dict) -> dict:
  return dict(wall_s=info["wall_s"], other_cores=info["other_cores"],
              load_before=info["load_before"][0], contended=info["contended"])


def _versions(with_tunix: bool) -> dict:
  v = dict(jax=jax.__version__, torch=torch.__version__, transformers=transformers.__version__,
           torch_threads=torch.get_num_threads())
  if with_tunix:
    from importlib.metadata import PackageNotFoundError, version
    import tunix
    try:
      v["tunix"] = version("google-tunix")
    except PackageNotFoundError:
      v["tunix"] = getattr(tunix, "__version__", "?")
    v["tunix_imported_from"] = os.path.dirname(os.path.dirname(tunix.__file__))
  return v


# ------------------------------------------------------------------------------ (a) GRPO
def bench_grpo(path, *, groups, G, P, N, slot_sizes, repeats, rounds, with_tunix,
               with_cb=True, not_run: Optional[dict] = None, skip=()) -> dict:
  """not_run: contenders left out before the run, {name: why} (recorded as unavailable);
  skip: names not run at all (recorded under unavailable as skipped by flag).

  Warm-up: the contenders that compile (ours, Tunix) are warmed up with the full call (their
  programs depend on the shapes); transformers' `generate` and `generate_batch` compile
  nothing, so they warm up on 8 rows and 8 new tokens. repeats=0 (--grpo-repeats 0) is the
  cold protocol: no warm-up, each contender's one full first call (ours and Tunix compiling
  in it, transformers not) is its time: a ratio against transformers then charges ours its
  compilation."""
  ids = group_prompts(groups, G, P)
  B = groups * G
  supported = slots_supported()
  model = from_pretrained(path)
  factories = []
  if supported:
    factories += [(f"ours_slots{S}_g{G}", lambda S=S: OursLong(model, slots=S, group_size=G))
                  for S in slot_sizes]
    factories.append((f"ours_all_g{G}", lambda: OursLong(model, slots=0, group_size=G)))
  factories.append(("ours_all_g1", lambda: OursLong(model)))
  factories.append(("transformers", lambda: TransformersLong(path)))
  if with_cb:
    factories.append(("transformers_cb", lambda: TransformersCB(path)))
  if with_tunix:
    factories.append(("tunix", lambda: TunixLong(path, max_len=P + N)))
  contenders, unavailable, warm, cold = [], dict(not_run or {}), {}, {}
  for name in skip:
    unavailable[name] = "skipped (--grpo-skip)"
  factories = [(n, f) for n, f in factories if n not in skip]
  for name, make in factories:                 # build and warm up (compiles) each contender
    try:
      c = make()
      t0 = time.perf_counter()
      if repeats == 0:        # cold protocol (--grpo-repeats 0): one full call each, probed
        t, info, lens = hygiene.timed(c, ids, N, 1)
        cold[name] = dict(_probe_row(info), seed=1, tokens=int(np.sum(lens)),
                          max_length=int(np.max(lens)),
                          useful_tokens_per_s=round(float(np.sum(lens)) / t, 2),
                          lengths=np.asarray(lens).tolist())
      elif name.startswith("transformers"):
        lens = c(ids[:8], 8, 0)
      else:
        lens = c(ids, N, 0)
      warm[name] = dict(first_call_s=round(time.perf_counter() - t0, 2),
                        lengths=length_stats(lens, N))
      contenders.append(c)
      print(f"grpo warm-up {name}: {warm[name]['first_call_s']} s, lengths "
            f"{warm[name]['lengths']}", flush=True)
    except Exception as e:  # a contender that cannot run here is recorded, not fatal
      unavailable[name] = f"{type(e).__name__}: {e}"[:2000]
      print(f"grpo {name} unavailable: {unavailable[name][:300]}", flush=True)
  names = [c.name for c in contenders]
  slots_names = [n for n in names if n.startswith("ours_slots")]
  out_rounds = []
  for rnd in range(rounds):
    calls = {n: [] for n in names}
    if repeats == 0:          # cold: each contender's first call, compile included, is the time
      calls = {n: [cold[n]] for n in names}
    for rep in range(repeats):
      seed = 1000 * rnd + rep + 1           # the same seed for every contender in a repeat
      order = contenders[rep % len(contenders):] + contenders[:rep % len(contenders)]
      for c in order:
        t, info, lens = hygiene.timed(c, ids, N, seed)
        calls[c.name].append(dict(_probe_row(info), seed=seed, tokens=int(np.sum(lens)),
                                  max_length=int(np.max(lens)),
                                  useful_tokens_per_s=round(float(np.sum(lens)) / t, 2),
                                  lengths=np.asarray(lens).tolist()))
    per = {}
    for n, cs in calls.items():
      all_lens = np.concatenate([np.asarray(c["lengths"]) for c in cs])
      per[n] = dict(wall_s=round(statistics.median(c["wall_s"] for c in cs), 4),
                    tokens=int(statistics.median(c["tokens"] for c in cs)),
                    useful_tokens_per_s=round(statistics.median(
                        c["useful_tokens_per_s"] for c in cs), 2),
                    lengths=length_stats(all_lens, N))
    speedups = {s: {o: round(per[o]["wall_s"] / per[s]["wall_s"], 3) for o in names if o != s}
                for s in slots_names}
    best = min(slots_names, key=lambda s: per[s]["wall_s"]) if slots_names else None
    goals = {}
    if best:
      for o in names:
        if o == best or o.startswith("ours_slots"):
          continue
        need = GRPO_GOALS["ours_all" if o.startswith("ours_all") else o]
        got = speedups[best][o]
        goals[o] = dict(target=need, speedup=got,
                        met=bool(got > need) if need == 1.0 else bool(got >= need))
    contended = any(c["contended"] for cs in calls.values() for c in cs)
    out_rounds.append(dict(round=rnd, contended=contended, per_contender=per,
                           speedup_of_slots_over=speedups, best_slots=best,
                           goals_with_best_slots=goals,
                           max_other_cores=max(c["other_cores"] or 0 for cs in calls.values()
                                               for c in cs),
                           calls=calls))
    print(f"grpo round {rnd}: {'CONTENDED' if contended else 'quiet'} "
          + json.dumps({n: [p["wall_s"], p["useful_tokens_per_s"], p["lengths"]["mean"],
                            p["lengths"]["max"]] for n, p in per.items()})
          + " [wall s, useful tok/s, mean len, max len]; best slots "
          + json.dumps({best: speedups.get(best)} if best else None), flush=True)
  quiet = [r for r in out_rounds if not r["contended"]]
  results = {}
  if quiet:
    results = dict(
        quiet_rounds=len(quiet),
        wall_s={n: [r["per_contender"][n]["wall_s"] for r in quiet] for n in names},
        useful_tokens_per_s={n: [r["per_contender"][n]["useful_tokens_per_s"] for r in quiet]
                             for n in names},
        response_lengths={n: [r["per_contender"][n]["lengths"] for r in quiet] for n in names},
        speedup_of_slots_over={s: {o: [r["speedup_of_slots_over"][s][o] for r in quiet]
                                   for o in names if o != s} for s in slots_names},
        goals_with_best_slots=[r["goals_with_best_slots"] for r in quiet])
  return dict(workload=dict(rows=B, groups=groups, group_size=G, prompt=P, max_new_tokens=N,
                            slot_sizes=list(slot_sizes) if supported else []),
              slots_supported=supported, contenders=names, unavailable=unavailable,
              warmup=warm, repeats=repeats, goals=GRPO_GOALS, results=results,
              contended_rounds=[dict(round=r["round"], max_other_cores=r["max_other_cores"],
                                     speedup_of_slots_over=r["speedup_of_slots_over"])
                                for r in out_rounds if r["contended"]],
              rounds=out_rounds)


# ------------------------------------------------------------------------------ (c) curve
KV_BYTES_PER_SLOT = (SMALL_ARCH["num_hidden_layers"] * SMALL_ARCH["num_key_value_heads"]
                     * SMALL_ARCH["head_dim"] * 4 * 2)      # fp32 K and V, all layers


class _StepModel:
  """Predicts a contender's call seconds at (rows B, new tokens N) from its measured cells:
  ms/step at the same B fitted as a + b * (P + N) through its two longest cells (one cell:
  proportional to P + N, an upper bound); no cell at this B: the nearest smaller B's at the
  same N, scaled by rows. None when nothing applies (the first column is always run)."""

  def __init__(self, P):
    self.P, self.cells = P, {}    # (B, N) -> (ms/step, seconds of a call of N, contended)

  def add(self, B, N, ms, t, contended):
    self.cells[(B, N)] = (ms, t, contended)

  def predict(self, B, N) -> tuple[Optional[float], bool]:
    """(predicted seconds of one call or None, whether a cell it used was contended)."""
    same = sorted((n, v) for (b, n), v in self.cells.items() if b == B)
    C = self.P + N
    if len(same) >= 2:
      (n1, (m1, _, k1)), (n2, (m2, _, k2)) = same[-2], same[-1]
      c1, c2 = self.P + n1, self.P + n2
      b = max((m2 - m1) / (c2 - c1), 0.0)
      a = max(m2 - b * c2, 0.0)
      return N * (a + b * C) / 1e3, k1 or k2
    if len(same) == 1:
      n1, (m1, _, k1) = same[0]
      return N * m1 * C / (self.P + n1) / 1e3, k1
    smaller = [(b, v) for (b, n), v in self.cells.items() if n == N and b < B]
    if smaller:
      b, (_, t, k) = max(smaller)
      return t * B / b, k
    return None, False


def bench_curve(path, *, rows, new, P, repeats, max_product, max_cache_gb, max_call_s,
                max_call_s_transformers, budget_s, retries=1, with_transformers=True) -> dict:
  t_start = time.perf_counter()
  contenders = [OursLong(from_pretrained(path), eos=False)]
  contenders[0].name = "ours"
  if with_transformers:
    contenders.append(TransformersLong(path, eos=False))
  limits = {"ours": max_call_s, "transformers": max_call_s_transformers}
  models = {c.name: _StepModel(P) for c in contenders}
  warm_one = {}                               # (name, B) -> first call of 1 token, seconds
  cells, skipped = [], []
  for N in sorted(new):
    for B in sorted(rows):
      ids = group_prompts(B, 1, P, seed=B)
      run, reps, planned = [], repeats, 0.0    # planned: predicted seconds of this cell so far
      for c in contenders:
        pred, from_contended = models[c.name].predict(B, N)
        why = None
        if B * N > max_product:
          why = f"rows x new tokens = {B * N} > --curve-max-product {max_product}"
        elif B * (P + N) * KV_BYTES_PER_SLOT > max_cache_gb * 2**30:
          why = (f"KV cache {B * (P + N) * KV_BYTES_PER_SLOT / 2**30:.2f} GiB > "
                 f"--curve-max-cache-gb {max_cache_gb}")
        elif pred is not None and pred > limits[c.name]:
          why = f"predicted {pred:.1f} s per call > {limits[c.name]} s limit for {c.name}"
        elif pred is not None and (time.perf_counter() - t_start + planned
                                   + (2 + repeats) * pred > budget_s):
          why = (f"predicted cost {(2 + repeats) * pred:.0f} s would overrun "
                 f"--curve-budget-s {budget_s}")
        if why:
          if pred is not None and from_contended and why.startswith("predicted"):
            why += " (predicted from a contended cell)"
          skipped.append(dict(contender=c.name, rows=B, new_tokens=N, reason=why,
                              predicted_call_s=None if pred is None else round(pred, 2)))
          print(f"curve skip {c.name} rows {B} N {N}: {why}", flush=True)
        else:
          run.append(c)
          planned += (2 + repeats) * (pred or 0.0)
          if pred is not None and pred > 15:
            reps = min(reps, 2)
      if not run:
        continue
      first = {}
      for c in run:                             # compiles: N and (once per rows) 1 token
        if (c.name, B) not in warm_one:
          warm_one[(c.name, B)] = hygiene.timed(c, ids, 1, 0)[0]
        first[c.name] = hygiene.timed(c, ids, N, 0)[1]
      for attempt in range(1 + retries):
        calls = {c.name: {"N": [], "1": []} for c in run}
        for rep in range(reps):
          order = run[rep % len(run):] + run[:rep % len(run)]
          for c in order:
            for n, slot in ((N, "N"), (1, "1")):
              calls[c.name][slot].append(hygiene.timed(c, ids, n, rep + 1)[1])
        contended = any(i["contended"] for v in calls.values() for s in v.values() for i in s)
        if not contended or attempt == retries or time.perf_counter() - t_start > budget_s:
          break
        print(f"curve rows {B} N {N}: contended, retrying", flush=True)
      cell = dict(rows=B, new_tokens=N, repeats=reps, contended=contended, attempts=attempt + 1,
                  kv_cache_gib=round(B * (P + N) * KV_BYTES_PER_SLOT / 2**30, 3), contenders={})
      for c in run:
        tN = statistics.median(i["wall_s"] for i in calls[c.name]["N"])
        t1 = statistics.median(i["wall_s"] for i in calls[c.name]["1"])
        r = rates(tN, t1, B, N)
        r.update(first_call_s=first[c.name]["wall_s"],
                 compile_s=round(first[c.name]["wall_s"] - tN, 3),
                 first_call_1_token_s=round(warm_one[(c.name, B)], 4),
                 first_call_contended=first[c.name]["contended"],
                 calls={s: [_probe_row(i) for i in v] for s, v in calls[c.name].items()})
        cell["contenders"][c.name] = r
        models[c.name].add(B, N, r["decode_ms_per_step"], tN, contended)
      if len(run) == 2:
        cell["ours_over_transformers_decode_speed"] = round(
            cell["contenders"]["transformers"]["decode_ms_per_step"]
            / max(cell["contenders"]["ours"]["decode_ms_per_step"], 1e-9), 3)
      cells.append(cell)
      print(f"curve rows {B} N {N}: {'CONTENDED' if contended else 'quiet'} "
            + json.dumps({n: [v["decode_ms_per_step"], v["compile_s"], v["seconds_n_tokens"]]
                          for n, v in cell["contenders"].items()})
            + " [ms/step, compile s, s per call]", flush=True)
  quiet = [c for c in cells if not c["contended"]]
  table = {}
  for c in quiet:
    for name, v in c["contenders"].items():
      table.setdefault(name, {}).setdefault(str(c["rows"]), {})[str(c["new_tokens"])] = dict(
          ms_per_step=v["decode_ms_per_step"], compile_s=v["compile_s"],
          first_call_s=v["first_call_s"], warm_call_s=v["seconds_n_tokens"])
  return dict(grid=dict(rows=sorted(rows), new_tokens=sorted(new), prompt=P), repeats=repeats,
              limits=dict(max_product=max_product, max_cache_gb=max_cache_gb,
                          max_call_s=limits, budget_s=budget_s, retries=retries),
              compile_s_method=("first call of N tokens minus the median warm call of N tokens "
                                "(for ours: tracing + XLA compilation of the (rows, N) program, "
                                "jax persistent cache dir: "
                                f"{jax.config.jax_compilation_cache_dir!r}; for transformers, "
                                "which does not compile: first-call overhead)"),
              results=table,
              speed_ours_over_transformers={f"{c['rows']}x{c['new_tokens']}":
                                            c["ours_over_transformers_decode_speed"]
                                            for c in quiet
                                            if "ours_over_transformers_decode_speed" in c},
              contended_cells=[dict(rows=c["rows"], new_tokens=c["new_tokens"],
                                    max_other_cores=max(i["other_cores"] or 0
                                                        for v in c["contenders"].values()
                                                        for s in v["calls"].values() for i in s))
                               for c in cells if c["contended"]],
              skipped=skipped, cells=cells,
              elapsed_s=round(time.perf_counter() - t_start, 1))


def run_grpo(args, start, with_tunix):
  q = args.quick
  groups, G, P = (8, 8, 32) if q else (32, 8, 32)
  N, mean = (256, 40.0) if q else (1024, 137.0)
  slot_sizes = args.grpo_slots or ((16, 32) if q else (32, 64, 128))
  repeats = args.grpo_repeats if args.grpo_repeats is not None else (2 if q else 3)
  with tempfile.TemporaryDirectory() as tmp:
    ckpt = write_small_checkpoint(tmp, eos_mean=mean)
    not_run = {}
    if args.no_cb:
      not_run["transformers_cb"] = "--no-cb"
    if not with_tunix:
      not_run["tunix"] = "--no-tunix" if args.no_tunix else (
          f"not importable ({tunix_import_error()}); see --tunix-path")
    r = bench_grpo(tmp, groups=groups, G=G, P=P, N=N, slot_sizes=slot_sizes, repeats=repeats,
                   rounds=args.rounds or 1, with_tunix=with_tunix, with_cb=not args.no_cb,
                   not_run=not_run, skip=tuple(args.grpo_skip))
  result = dict(quick=q, checkpoint=ckpt, machine=dict(hygiene.machine(), **_versions(with_tunix)),
                start=start, other_cores_limit=hygiene.OTHER_CORES_LIMIT, **r)
  print(json.dumps(dict(slots_supported=r["slots_supported"], unavailable=r["unavailable"],
                        results=r["results"]), indent=1))
  hygiene.write_json(result, args.out or os.path.join(RESULTS, "rollout_grpo.json"))


def run_curve(args, start):
  q = args.quick
  rows = args.curve_rows or ((8, 32) if q else (8, 32, 128, 256))
  new = args.curve_new or ((128, 512) if q else (128, 512, 1024, 2048, 4096, 8192))
  with tempfile.TemporaryDirectory() as tmp:
    ckpt = write_small_checkpoint(tmp)
    r = bench_curve(tmp, rows=rows, new=new, P=32, repeats=args.curve_repeats or (2 if q else 3),
                    max_product=args.curve_max_product, max_cache_gb=args.curve_max_cache_gb,
                    max_call_s=args.curve_max_call_s,
                    max_call_s_transformers=args.curve_max_call_s_transformers,
                    budget_s=args.curve_budget_s, retries=0 if q else 1)
  result = dict(quick=q, checkpoint=ckpt, machine=dict(hygiene.machine(), **_versions(False)),
                start=start, other_cores_limit=hygiene.OTHER_CORES_LIMIT, **r)
  print(json.dumps(dict(results=r["results"], speed_ours_over_transformers=r[
      "speed_ours_over_transformers"], skipped=len(r["skipped"]),
      contended_cells=r["contended_cells"]), indent=1))
  hygiene.write_json(result, args.out or os.path.join(RESULTS, "rollout_curve.json"))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true",
                  help="fixed shape: 32 new tokens, 2 repeats; --grpo / --curve: their smoke runs")
  ap.add_argument("--rounds", type=int, default=None,
                  help="rounds (default 2; --grpo: 1)")
  ap.add_argument("--dtypes", nargs="+", default=list(DTYPES))
  ap.add_argument("--no-tunix", action="store_true", help="skip Tunix even if installed")
  ap.add_argument("--tunix-path", default=os.environ.get("TRM_BENCH_TUNIX_PATH"),
                  help="directory to import Tunix from (prepended to sys.path)")
  ap.add_argument("--no-snapkv", action="store_true")
  ap.add_argument("--wait-quiet", type=float, default=0.0,
                  help="seconds to wait at most for a 1-minute load below 0.5 before starting")
  ap.add_argument("--out", default=None, help="output JSON (default: by mode, in bench/results)")
  g = ap.add_argument_group("long-horizon modes")
  g.add_argument("--grpo", action="store_true", help="GRPO-shaped EOS workload, rollout_grpo.json")
  g.add_argument("--grpo-slots", type=int, nargs="+", default=None,
                 help="slot counts S of ours with continuous batching (default 32 64 128)")
  g.add_argument("--grpo-repeats", type=int, default=None, help="default 3 (quick: 2)")
  g.add_argument("--no-cb", action="store_true", help="skip transformers' generate_batch")
  g.add_argument("--grpo-skip", nargs="+", default=(),
                 help="contenders not to run (e.g. ours_all_g1)")
  g.add_argument("--curve", action="store_true",
                 help="ms/step and compile s vs rows and new tokens, rollout_curve.json")
  g.add_argument("--curve-rows", type=int, nargs="+", default=None)
  g.add_argument("--curve-new", type=int, nargs="+", default=None)
  g.add_argument("--curve-repeats", type=int, default=None, help="default 3 (quick: 2)")
  g.add_argument("--curve-max-product", type=int, default=256 * 1024,
                 help="skip cells with rows x new tokens above this")
  g.add_argument("--curve-max-cache-gb", type=float, default=3.0,
                 help="skip cells whose fp32 KV cache would exceed this many GiB")
  g.add_argument("--curve-max-call-s", type=float, default=45.0,
                 help="skip ours where one call is predicted to take longer")
  g.add_argument("--curve-max-call-s-transformers", type=float, default=30.0,
                 help="skip transformers where one call is predicted to take longer")
  g.add_argument("--curve-budget-s", type=float, default=1320.0,
                 help="skip cells that would end the curve's measurements after this")
  args = ap.parse_args(argv)
  if args.tunix_path:
    sys.path.insert(0, args.tunix_path)
  if args.grpo and args.curve and args.out:
    ap.error("--out names one file: give --grpo and --curve separately")
  q = args.quick
  start = hygiene.wait_for_quiet(timeout_s=args.wait_quiet)
  with_tunix = not args.no_tunix and tunix_available()
  if args.grpo or args.curve:
    if args.grpo:
      run_grpo(args, start, with_tunix)
    if args.curve:
      run_curve(args, start)
    return
  rounds = args.rounds or 2
  N = 32 if q else 128
  with tempfile.TemporaryDirectory() as tmp:
    path = write_checkpoint(tmp)
    by_dtype = {d: bench_dtype(path, d, B=8, P=128, N=N, repeats=2 if q else 3,
                               rounds=rounds, with_tunix=with_tunix) for d in args.dtypes}
    snap = (dict(rounds=[], cache_bytes_ratio=None) if args.no_snapkv else
            bench_snapkv(path, B=2, P=1024 if q else 2048, N=N, repeats=3 if q else 5,
                         rounds=rounds))
  versions = dict(jax=jax.__version__, torch=torch.__version__,
                  transformers=transformers.__version__, torch_threads=torch.get_num_threads())
  if with_tunix:
    from importlib.metadata import version
    versions["tunix"] = version("google-tunix")
  result = dict(quick=q, checkpoint=dict(ARCH, model_type="qwen3"),
                machine=dict(hygiene.machine(), **versions), start=start,
                other_cores_limit=hygiene.OTHER_CORES_LIMIT,
                **summarize(by_dtype, snap), by_dtype=by_dtype, snapkv_long_prompt=snap)
  print(json.dumps(result["results"], indent=1))
  hygiene.write_json(result, args.out or os.path.join(RESULTS, "rollout.json"))


if __name__ == "__main__":
  main()
