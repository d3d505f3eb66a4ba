"""tokamax's Pallas-Triton attention as a candidate GPU path for our visibility predicate.

Our predicate (`trm_jax/kernels/visibility.py`): query i sees key j iff j <= i,
seg[b, j] == seg[b, i] != 0 and i < evicted_at[b, k, j], with evicted_at per (batch, kv head,
key). tokamax (`PallasTritonFlashAttention`; not a dependency of this project) has no segment
ids, and its public `dot_product_attention` has no per-key argument; the op takes a `Mask`
(a private class, `tokamax._src.ops.attention.base.Mask`) with `is_causal`, per-query
`k_start` / `k_end` and per-key `q_start` / `q_end`, each broadcastable against
[B, N (query heads), T]. The closest translation, used here:

  is_causal=True;
  k_start[b, 0, i] = first index of the run of seg[b] containing i (segments must be
                     contiguous runs), i + 1 for padding queries (seg == 0: they see nothing);
  q_end[b, n, j]   = evicted_at[b, n // G, j]  (the kv-head record repeated over its G query
                     heads; evicted_at as it is, [B, K, T], see `api.q_end_kv_head_axis`).

`mask_translation_exact` checks it against `visible_mask` on the dense level. What the kernels
then receive is read off the module lowered for cuda: tensors [..., T, T] of i1 are a
materialised [T, S] mask (`cuda_export.*.dense_mask_tensors`).

Interpret mode. tokamax has no interpret switch for its Triton attention. With `interpret=True`
(the HLO interpreter our impl="pallas_interpret" uses) it does not lower on CPU: it calls
`pl.program_id` inside loop bodies, which that interpreter only substitutes at the
kernel's top level (`api.hlo_interpreter`). It does run through the Mosaic TPU interpreter
(`pltpu.InterpretParams`, with TPU compiler params swapped in), but jax.vjp through tokamax's
`custom_vjp(optimize_remat=True)` rejects that interpreter's io callbacks
(`api.tpu_interpreter_custom_vjp`); forward + backward are therefore composed as
`op(..., return_residuals=True)` then `op.vjp(...)` (what that custom_vjp's backward calls).
Both go through a patch of `jax.experimental.pallas.pallas_call` while tracing; our kernel is
run through the same TPU interpreter too, for a like-for-like time. Sections:

  errors       max |x - reference| of outputs and dq, dk, dv (fp32); reference =
               attention(impl="reference"). Outputs: valid rows and padding rows apart (the
               reference gives 0 on rows that see no key). Gradients: with the cotangent zeroed
               on padding rows (what a masked loss sends) and with a dense random cotangent.
  timing       wall s of jit(forward + backward), interleaved (the order rotates per round),
               median of --reps calls after a warm-up call each, every call through
               `bench.hygiene.Probe`; interpreter times, not GPU times.
  cuda_export  `jax.export` of forward + backward (jax.vjp, tokamax's own custom_vjp) for
               platform "cuda" on this CPU machine, Triton custom calls allowed via
               DisabledSafetyCheck as tests/test_kernels.py does for our kernel (jax 0.11's
               Triton lowering also wants an abstract GPU device, retried with an abstract
               mesh naming an H100): lowers or not, number of Triton custom calls, dense
               [T, T] mask tensors, warnings.

Results are merged into --out under runs["tokamax-<v>_jax-<v>"], so runs from different venvs
(tokamax 0.0.17 needs jax >= 0.11.1 and Python >= 3.12) sit side by side.

  python -m bench.tokamax_attention [--out bench/results/tokamax_attention.json]

Skips (exit 0, nothing written) when tokamax is not importable.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import platform
import re
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bench.hygiene import Probe, machine
from trm_jax.kernels.attention import attention
from trm_jax.kernels.visibility import NEVER_EVICTED, LayerVisibility, visible_mask

try:
  import tokamax
  from tokamax._src.ops.attention import base as tk_base
  from tokamax._src.ops.attention import pallas_triton as tk_triton
  _TOKAMAX_ERROR = None
except Exception as e:  # pylint: disable=broad-except
  tokamax = None
  _TOKAMAX_ERROR = f"{type(e).__name__}: {e}"

_TRITON_TARGET = "__gpu$xla.gpu.triton"
_MESH_AXIS = "abstract_gpu"


# --------------------------------------------------------------------------------------------
# Inputs and the translation of our visibility into a tokamax Mask.
# --------------------------------------------------------------------------------------------


def make_inputs(B: int, T: int, N: int, K: int, H: int, seed: int = 0) -> dict:
  """q, k, v, two cotangents, segment ids and a per-kv-head eviction record (numpy).

  Even rows: two packed sequences then right padding; odd rows: one left-padded sequence.
  evicted_at mixes what the rollout engine writes: never evicted, dropped after the prompt
  (SnapKV), evicted at a later decode step in (j, T], evicted right after creation (j + 1);
  drawn independently per kv head. No key is evicted at its own step, so every valid query
  sees at least itself.
  """
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, N, H)).astype(np.float32)
  k = rng.standard_normal((B, T, K, H)).astype(np.float32)
  v = rng.standard_normal((B, T, K, H)).astype(np.float32)
  do = rng.standard_normal((B, T, N, H)).astype(np.float32)
  seg = np.zeros((B, T), np.int32)
  for b in range(B):
    if b % 2 == 0:
      seg[b, : T // 2] = 1
      seg[b, T // 2: T - T // 8] = 2
    else:
      seg[b, T // 4:] = 1
  prompt_len = T // 4
  j = np.broadcast_to(np.arange(T), (B, K, T))
  kind = rng.integers(0, 4, size=(B, K, T))
  later = j + 1 + (rng.random((B, K, T)) * (T - j)).astype(np.int64)
  ev = np.select(
      [kind == 0, kind == 1, kind == 2],
      [np.full_like(j, NEVER_EVICTED),
       np.where(j < prompt_len, prompt_len, NEVER_EVICTED),
       later],
      j + 1).astype(np.int32)
  valid = seg != 0
  return dict(q=q, k=k, v=v, do_full=do, do_masked=do * valid[:, :, None, None],
              seg=seg, ev=ev, valid=valid)


def _segment_starts(seg: jax.Array) -> jax.Array:
  """[B, T] first index of the run of equal ids containing each position."""
  idx = jnp.arange(seg.shape[-1], dtype=jnp.int32)
  boundary = jnp.concatenate(
      [jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  return jax.lax.cummax(jnp.where(boundary, idx, 0), axis=1)


def tokamax_mask(seg: jax.Array, ev: jax.Array, N: int):
  """Our LayerVisibility as a tokamax Mask (see the module docstring); seg runs contiguous."""
  G = N // ev.shape[1]
  idx = jnp.arange(seg.shape[-1], dtype=jnp.int32)
  k_start = jnp.where(seg != 0, _segment_starts(seg), idx + 1)[:, None, :]   # [B, 1, T]
  q_end = jnp.repeat(ev, G, axis=1)                                          # [B, N, T]
  return tk_base.Mask(is_causal=True, k_start=k_start, q_end=q_end)


def segments_contiguous(seg: np.ndarray) -> bool:
  """Every non-zero id occupies one run per row (what the k_start translation needs)."""
  for row in seg:
    ids = row[np.r_[True, row[1:] != row[:-1]]]
    ids = ids[ids != 0]
    if len(ids) != len(set(ids.tolist())):
      return False
  return True


# --------------------------------------------------------------------------------------------
# Interpreters and the functions compared: (q, k, v, do, seg, ev) -> (out, dq, dk, dv).
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _interpreted(**overrides):
  """Every pallas_call traced inside gets `overrides` (interpret mode, compiler params)."""
  orig = pl.pallas_call

  def patched(*args, **kwargs):
    return orig(*args, **{**kwargs, **overrides})

  pl.pallas_call = patched
  try:
    with tokamax.config.cross_compile(True):
      yield
  finally:
    pl.pallas_call = orig


def tpu_interpreter():
  """Every pallas_call traced inside runs through the Mosaic TPU interpreter on CPU."""
  return _interpreted(interpret=pltpu.InterpretParams(), compiler_params=pltpu.CompilerParams())


def hlo_interpreter():
  """Every pallas_call traced inside gets interpret=True (the HLO interpreter)."""
  return _interpreted(interpret=True)


def inside(ctx, f):
  """f called inside ctx() (tracing happens on the first call; the context may key jit)."""
  def g(*args):
    with ctx():
      return f(*args)
  return g


def ours(impl: str):
  def f(q, k, v, do, seg, ev):
    out, pull = jax.vjp(lambda q, k, v: attention(q, k, v, LayerVisibility(seg, ev), impl=impl),
                        q, k, v)
    return (out, *pull(do))
  return f


def tokamax_custom_vjp(causal_only: bool = False):
  """Forward + backward the way a user gets them: jax.vjp through tokamax's custom_vjp."""
  op = tk_triton.PallasTritonFlashAttention()

  def f(q, k, v, do, seg, ev):
    if causal_only:
      attend = lambda q, k, v: op(q, k, v, is_causal=True)
    else:
      mask = tokamax_mask(seg, ev, q.shape[2])
      attend = lambda q, k, v: op(q, k, v, mask=mask)
    out, pull = jax.vjp(attend, q, k, v)
    return (out, *pull(do))
  return f


