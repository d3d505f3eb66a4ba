"""LoRA and QLoRA (trm_jax/models/lora.py, peft_io.py): one policy for every RL piece, PEFT files.

  * new adapters are the base exactly; only the adapters are trained (gradients, optimizer
    state), the base (in the param dtype, int8 or nf4) is frozen;
  * the exported PEFT adapter, loaded by `peft` onto the transformers checkpoint, gives the JAX
    model's logits to 1e-5 (fp32), for Qwen3, Qwen2 (biases), Llama 3 and Qwen3-MoE; the
    merged export loads in transformers alike; importing the adapter gives back its arrays;
  * SMD's replay (the learner's masked track equals the rollout's log-probs) and MoE routing
    replay stay exact with adapters on (and the adapters change the policy: not vacuous);
  * the merged sampler (`model.lora.sampler = "merged"`) samples what the unmerged one does;
  * adapters shard by the model's logical-axis rules;
  * the tiny trainer with `model.lora.rank=8` checkpoints only the adapters and their
    optimizer state, resumes bitwise after a preemption, exports a PEFT adapter that peft
    loads with the JAX logits and that a new run starts from (`model.lora.path`), and refuses
    to resume on a changed base, naming model.path.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from hf_fixtures import hf_logits, load_hf_model, make_hf_checkpoint, sample_batch
from model_fixtures import make_test_model
from prompt_fixtures import left_padded_prompts
from trm_jax import config as config_lib
from trm_jax import sharding as shd
from trm_jax.kernels import Visibility
from trm_jax.models import from_pretrained, lora, peft_io, save_pretrained
from trm_jax.models.config import LORA_TARGETS, LoraConfig
from trm_jax.rl.learner import LearnerBatch, LearnerConfig, make_learner
from trm_jax.rollout import CacheConfig, generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5        # fp32 logits, JAX against transformers + peft


def _random_adapters(model, seed: int = 0, scale: float = 0.15):
  """Every adapter's B drawn N(0, scale^2) (the fixtures' weight scale; A keeps its init), so
  the adapters change the logits by O(1)."""
  rng = np.random.default_rng(seed)
  for path, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
    if path[-1] == "b":
      v.set_value(jnp.asarray(scale * rng.standard_normal(v.shape), jnp.float32))
  return model


def _adapters(model) -> dict:
  return {p: np.asarray(v.get_value()) for p, v in
          nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}


@nnx.jit
def _forward(model, tokens, segment_ids):
  return model(tokens, visibility=Visibility(segment_ids=segment_ids))


# --- the model: frozen base, trained adapters ----------------------------------------------

def test_new_adapters_are_the_base_and_only_they_are_trained():
  model, plain = make_test_model(seed=1, lora=LoraConfig(rank=4)), make_test_model(seed=1)
  tokens = jnp.asarray(left_padded_prompts([9, 6], 9))
  ones = jnp.ones_like(tokens)
  np.testing.assert_array_equal(np.asarray(_forward(model, tokens, ones)),   # B = 0: bitwise
                                np.asarray(_forward(plain, tokens, ones)))
  graphdef, params, rest = lora.split(model)
  leaves = jax.tree_util.tree_leaves_with_path(params)
  assert len(leaves) == 2 * 2 * len(LORA_TARGETS)   # layers x (A, B) x targets
  assert all("_lora" in jax.tree_util.keystr(p) and x.dtype == jnp.float32 for p, x in leaves)
  opt = optax.adamw(1e-3).init(params)
  assert {x.shape for x in jax.tree.leaves(opt) if x.ndim} <= {x.shape for _, x in leaves}

  @jax.jit
  def grads(params):
    return jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(tokens)[..., 3]))(params)
  b = [np.abs(np.asarray(g)).max() for p, g in jax.tree_util.tree_leaves_with_path(
      grads(params)) if "'b'" in jax.tree_util.keystr(p)]
  assert min(b) > 0      # every B gets a gradient (A's is 0 while B is 0, as in PEFT)


@pytest.mark.parametrize("base_quant", ["int8", "nf4"])
def test_quantized_base_is_frozen_codes_and_merges_to_its_dequantized_self(base_quant):
  model = make_test_model(seed=1, lora=LoraConfig(rank=4, base_quant=base_quant))
  tokens = jnp.asarray(left_padded_prompts([9, 6], 9))
  ones = jnp.ones_like(tokens)
  ours = _forward(model, tokens, ones)
  err = float(jnp.abs(ours - _forward(make_test_model(seed=1), tokens, ones)).max())
  assert 0 < err < (0.01 if base_quant == "int8" else 0.1), err   # against full precision
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(
      _forward(lora.merged(model), tokens, ones)))                   # dequantized: bitwise
  _, params, rest = lora.split(model)
  assert not nnx.to_flat_state(nnx.state(params, lora.QuantizedValue))
  codes = [v.get_value() for p, v in nnx.to_flat_state(nnx.state(rest, lora.QuantizedValue))
           if p[-1] == "qvalue"]
  assert len(codes) == 2 * len(LORA_TARGETS)
  assert {c.dtype for c in codes} == {jnp.dtype(jnp.int8 if base_quant == "int8" else
                                                jnp.uint4)}


def test_quantization_error_is_bounded_per_block():
  """int8: half a step of absmax / 127.5 per output channel; nf4: half the widest gap of the
  NF4 codebook (between its levels -1 and -0.6962) times each block of 64 inputs' absmax.
  The dequantization is qwix's, bitwise, and the codebook qwix's."""
  import qwix  # pylint: disable=g-import-not-at-top
  codes = jnp.arange(16, dtype=jnp.int32).astype(jnp.uint4)[:, None]
  np.testing.assert_array_equal(lora.NF4_LEVELS, np.asarray(qwix.dequantize(qwix.QArray(
      codes, jnp.ones((1, 1), jnp.float32), None, "nf4")))[:, 0])   # qwix's codebook
  w = jnp.asarray(np.random.default_rng(0).standard_normal((128, 4, 16)), jnp.float32)
  for base_quant, bound in (("int8", 0.5 / 127.5 + 1e-6), ("nf4", 0.5 * (1 - 0.6961928) + 1e-6)):
    q = lora.Quantized(w, (shd.EMBED, shd.Q_HEADS, shd.HEAD_DIM), 1, base_quant)
    blocks = np.asarray(w).reshape(128 // 64 if base_quant == "nf4" else 1, -1, 4, 16)
    absmax = np.abs(blocks).max(axis=1, keepdims=True)
    err = np.abs(np.asarray(q[...]) - np.asarray(w)).reshape(blocks.shape) / absmax
    assert err.max() <= bound, (base_quant, err.max())
    assert q.scale.shape == ((2, 4, 16) if base_quant == "nf4" else (1, 4, 16))
    np.testing.assert_array_equal(np.asarray(q[...]), np.asarray(qwix.dequantize(qwix.QArray(
        q.qvalue[...], q.scale[...], None, lora.QTYPES[base_quant]))))   # qwix's, bitwise


# --- PEFT ------------------------------------------------------------------------------------

PEFT_ARCHS = ("qwen3", "qwen2", "llama3", "qwen3_moe")


@pytest.fixture(scope="module")
def hf_ckpts(tmp_path_factory):
  root = tmp_path_factory.mktemp("lora_hf")
  return {arch: make_hf_checkpoint(str(root / arch), arch) for arch in PEFT_ARCHS}


@pytest.mark.parametrize("arch", PEFT_ARCHS)
def test_peft_adapter_and_merged_export_reproduce_the_jax_logits(hf_ckpts, tmp_path, arch):
  """On Qwen3-MoE attention only: peft reads gate/up/down of a MoE model as its experts'
  fused tensors, so the dense MLP (the fixture's layer 1, mlp_only_layers) cannot be
  exported as an adapter, and saying so is the exporter's job."""
  from peft import PeftModel  # pylint: disable=g-import-not-at-top
  cfg = LoraConfig(rank=4, alpha=8.0)
  base = from_pretrained(hf_ckpts[arch])
  if arch == "qwen3_moe":
    with pytest.raises(ValueError, match="peft loads the targets gate, up, down of a qwen3_moe "
                       "model onto its experts"):
      save_pretrained(lora.with_adapters(base, cfg), str(tmp_path / "no"), adapter=True)
    cfg = LoraConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "o"))
  model = _random_adapters(lora.with_adapters(base, cfg, seed=0))
  tokens, mask = sample_batch(B=3, T=12)
  valid = mask.astype(bool)
  ours = np.asarray(_forward(model, jnp.asarray(tokens), jnp.asarray(mask)))

  out = save_pretrained(model, str(tmp_path / "adapter"), adapter=True, base=hf_ckpts[arch])
  assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
  peft_model = PeftModel.from_pretrained(load_hf_model(hf_ckpts[arch]), out).eval()
  ref = hf_logits(peft_model, tokens, mask)
  assert ref[valid].std() > 0.5      # O(1) logits, as the plain parity tests'
  assert np.abs(ours - hf_logits(hf_ckpts[arch], tokens, mask))[valid].max() > 0.5  # adapted
  assert np.abs(ours - ref)[valid].max() <= TOL

  # Merged: W + (alpha / r) A B rounded to fp32 once, not the unmerged sum's roundings; the
  # bound of the plain transformers parity tests (test_models_parity.py).
  merged = save_pretrained(model, str(tmp_path / "merged"))
  assert np.abs(ours - hf_logits(merged, tokens, mask))[valid].max() <= 1e-4

  # Back in: a model with other adapters takes the file's, bitwise.
  back = peft_io.load_adapter(lora.with_adapters(base, cfg, seed=7), out)
  for p, x in _adapters(model).items():
    np.testing.assert_array_equal(_adapters(back)[p], x, err_msg=str(p))


