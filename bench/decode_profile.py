"""Where the sampler's decode step spends its time: a per-op profile of the decode loop.

  python -m bench.decode_profile [--dtypes float32 bfloat16] [--out bench/results/decode_profile.json]

Runs `run_phase("decode")` of the bench model (Qwen3 shape of bench/rollout.py: 4 layers, d 512,
8/4 heads, vocab 32000; batch 8, prompt 128, 128 new tokens, temperature 1, dense cache) once
under `jax.profiler`, then sums each XLA thunk's time over the trace and divides by the number
of decode steps. Each compiled op (a fusion, a library dot, a loop) is put in one category from
the HLO op names it was built from (the sampler's `jax.named_scope`s, else the einsum and
`jax.random` names), so the JSON says how many milliseconds of each step went to the vocabulary
projection, sampling, the PRNG, the layers' matmuls, attention, cache writes and the rest.

Op times are thread time of each thunk (XLA's CPU runtime runs independent thunks
concurrently on its two threads, so the sum can exceed the wall time of a step); the wall
time per step is recorded beside them. The load and the CPU time other processes used during
the profiled call are recorded too (`bench.hygiene`): a profile taken on a busy machine says
where the time goes but not how long a step takes.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench import hygiene, xla_profile  # noqa: E402
from trm_jax.models import Decoder, ModelConfig  # noqa: E402
from trm_jax.rollout import CacheConfig, SamplingConfig, run_phase  # noqa: E402
from trm_jax.rollout import sampler as sampler_lib  # noqa: E402

BENCH_MODEL = dict(model_type="qwen3", vocab_size=32000, hidden_size=512, intermediate_size=1536,
                   num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64)

# (category, patterns on the op names inside the compiled op); first match wins. The sampler's
# named scopes come first; the einsum / jax.random names cover code without them.
CATEGORIES = (
    ("prng", (r"threefry", r"_uniform", r"random_bits", r"_gumbel", r"/rng", r"logit_noise")),
    ("lm_head", (r"unembed", r"\.\.\.D,DV", r"\.\.\.D,VD")),
    ("sampling", (r"/sample\b", r"/sample/", r"log_softmax", r"entropy", r"categorical",
                  r"cumsum", r"/record")),
    ("attention", (r"/attend", r"BKGH,BKCH", r"BKGC,BKCH", r"BKGH,BKHC")),
    ("cache_write", (r"/cache_write", r"dynamic_update_slice", r"scatter")),
    ("attn_proj", (r"DNH", r"DKH", r"NHD", r"BTE,ED")),
    ("mlp", (r"DF->", r"FD->", r"/mlp")),
    ("norm_rope", (r"rsqrt", r"/norm", r"/rope", r"split", r"cos", r"sin")),
)


def bench_model(dtype: str) -> Decoder:
  return Decoder(ModelConfig(**BENCH_MODEL, dtype=dtype, param_dtype=dtype), rngs=nnx.Rngs(0))


def categorize(names, shape: str, V: int) -> str:
  text = " ".join(names)
  for cat, pats in CATEGORIES:
    if any(re.search(p, text) for p in pats):
      return cat
  if re.match(r"\(?s32\[\]", shape) or not names:
    return "loop_and_other"
  if f",{V}]" in shape:
    return "sampling"
  return "loop_and_other"


def profile(dtype: str, *, B: int = 8, P: int = 128, N: int = 128, cache=CacheConfig(),
            top: int = 25) -> dict:
  model = bench_model(dtype)
  graphdef, state = nnx.split(model)
  ids = jnp.asarray(np.random.default_rng(0).integers(1, BENCH_MODEL["vocab_size"], (B, P)),
                    jnp.int32)
  lens = jnp.full((B,), P, jnp.int32)
  scfg = SamplingConfig(max_new_tokens=N, eos_ids=())
  kw = dict(key=jax.random.key(0), sampling_config=scfg, cache_config=cache)
  carry = jax.block_until_ready(run_phase("prefill", graphdef, state, ids, lens, **kw))
  jax.block_until_ready(run_phase("decode", graphdef, state, ids, lens, carry=carry, **kw).tokens)
  hlo = sampler_lib._decode_jit.lower(  # pylint: disable=protected-access
      graphdef, state, ids, lens, kw["key"], carry, scfg=scfg, ccfg=cache,
      bcfg=sampler_lib.BatchingConfig(), attn_impl="auto").compile().as_text()
  names = xla_profile.op_table(hlo)
  prof = xla_profile.thunk_times(lambda: jax.block_until_ready(run_phase(
      "decode", graphdef, state, ids, lens, carry=carry, **kw).tokens), names)
  wall, per_op, count = prof["wall_s"], prof["us"], prof["calls"]
  steps = N - 1
  cats = collections.Counter()
  V = BENCH_MODEL["vocab_size"]
  for op, us in per_op.items():
    cats[categorize(*names[op], V)] += us
  ms = lambda us: round(us / 1e3 / steps, 3)
  return dict(
      dtype=dtype, batch=B, prompt=P, new_tokens=N, cache_policy=cache.policy,
      wall_ms_per_step=round(wall / steps * 1e3, 3),
      summed_op_ms_per_step=ms(sum(per_op.values())),
      ms_per_step_by_category={k: ms(v) for k, v in cats.most_common()},
      top_ops=[dict(op=op, ms_per_step=ms(us), calls=count[op], shape=names[op][1][:60],
                    category=categorize(*names[op], V),
                    op_names=sorted(set(n.split("/")[-1] for n in names[op][0]))[:6])
               for op, us in per_op.most_common(top)],
      contention=prof["contention"])


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  ap.add_argument("--label", default="current", help="key under which the profile is stored")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                "decode_profile.json"))
  args = ap.parse_args(argv)
  result = {}
  if os.path.exists(args.out):
    with open(args.out) as f:
      result = json.load(f)
  result[args.label] = dict(machine=hygiene.machine(), profiles=[profile(d) for d in args.dtypes])
  for p in result[args.label]["profiles"]:
    print(p["dtype"], "wall", p["wall_ms_per_step"], "ms/step", p["ms_per_step_by_category"],
          "contended" if p["contention"]["contended"] else "quiet", flush=True)
  hygiene.write_json(result, args.out)


if __name__ == "__main__":
  main()