def tokamax_manual_vjp():
  """The forward with residuals, then tokamax's VJP op: what its custom_vjp calls."""
  op = tk_triton.PallasTritonFlashAttention()

  def f(q, k, v, do, seg, ev):
    mask = tokamax_mask(seg, ev, q.shape[2])
    bound = op.bind(q, k, v, mask=mask)
    out, residuals = op(q, k, v, mask=mask, return_residuals=True)
    kwargs = dict(bound.kwargs)
    kwargs.pop("return_residuals", None)
    grads = op.vjp(residuals, out, do, *bound.args, **kwargs)
    return out, grads["q"], grads["k"], grads["v"]
  return f


def _err(a, b, rows=None) -> float:
  d = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
  if rows is not None:
    d = d[rows]
  return float(d.max()) if d.size else 0.0


def errors(name: str, f, ref: dict, x: dict) -> dict:
  """Errors of the jitted fwd+bwd `f` against the reference results `ref`."""
  valid = x["valid"]
  args = [x[n] for n in ("q", "k", "v")]
  m = jax.device_get(f(*args, x["do_masked"], x["seg"], x["ev"]))
  d = jax.device_get(f(*args, x["do_full"], x["seg"], x["ev"]))
  r_m, r_f = ref["masked"], ref["full"]
  res = {
      "out_valid_rows": _err(m[0], r_m[0], valid),
      "out_padding_rows_max_abs": _err(m[0], r_m[0], ~valid),
      "cotangent_masked_on_padding": {
          "dq": _err(m[1], r_m[1]), "dk": _err(m[2], r_m[2]), "dv": _err(m[3], r_m[3])},
      "cotangent_dense": {
          "dq_valid_rows": _err(d[1], r_f[1], valid), "dq": _err(d[1], r_f[1]),
          "dk": _err(d[2], r_f[2]), "dv": _err(d[3], r_f[3])},
      "finite": bool(all(np.isfinite(a).all() for a in (*m, *d))),
  }
  print(f"{name:30s} out {res['out_valid_rows']:.2e} (padding rows "
        f"{res['out_padding_rows_max_abs']:.2e}); dq dk dv, masked cotangent "
        + " ".join(f"{v:.2e}" for v in res["cotangent_masked_on_padding"].values())
        + "; dense cotangent "
        + " ".join(f"{v:.2e}" for k, v in res["cotangent_dense"].items() if k != "dq_valid_rows"),
        flush=True)
  return res