def test_adapter_that_does_not_fit_is_named(hf_ckpts, tmp_path):
  cfg = LoraConfig(rank=4, alpha=8.0, targets=("q", "v"))
  model = lora.with_adapters(from_pretrained(hf_ckpts["qwen3"]), cfg)
  out = save_pretrained(model, str(tmp_path / "a"), adapter=True)
  config_file = os.path.join(out, "adapter_config.json")
  good = json.load(open(config_file))
  for field, value, msg in (("r", 8, "r = 8, but the model's adapters have rank 4"),
                            ("lora_alpha", 16, "lora_alpha = 16, but"),
                            ("target_modules", ["q_proj"], "target_modules = ['q_proj'], but"),
                            ("use_dora", True, "use_dora = True, but only use_dora = False"),
                            ("rank_pattern", {"q_proj": 2}, "rank_pattern")):
    json.dump({**good, field: value}, open(config_file, "w"))
    with pytest.raises(peft_io.AdapterFileError, match=re.escape(f"adapter_config.json: {msg}")):
      peft_io.load_adapter(model, out)
  json.dump(good, open(config_file, "w"))
  weights = os.path.join(out, "adapter_model.safetensors")
  tensors = load_file(weights)
  name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
  save_file({k: v for k, v in tensors.items() if k != name}, weights)
  with pytest.raises(peft_io.AdapterFileError, match=f"lacks tensor '{name}'"):
    peft_io.load_adapter(model, out)
  save_file({**tensors, name: tensors[name][:, :2]}, weights)
  with pytest.raises(peft_io.AdapterFileError, match=r"has shape \(32, 2\), expected \(32, 4\)"):
    peft_io.load_adapter(model, out)


