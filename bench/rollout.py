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
under `results`. Only same-run ratios mean anything: the CPU model changes between sessions.

The SnapKV comparison (prompt 2048, batch 2, 50% of the prompt kept) times the decode loop
alone (`run_phase("decode")`), since the prefill is identical for both and several times longer.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

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
  try:
    import tunix.generate.sampler  # noqa: F401
    return True
  except Exception:  # any import failure means "not installed beside this jax": skip it
    return False


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


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="32 new tokens, 2 repeats")
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--dtypes", nargs="+", default=list(DTYPES))
  ap.add_argument("--no-tunix", action="store_true", help="skip Tunix even if installed")
  ap.add_argument("--no-snapkv", action="store_true")
  ap.add_argument("--wait-quiet", type=float, default=0.0,
                  help="seconds to wait at most for a 1-minute load below 0.5 before starting")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                "rollout.json"))
  args = ap.parse_args(argv)
  q = args.quick
  start = hygiene.wait_for_quiet(timeout_s=args.wait_quiet)
  with_tunix = not args.no_tunix and tunix_available()
  N = 32 if q else 128
  with tempfile.TemporaryDirectory() as tmp:
    path = write_checkpoint(tmp)
    by_dtype = {d: bench_dtype(path, d, B=8, P=128, N=N, repeats=2 if q else 3,
                               rounds=args.rounds, with_tunix=with_tunix) for d in args.dtypes}
    snap = (dict(rounds=[], cache_bytes_ratio=None) if args.no_snapkv else
            bench_snapkv(path, B=2, P=1024 if q else 2048, N=N, repeats=3 if q else 5,
                         rounds=args.rounds))
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
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print("wrote", args.out)


if __name__ == "__main__":
  main()