def _first_line_error(e: Exception, limit: int = 400) -> str:
  lines = [l for l in str(e).splitlines() if l.strip()]
  return f"{type(e).__name__}: {(lines[0] if lines else '')[:limit]}"


# --------------------------------------------------------------------------------------------
# API facts checked by calling it.
# --------------------------------------------------------------------------------------------


def api_facts(x: dict) -> dict:
  facts = {
      "dot_product_attention_params": list(
          inspect.signature(tokamax.dot_product_attention).parameters),
      "mask_fields": [f for f in ("bool_mask", "causal_mask", "q_start", "q_end", "k_start",
                                  "k_end") if hasattr(tk_base.Mask, f)],
      "interpret_parameter": any(
          "interpret" in inspect.signature(fn).parameters
          for fn in (tokamax.dot_product_attention, tk_triton.PallasTritonFlashAttention)),
  }
  args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "do_masked", "seg", "ev")]
  # evicted_at as it is, [B, K, T]: q_end's head axis is the query-head axis.
  op = tk_triton.PallasTritonFlashAttention()
  ev = args[5]
  try:
    with tokamax.config.cross_compile(True):
      jax.eval_shape(lambda q, k, v: op(q, k, v, mask=tk_base.Mask(is_causal=True, q_end=ev)),
                     *args[:3])
    facts["q_end_kv_head_axis"] = "accepted"
  except Exception as e:  # pylint: disable=broad-except
    facts["q_end_kv_head_axis"] = "rejected: " + _first_line_error(e)
  # The two interpreter routes that fail (cheap: they fail while lowering).
  for key, ctx, fn in (("hlo_interpreter", hlo_interpreter, tokamax_custom_vjp()),
                       ("hlo_interpreter_manual_vjp", hlo_interpreter, tokamax_manual_vjp()),
                       ("tpu_interpreter_custom_vjp", tpu_interpreter, tokamax_custom_vjp())):
    try:
      with ctx():
        jax.jit(fn).lower(*args).compile()
      facts[key] = "lowers"
    except Exception as e:  # pylint: disable=broad-except
      facts[key] = "fails: " + _first_line_error(e)
    print(f"{key}: {facts[key][:160]}", flush=True)
  return facts