# --- one policy: SMD replay and routing replay stay exact ------------------------------------

def test_smd_replay_is_exact_with_adapters():
  """The learner's masked track (mode smd: the rollout's evictions replayed) equals the
  compressed-cache sampler's log-probs to 1e-5 through the trainer's learner, whose params
  are the adapters only; TRM's PPL gap is rounding; without the adapters the same tokens
  score differently."""
  P, N = 16, 12
  lens = np.array([16, 9, 5, 12], np.int32)
  model = _random_adapters(make_test_model(seed=3, lora=LoraConfig(rank=4)), scale=0.5)
  ro = generate(model, left_padded_prompts(lens, P), lens, max_new_tokens=N,
                key=jax.random.key(7), eos_ids=(), temperature=0.9, keep_full_logprobs=True,
                cache=CacheConfig(policy="snapkv", ratio=0.5, window=4, kernel=3))
  assert int(jnp.sum(ro.evicted_at < 2**30)) > 0                  # keys were evicted
  B, T = ro.tokens.shape
  batch = LearnerBatch(tokens=ro.tokens, segment_ids=ro.segment_ids,
                       response_mask=ro.response_mask.astype(jnp.float32), logp_roll=ro.logp,
                       advantages=jnp.zeros((B,), jnp.float32), logp_old=ro.logp,
                       token_weights=jnp.ones((B, T), jnp.float32), evicted_at=ro.evicted_at,
                       roll_logp_full=ro.full_logp)
  lcfg = LearnerConfig(mode="smd", mode_kwargs=(("lam", 0.1),), criteria=("trm_max_kl",),
                       thresholds=(("delta", 1e-3),), chunk=8, attn_impl="reference",
                       temperature=0.9)
  graphdef, params, rest = lora.split(model)
  score = make_learner(graphdef, optax.sgd(0.0), lcfg, response_start=P)[0]
  logp, _, seq_mask, met = score(params, rest, batch)
  m = np.asarray(ro.response_mask) > 0
  assert np.abs(np.asarray(logp - ro.logp))[m].max() <= 1e-5
  assert abs(float(met["trm/ppl_gap"])) <= 1e-5 and float(np.min(seq_mask)) == 1.0
  zero = jax.tree.map(jnp.zeros_like, params)                     # the base alone
  assert np.abs(np.asarray(score(zero, rest, batch)[0] - ro.logp))[m].max() > 1e-2


