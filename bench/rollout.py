"""Rollout throughput: our sampler vs transformers `generate`, and SnapKV vs dense at long prompts.

  python -m bench.rollout            # full run, writes bench/results/rollout.json
  python -m bench.rollout --quick    # fewer tokens / repeats, a shorter long prompt

One random Qwen3 checkpoint is written by transformers' `save_pretrained` and loaded by both
sides, so both run the same weights. Measurements are interleaved (ours, theirs, ours, ...) and
the median is reported, because this machine is shared (best-of-repeats is recorded too).

Decode tokens/s = B * (N - 1) / (time(N new tokens) - time(1 new token)): the prefill and the
first sampled token cost the same in both runs and cancel, leaving the cached decode steps.
End-to-end tokens/s (B * N / time(N)) is reported too. Sampling is plain temperature-1
sampling on both sides, no EOS (every row generates N tokens). The long-prompt SnapKV
comparison times the decode loop alone (see `bench_snapkv`).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
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

from trm_jax.models import from_pretrained  # noqa: E402
from trm_jax.rollout import CacheConfig, SamplingConfig, generate, run_phase  # noqa: E402

ARCH = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-6,
            max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=None,
            eos_token_id=None, pad_token_id=0)


def write_checkpoint(path: str) -> str:
  torch.manual_seed(0)
  model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**ARCH)).eval()
  model.save_pretrained(path)
  return path


def prompts(B: int, P: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(1, ARCH["vocab_size"], (B, P)).astype(np.int32)


def time_ours(model, ids, n_new, cache, seed):
  lens = np.full((ids.shape[0],), ids.shape[1], np.int32)
  t0 = time.perf_counter()
  r = generate(model, ids, lens, max_new_tokens=n_new, key=jax.random.key(seed), eos_ids=(),
               cache=cache)
  jax.block_until_ready(r.tokens)
  return time.perf_counter() - t0, r


def time_hf(model, ids, n_new):
  x = torch.as_tensor(np.array(ids), dtype=torch.long)
  t0 = time.perf_counter()
  with torch.no_grad():
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=True,
                         temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=n_new,
                         min_new_tokens=n_new, pad_token_id=0)
  dt = time.perf_counter() - t0
  assert out.shape[1] == ids.shape[1] + n_new
  return dt


def rates(t_full, t_one, B, N):
  return dict(decode_tokens_per_s=B * (N - 1) / max(t_full - t_one, 1e-9),
              end_to_end_tokens_per_s=B * N / t_full, seconds_n_tokens=t_full,
              seconds_1_token=t_one)


def bench_vs_hf(path, B, P, N, repeats):
  ours_model = from_pretrained(path)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  ids = prompts(B, P)
  for n in (1, N):                                       # compile both programs, warm torch
    time_ours(ours_model, ids, n, CacheConfig(), 0)
  time_hf(hf_model, ids, 2)
  t = {k: [] for k in ("ours_1", "ours_N", "hf_1", "hf_N")}
  for rep in range(repeats):
    t["ours_1"].append(time_ours(ours_model, ids, 1, CacheConfig(), rep)[0])
    t["hf_1"].append(time_hf(hf_model, ids, 1))
    t["ours_N"].append(time_ours(ours_model, ids, N, CacheConfig(), rep)[0])
    t["hf_N"].append(time_hf(hf_model, ids, N))
  med = {k: statistics.median(v) for k, v in t.items()}
  ours = rates(med["ours_N"], med["ours_1"], B, N)
  hf = rates(med["hf_N"], med["hf_1"], B, N)
  return dict(batch=B, prompt=P, new_tokens=N, repeats=repeats, ours=ours, transformers=hf,
              decode_speedup=ours["decode_tokens_per_s"] / hf["decode_tokens_per_s"],
              target_decode_speedup=2.0, raw_seconds=t)


def bench_snapkv(path, B, P, N, repeats):
  """Dense vs 50% SnapKV at a long prompt: the decode loop timed on its own (`run_phase`),
  because here the prefill (identical for both) is several times the decode time and its
  run-to-run noise on a shared machine would swamp a difference of two totals."""
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
  t = {name: [] for name in configs}
  for rep in range(repeats):
    for name, cc in configs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(run_phase("decode", graphdef, state, ids, lens, key=jax.random.key(0),
                                      sampling_config=scfg, cache_config=cc,
                                      carry=carries[name]).tokens)
      t[name].append(time.perf_counter() - t0)
  out = dict(batch=B, prompt=P, new_tokens=N, repeats=repeats, decode_seconds=t)
  for name in configs:
    out[name] = dict(info[name], decode_tokens_per_s=B * (N - 1) / statistics.median(t[name]),
                     decode_tokens_per_s_best=B * (N - 1) / min(t[name]))
  out["cache_bytes_ratio"] = info["snapkv_50"]["cache_bytes"] / info["dense"]["cache_bytes"]
  out["target_cache_bytes_ratio"] = 0.55
  out["decode_speed_ratio"] = (out["snapkv_50"]["decode_tokens_per_s"]
                               / out["dense"]["decode_tokens_per_s"])
  out["target_decode_speed_ratio"] = 1.0
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                "rollout.json"))
  args = ap.parse_args()
  q = args.quick
  with tempfile.TemporaryDirectory() as tmp:
    path = write_checkpoint(tmp)
    vs_hf = bench_vs_hf(path, B=8, P=128, N=32 if q else 128, repeats=2 if q else 3)
    print(json.dumps({k: vs_hf[k] for k in ("ours", "transformers", "decode_speedup")},
                     indent=1), flush=True)
    long = bench_snapkv(path, B=2, P=1024 if q else 2048, N=32 if q else 128,
                        repeats=5 if q else 7)
    print(json.dumps({k: long[k] for k in ("cache_bytes_ratio", "decode_speed_ratio")},
                     indent=1), flush=True)
  result = dict(
      quick=q, checkpoint=dict(ARCH, model_type="qwen3"),
      machine=dict(platform=platform.platform(), cpus=os.cpu_count(),
                   jax=jax.__version__, torch=torch.__version__,
                   transformers=transformers.__version__,
                   torch_threads=torch.get_num_threads(),
                   load_average=os.getloadavg()),
      ours_vs_transformers=vs_hf, snapkv_long_prompt=long)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print("wrote", args.out)


if __name__ == "__main__":
  main()