# --------------------------------------------------------------------------------------------
# cuda export.
# --------------------------------------------------------------------------------------------


def dense_mask_tensors(text: str, T: int) -> list[str]:
  """Distinct tensor types [..., T, T] of i1 in an MLIR module: a materialised mask."""
  pat = re.compile(r"tensor<(?:\d+x)*" + f"{T}x{T}" + r"xi1>")
  return sorted(set(pat.findall(text)))


def _abstract_gpu(kind: str):
  """An abstract mesh naming a GPU: how jax >= 0.11 lowers Triton without a GPU present."""
  device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform="gpu")
  return jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((1,), (_MESH_AXIS,), abstract_device=device))


def export_cuda(name: str, f, shapes, T: int, tokamax_ctx: bool,
                gpu_kind: str = "NVIDIA H100") -> dict:
  """jax.export for platform cuda on this machine; what came out.

  Tried as tests/test_kernels.py does; if the Triton lowering asks for an abstract GPU device
  (jax 0.11), tried again under an abstract mesh naming `gpu_kind`.
  """
  from jax import export
  allow = export.DisabledSafetyCheck.custom_call(_TRITON_TARGET)
  res = {}
  t0 = time.perf_counter()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for abstract in (None, gpu_kind):
      try:
        with contextlib.ExitStack() as stack:
          if tokamax_ctx:
            stack.enter_context(tokamax.config.cross_compile(True))
          if abstract:
            stack.enter_context(_abstract_gpu(abstract))
          exp = export.export(jax.jit(f), platforms=("cuda",), disabled_checks=[allow])(*shapes)
        text = exp.mlir_module()
        res.update(lowers=True, abstract_gpu_device=abstract, platforms=list(exp.platforms),
                   triton_custom_calls=text.count(f"stablehlo.custom_call @{_TRITON_TARGET}"),
                   kernel_names=sorted(set(re.findall(r'name = "([A-Za-z0-9_]+)"', text))
                                       - {_MESH_AXIS}),
                   dense_mask_tensors=dense_mask_tensors(text, T))
        break
      except Exception as e:  # pylint: disable=broad-except
        err = _first_line_error(e, 600)
        res.update(lowers=False, error=err)
        if abstract is None and "AbstractDevice" in err:
          res["error_without_abstract_gpu_device"] = err
          continue
        break
  res["seconds"] = round(time.perf_counter() - t0, 2)
  res["warnings"] = sorted({f"{w.category.__name__}: {str(w.message)[:300]}" for w in caught})
  status = (f"lowers (abstract device {res['abstract_gpu_device']}), "
            f"{res['triton_custom_calls']} Triton calls, dense masks "
            f"{res['dense_mask_tensors']}") if res["lowers"] else res["error"][:200]
  print(f"cuda export {name:24s} {status}", flush=True)
  return res


# --------------------------------------------------------------------------------------------