@pytest.mark.parametrize("base_quant", ["none", "nf4"])
def test_merged_sampler_samples_the_policy_the_unmerged_one_does(base_quant):
  """`model.lora.sampler = "merged"`: the sampler program merges W + (alpha / r) A B inside
  itself and samples the plain model; with the same key it draws the unmerged sampler's
  tokens with its log-probs to 1e-5 (fp32: only where the sum is rounded differs), through a
  compressed cache as well, and the state it is given stays the adapters over the base."""
  from trm_jax.programs import sampler_merge  # pylint: disable=g-import-not-at-top
  from trm_jax.rollout import SamplingConfig  # pylint: disable=g-import-not-at-top
  from trm_jax.rollout.sampler import make_generate  # pylint: disable=g-import-not-at-top
  P, N = 16, 12
  lens = np.array([16, 9, 5, 12], np.int32)
  model = _random_adapters(make_test_model(seed=3, lora=LoraConfig(rank=4,
                                                                   base_quant=base_quant)),
                           scale=0.5)
  graphdef, state = nnx.split(model)
  scfg = SamplingConfig(max_new_tokens=N, eos_ids=(), temperature=0.9)
  cache = CacheConfig(policy="snapkv", ratio=0.5, window=4, kernel=3)
  c = config_lib.load_config(os.path.join(ROOT, "configs", "tiny_trm.py"))
  c.model.lora.rank, c.model.lora.base_quant = 4, base_quant
  # The default, "auto": merged over a full-precision base, unmerged over a quantized one.
  assert sampler_merge(c) is (lora.merged_sampler_state if base_quant == "none" else None)
  c.model.lora.sampler = "unmerged"
  assert sampler_merge(c) is None
  c.model.lora.sampler = "merged"
  assert sampler_merge(c) is lora.merged_sampler_state
  args = (jnp.asarray(left_padded_prompts(lens, P)), jnp.asarray(lens), jax.random.key(7))
  un = make_generate(graphdef, scfg, cache)(state, *args)
  me = make_generate(graphdef, scfg, cache, merge=sampler_merge(c))(state, *args)
  np.testing.assert_array_equal(np.asarray(me.tokens), np.asarray(un.tokens))
  np.testing.assert_array_equal(np.asarray(me.evicted_at), np.asarray(un.evicted_at))
  m = np.asarray(un.response_mask) > 0
  assert np.abs(np.asarray(me.logp - un.logp))[m].max() <= 1e-5
  # What the program samples from: the plain model (no adapters left), computing the LoRA
  # model's logits; zero adapters would give the base, whose logits differ.
  plain = nnx.merge(*lora.merged_sampler_state(graphdef, state))
  assert plain.config.lora is None and not nnx.state(plain, nnx.LoRAParam)
  tokens, seg = un.tokens, un.segment_ids
  np.testing.assert_allclose(np.asarray(_forward(plain, tokens, seg)),
                             np.asarray(_forward(model, tokens, seg)), atol=1e-5)
  zero = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.LoRAParam))
  base = nnx.merge(*lora.merged_sampler_state(graphdef, nnx.merge_state(state, zero)))
  assert np.abs(np.asarray(_forward(base, tokens, seg) - _forward(plain, tokens, seg))).max() > 0.1


def test_routing_replay_is_exact_with_adapters():
  """A Qwen3-MoE model with attention adapters, its experts frozen: replaying the sampler's
  expert choices (router jitter 0.5) gives the rollout's log-probs to 1e-5 on every row;
  without replay the flips show."""
  model = make_test_model(seed=0, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, norm_topk_prob=True,
                          lora=LoraConfig(rank=4, targets=("q", "k", "v", "o")))
  rng = np.random.default_rng(0)
  for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):   # adapters included
    if "norm" not in "/".join(map(str, path)):
      v.set_value(jnp.asarray(0.15 * rng.standard_normal(v.shape), jnp.float32))
  P, R = 12, 16
  lens = np.random.default_rng(0).integers(3, P + 1, 6).astype(np.int32)
  ro = generate(model, left_padded_prompts(lens, P), lens, max_new_tokens=R,
                key=jax.random.key(0), router_noise_scale=0.5, record_routing=True)

  @nnx.jit(static_argnames=("replay",))
  def learner_logp(model, ro, replay):
    logits = model(ro.tokens, visibility=Visibility(segment_ids=ro.segment_ids),
                   routing=ro.routed_experts if replay else None)
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits)[:, :-1], ro.tokens[:, 1:, None], -1)
    return jnp.pad(lp[..., 0], ((0, 0), (1, 0)))
  m = np.asarray(ro.response_mask) > 0
  gap = np.abs(np.asarray(learner_logp(model, ro, True) - ro.logp))
  assert all(gap[b][m[b]].max() <= 1e-5 for b in range(len(lens))), gap[m].max()
  assert np.abs(np.asarray(learner_logp(model, ro, False) - ro.logp))[m].max() > 1e-2


# --- sharding --------------------------------------------------------------------------------

def test_adapters_shard_by_the_logical_axis_rules():
  mesh = shd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  single = _random_adapters(make_test_model(seed=2, lora=LoraConfig(rank=4, base_quant="nf4")))
  model = shd.shard_model(_random_adapters(make_test_model(
      seed=2, lora=LoraConfig(rank=4, base_quant="nf4"))), mesh)
  attn, mlp = model.layers[0].attn, model.layers[0].mlp
  spec = lambda v: tuple(v.get_value().sharding.spec)
  d = ("fsdp", "expert")   # a weight's D: fully sharded over fsdp x expert (sharding.py)
  assert spec(attn.q_proj_lora.a) == (d, None)                 # [D, r]: D as the weight's
  assert spec(attn.q_proj_lora.b) == (None, "tensor", None)    # [r, N, H]: heads as its
  assert spec(attn.o_proj_lora.a)[:1] == ("tensor",)           # [N, H, r]
  assert spec(mlp.down_proj_lora.a) == ("tensor", None)        # [F, r]
  assert spec(attn.q_proj.qvalue) == (d, "tensor", None)       # nf4 codes as the weight
  tokens = jnp.asarray(left_padded_prompts([8, 8], 8))
  with jax.set_mesh(mesh):
    sharded = _forward(model, tokens, jnp.ones_like(tokens))
  np.testing.assert_allclose(np.asarray(sharded),
                             np.asarray(_forward(single, tokens, jnp.ones_like(tokens))),
                             atol=1e-5, rtol=0)


def test_config_refuses_bad_lora_settings():
  c = config_lib.load_config(os.path.join(ROOT, "configs", "tiny_trm.py"))
  for key, value, msg in (
      ("targets", ("q", "qkv"), r"\[model.lora.targets\]: \('q', 'qkv'\): must be distinct"),
      ("base_quant", "nf4", r"\[model.lora.rank, model.lora.base_quant\]: base_quant='nf4'"),
      ("path", "/a", r"\[model.lora.rank, model.lora.path\]"),
      ("alpha", 0.0, r"\[model.lora.alpha\]: must be a finite number > 0"),
      ("export", "both", r"\[model.lora.export\]: unknown value 'both'"),
      ("sampler", "fused", r"\[model.lora.sampler\]: unknown value 'fused'; expected auto, "
                           r"merged or unmerged")):
    bad = config_lib.load_config(os.path.join(ROOT, "configs", "tiny_trm.py"))
    bad.model.lora[key] = value
    with pytest.raises(config_lib.ConfigError, match=msg):
      config_lib.validate(bad)
  config_lib.validate(c)


# --- the trainer ----------------------------------------------------------------------------

STEPS = 4


def _train_args(shared, workdir, base, *overrides):
  return [sys.executable, "-m", "trm_jax.train", "--config", "configs/tiny_trm.py",
          "--workdir", workdir, f"--config.total_steps={STEPS}", "--config.ckpt_every=2",
          "--config.rl.batch_size=16", "--config.rl.group_size=4", "--config.eval_problems=0",
          "--config.model.lora.rank=8", "--config.rl.kl_beta=0.01",  # reference: adapters
          f"--config.model.path={base}", *shared.cli_args(),
          *overrides]


def _train(shared, workdir, base, *overrides, env=None, code=0):
  p = subprocess.run(_train_args(shared, workdir, base, *overrides), cwd=ROOT,
                     env=env or shared.env(), capture_output=True, text=True, timeout=900)
  assert p.returncode == code, p.stderr[-4000:]
  return p.stderr