def run_key() -> str:
  return f"tokamax-{tokamax.__version__}_jax-{jax.__version__}"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="bench/results/tokamax_attention.json")
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--seq", type=int, default=256)
  p.add_argument("--heads", type=int, default=8, help="query heads N")
  p.add_argument("--kv-heads", type=int, default=2, help="kv heads K")
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--reps", type=int, default=5, help="timed calls per contender")
  p.add_argument("--no-export", action="store_true", help="skip the cuda export section")
  a = p.parse_args(argv)
  if tokamax is None:
    print(f"tokamax is not importable ({_TOKAMAX_ERROR}); skipping. It is not a dependency "
          "of this project: install it in a separate venv (see the module docstring).")
    return 0
  B, T, N, K, H = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
  x = make_inputs(B, T, N, K, H)
  args = [x[n] for n in ("q", "k", "v")]
  side = (x["seg"], x["ev"])
  print(f"{run_key()}  B={B} T={T} N={N} K={K} H={H} fp32, backend {jax.default_backend()}",
        flush=True)
  result = {
      "what": "tokamax PallasTritonFlashAttention vs trm_jax flash_attention on CPU "
              "(Pallas interpreters) against attention(impl='reference'); cuda lowering",
      "versions": {"tokamax": tokamax.__version__, "jax": jax.__version__,
                   "jaxlib": jaxlib.__version__, "python": platform.python_version()},
      "backend": jax.default_backend(),
      "machine": machine(),
      "shape": {"B": B, "T": T, "N": N, "K": K, "H": H, "dtype": "float32"},
      "inputs": {"segments_contiguous": segments_contiguous(x["seg"]),
                 "padding_rows": int((~x["valid"]).sum()),
                 "evicted_keys_fraction": float((x["ev"] < NEVER_EVICTED).mean())},
      "api": api_facts(x),
  }
  dense = visible_mask(LayerVisibility(jnp.asarray(x["seg"]), jnp.asarray(x["ev"])), B, K, T)
  tk_dense = tokamax_mask(jnp.asarray(x["seg"]), jnp.asarray(x["ev"]), N).as_array(T, T)
  result["mask_translation_exact"] = bool(jnp.array_equal(
      jnp.repeat(dense, N // K, axis=1), jnp.broadcast_to(tk_dense, (B, N, T, T))))
  print(f"mask translation exact: {result['mask_translation_exact']}", flush=True)

  ref_f = jax.jit(ours("reference"))
  ref = {c: jax.device_get(ref_f(*args, x[f"do_{c}"], *side)) for c in ("masked", "full")}
  result["reference_max_abs"] = {n: float(np.abs(r).max())
                                 for n, r in zip(("out", "dq", "dk", "dv"), ref["masked"])}

  contenders = {
      "ours_hlo_interpret": jax.jit(ours("pallas_interpret")),
      "ours_tpu_interpret": inside(tpu_interpreter, jax.jit(ours("pallas_interpret"))),
      "tokamax_tpu_interpret": inside(tpu_interpreter, jax.jit(tokamax_manual_vjp())),
  }
  result["first_call_s"] = {}
  for name, f in contenders.items():
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args, x["do_masked"], *side))
    result["first_call_s"][name] = round(time.perf_counter() - t0, 2)
  result["errors"] = {name: errors(name, f, ref, x) for name, f in contenders.items()}

  # Timing, interleaved; the order rotates each round.
  names = list(contenders)
  calls = {n: [] for n in names}
  load_before = os.getloadavg()
  for r in range(a.reps):
    for name in names[r % len(names):] + names[:r % len(names)]:
      probe = Probe().start()
      jax.block_until_ready(contenders[name](*args, x["do_masked"], *side))
      calls[name].append(probe.stop())
  load_after = os.getloadavg()
  med = {n: statistics.median(c["wall_s"] for c in v) for n, v in calls.items()}
  result["timing"] = {
      "what": "wall s of jit(forward + backward), fp32, CPU interpreters, after a warm-up call",
      "median_s": med,
      "tokamax_tpu_over_ours_tpu": round(med["tokamax_tpu_interpret"]
                                         / med["ours_tpu_interpret"], 3),
      "tokamax_tpu_over_ours_hlo": round(med["tokamax_tpu_interpret"]
                                         / med["ours_hlo_interpret"], 3),
      "any_call_contended": any(c["contended"] for v in calls.values() for c in v),
      "load_before": [round(l, 2) for l in load_before],
      "load_after": [round(l, 2) for l in load_after],
      "calls": calls,
  }
  print("median fwd+bwd s: " + ", ".join(f"{n} {v:.3f}" for n, v in med.items())
        + f"; load {result['timing']['load_before']} -> {result['timing']['load_after']}",
        flush=True)

  if not a.no_export:
    bf16 = jnp.bfloat16
    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in (
        ((B, T, N, H), bf16), ((B, T, K, H), bf16), ((B, T, K, H), bf16),
        ((B, T, N, H), bf16), ((B, T), jnp.int32), ((B, K, T), jnp.int32))]
    result["cuda_export"] = {
        "what": "jax.export(jax.jit(forward + backward), platforms=('cuda',)), bf16",
        "tokamax_visibility": export_cuda("tokamax k_start + q_end", tokamax_custom_vjp(),
                                          shapes, T, True),
        "tokamax_causal_only": export_cuda("tokamax causal only", tokamax_custom_vjp(True),
                                           shapes, T, True),
        "ours": export_cuda("ours", ours("pallas"), shapes, T, False),
    }

  runs = {}
  if os.path.exists(a.out):
    with open(a.out) as f:
      runs = json.load(f).get("runs", {})
  runs[run_key()] = result
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out, "w") as f:
    json.dump({"what": result["what"], "runs": runs}, f, indent=2)
  print(f"wrote {a.out} [{run_key()}]", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