def _state(workdir, step):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  tree = ocp.StandardCheckpointer().restore(os.path.join(workdir, "ckpt", str(step), "state"))
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.slow
def test_lora_trainer_checkpoints_adapters_resumes_bitwise_and_exports_peft(tmp_path,
                                                                             shared_run):
  from peft import PeftModel  # pylint: disable=g-import-not-at-top
  base = str(tmp_path / "base")
  shutil.copytree(shared_run.base_dir, base)
  reference = str(tmp_path / "reference")
  _train(shared_run, reference, base)
  state = _state(reference, STEPS)
  params = {k: v for k, v in state.items() if k.startswith("['params']")}
  assert len(params) == 2 * 2 * len(LORA_TARGETS)        # 2 layers x (A, B) x 7 targets
  assert all("_lora" in k for k in params) and all(   # the moments: the adapters' shapes
      "_lora" in k for k, v in state.items() if k.startswith("['opt_state']") and v.ndim)
  assert any(np.abs(v).max() > 0 for k, v in params.items() if "['b']" in k)   # it trained

  # Preempted right after its first checkpoint, then resumed: bitwise the uninterrupted run.
  workdir = str(tmp_path / "preempted")
  log = _train(shared_run, workdir, base, env=shared_run.env(TRM_DEBUG_SIGNAL="save@2"),
               code=128 + signal.SIGTERM)
  assert "checkpoint step 2 is saved" in log
  assert "resumed from step 2" in _train(shared_run, workdir, base)
  resumed = _state(workdir, STEPS)
  assert sorted(resumed) == sorted(state)
  for k, v in state.items():
    assert resumed[k].tobytes() == v.tobytes(), k
  exported = os.path.join(reference, "hf")
  assert load_file(os.path.join(workdir, "hf", "adapter_model.safetensors")).keys() == \
      load_file(os.path.join(exported, "adapter_model.safetensors")).keys()

  # The export: peft on the transformers base gives the JAX policy's logits; a run started
  # from it (model.lora.path) starts from the checkpoint's adapters.
  policy = lora.with_adapters(from_pretrained(base), LoraConfig(rank=8))
  for path, v in nnx.to_flat_state(nnx.state(policy, nnx.LoRAParam)):
    key = "['params']" + "".join(f"['{p}']" for p in path) + "['value']"
    v.set_value(jnp.asarray(state[key]))
  from trm_jax import train  # pylint: disable=g-import-not-at-top
  c = shared_run.config()
  c.model.path, c.model.lora.rank, c.model.lora.path = base, 8, exported
  imported, _ = train.add_adapters(c, from_pretrained(base), base)
  for p, x in _adapters(policy).items():
    np.testing.assert_array_equal(_adapters(imported)[p], x, err_msg=str(p))
  tokens, mask = sample_batch(B=2, T=10, vocab=policy.config.vocab_size)
  ours = np.asarray(_forward(policy, jnp.asarray(tokens), jnp.asarray(mask)))
  ref = hf_logits(PeftModel.from_pretrained(load_hf_model(base), exported).eval(), tokens, mask)
  assert np.abs(ours - ref)[mask.astype(bool)].max() <= TOL

  # Another base under the same path: refused, naming model.path.
  weights = os.path.join(base, "model.safetensors")
  tensors = load_file(weights)
  tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.01
  save_file(tensors, weights, metadata={"format": "pt"})
  err = _train(shared_run, reference, base, code=1)
  assert f"model.path={base} holds another base model than the one the adapters" in err


@pytest.mark.parametrize("base_quant", ["none", "nf4"])
def test_remat_with_adapters_changes_nothing_but_memory(base_quant):
  """model.remat=True over a frozen (maybe quantized) base: the loss and the adapters'
  gradients are those without remat (the 8B configs run with remat)."""
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, 64, (2, 8)), jnp.int32)
  cfg = LoraConfig(rank=4, base_quant=base_quant)
  out = []
  for remat in (False, True):
    model = _random_adapters(lora.with_adapters(make_test_model(remat=remat), cfg, seed=0))
    graphdef, params, rest = lora.split(model)
    loss = lambda p: jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, p, rest)(tokens))[..., 0])
    out.append(jax.jit(jax.value_and_grad(loss))(params))
  (l0, g0), (l1, g1) = out
  np.testing.assert_allclose(float(l0), float(l1), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):   # fp32 sums, recomputed
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
