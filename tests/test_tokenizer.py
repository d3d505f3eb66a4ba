"""Tokenizer interface over real tokenizer files written in tmp dirs; transformers is the reference
for chat-template rendering and for tokenizer.json encoding."""
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece as spm
from tokenizers import Tokenizer as HFTok
from tokenizers import decoders, models, pre_tokenizers, trainers

from trm_jax.data.tokenizer import (TokenizerFileError, TokenizerMismatchError,
                                    check_tokenizer_fits, load_tokenizer, pad_sequences)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 30? The answer is 42.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "hello world, hello tokenizer; numbers 0 1 2 3 4 5 6 7 8 9",
] * 20

CHATML = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content']"
    " + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}"
    "{%- endif %}{%- for m in messages %}{%- if m.role == 'system' and loop.first %}{% continue %}"
    "{%- endif %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
# Uses namespace, tojson, raise_exception, eos_token and a {% generation %} block.
FANCY = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}{% set ns.n = ns.n + 1 %}"
    "[{{ ns.n }}] {{ m | tojson }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}"
    "{% endgeneration %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA2 = (
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'].strip() + "
    "' [/INST]' }}{% else %}{{ ' ' + message['content'].strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}")

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be terse. \"quotes\" & <tags>"},
     {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"},
     {"role": "user", "content": "ünïcödé ✓"}],
]


def _write_json(path, obj):
  with open(path, "w", encoding="utf-8") as f:
    json.dump(obj, f)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("hf_tok")
  tok = HFTok(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  tok.save(str(d / "tokenizer.json"))
  _write_json(d / "tokenizer_config.json", {
      "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
      "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": CHATML})
  _write_json(d / "generation_config.json", {"eos_token_id": [
      tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]})
  return d


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("sp_tok")
  buf = io.BytesIO()
  # byte_fallback needs vocab >= 256 bytes + the corpus characters + specials.
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(CORPUS), model_writer=buf, vocab_size=340, model_type="bpe",
      byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
      hard_vocab_limit=False, minloglevel=2)
  (d / "tokenizer.model").write_bytes(buf.getvalue())
  _write_json(d / "tokenizer_config.json", {
      "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
      "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "legacy": True})
  (d / "chat_template.jinja").write_text(LLAMA2, encoding="utf-8")
  return d


def _hf_reference(path):
  from transformers import AutoTokenizer  # pylint: disable=g-import-not-at-top
  return AutoTokenizer.from_pretrained(str(path))


def test_hf_encode_decode_matches_transformers(hf_dir):
  tok = load_tokenizer(str(hf_dir))
  ref = _hf_reference(hf_dir)
  assert tok.kind == "tokenizer.json"
  for text in ["hello world", "The answer is 42.<|im_end|>", "ünïcödé ✓ \\boxed{7}"]:
    ids = tok.encode(text)
    assert ids == ref(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=False) == text
  assert tok.vocab_size == len(ref)


def test_hf_special_ids(hf_dir):
  tok = load_tokenizer(str(hf_dir))
  raw = HFTok.from_file(str(hf_dir / "tokenizer.json"))
  assert tok.eos_id == raw.token_to_id("<|im_end|>")
  assert tok.pad_id == raw.token_to_id("<|endoftext|>")
  assert tok.bos_id is None
  assert tok.stop_ids == (raw.token_to_id("<|im_end|>"), raw.token_to_id("<|endoftext|>"))
  # Loading through the file path reads the same directory's configs.
  assert load_tokenizer(str(hf_dir / "tokenizer.json")).eos_id == tok.eos_id


@pytest.mark.parametrize("template", [CHATML, FANCY], ids=["chatml", "fancy"])
@pytest.mark.parametrize("chat", CHATS, ids=["one_turn", "multi_turn"])
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(hf_dir, tmp_path, template, chat, gen):
  d = tmp_path / "ckpt"
  d.mkdir()
  (d / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
  cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
  cfg["chat_template"] = template
  _write_json(d / "tokenizer_config.json", cfg)
  tok, ref = load_tokenizer(str(d)), _hf_reference(d)
  ours = tok.apply_chat_template(chat, add_generation_prompt=gen)
  want = ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
  assert ours == want
  ids = tok.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True)
  assert ids == ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True,
                                        return_dict=False)


def test_chat_template_kwargs_and_errors(hf_dir):
  tok, ref = load_tokenizer(str(hf_dir)), _hf_reference(hf_dir)
  chat = CHATS[0]
  ours = tok.apply_chat_template(chat, enable_thinking=False)
  assert ours == ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False,
                                         enable_thinking=False)
  assert ours.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
  tok.chat_template = FANCY
  with pytest.raises(Exception, match="bad role tool"):
    tok.apply_chat_template([{"role": "tool", "content": "x"}])
  tok.chat_template = None
  with pytest.raises(ValueError, match="no chat template"):
    tok.apply_chat_template(chat)
  tok.chat_template = {"default": CHATML, "tool_use": FANCY}
  assert tok.apply_chat_template(chat) == ref.apply_chat_template(
      chat, add_generation_prompt=True, tokenize=False)
  with pytest.raises(ValueError, match="no chat template named 'rag'"):
    tok.apply_chat_template(chat, template_name="rag")


def test_sentencepiece_roundtrip_and_specials(sp_dir):
  tok = load_tokenizer(str(sp_dir))
  sp = spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
  assert tok.kind == "sentencepiece"
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)  # no pad anywhere -> eos
  assert tok.vocab_size == sp.get_piece_size()
  text = "hello world, ✓ 42"  # ✓ is not in the corpus: byte fallback
  ids = tok.encode(text)
  assert ids == sp.encode(text)
  assert tok.decode(ids) == text
  assert tok.encode(text, add_special_tokens=True) == [1] + sp.encode(text)
  # Control pieces inside rendered text map to their ids instead of being spelled out.
  assert tok.encode("<s>[INST] hi [/INST]") == [1] + sp.encode("[INST] hi [/INST]")
  assert tok.decode([1, *sp.encode("hi"), 2], skip_special_tokens=False) == "<s>hi</s>"
  assert tok.decode([1, *sp.encode("hi"), 2]) == "hi"


def test_sentencepiece_chat_template_matches_transformers(sp_dir):
  tok, ref = load_tokenizer(str(sp_dir)), _hf_reference(sp_dir)
  chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"},
          {"role": "user", "content": "What is 2+2?"}]
  ours = tok.apply_chat_template(chat, add_generation_prompt=False)
  assert ours == ref.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
  assert ours.startswith("<s>[INST] hello [/INST] hi there </s><s>[INST]")
  with pytest.raises(Exception, match="must alternate"):
    tok.apply_chat_template(chat[:1] + chat[:1])


def test_sentencepiece_added_tokens(sp_dir, tmp_path):
  d = tmp_path / "sp_added"
  d.mkdir()
  (d / "tokenizer.model").write_bytes((sp_dir / "tokenizer.model").read_bytes())
  n = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model")).get_piece_size()
  _write_json(d / "tokenizer_config.json", {
      "bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>",
      "added_tokens_decoder": {str(n): {"content": "<|im_end|>", "special": True},
                               str(n + 1): {"content": "<|pad|>", "special": True}}})
  tok = load_tokenizer(str(d))
  assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (n, n + 1, n + 2)
  ids = tok.encode("hi<|im_end|>")
  assert ids[-1] == n and tok.decode(ids, skip_special_tokens=False) == "hi<|im_end|>"


def test_encode_batch_padding(hf_dir):
  tok = load_tokenizer(str(hf_dir))
  texts = ["hello world", "hi", "The quick brown fox"]
  seqs = [tok.encode(t) for t in texts]
  P = tok.pad_id
  toks, lens = tok.encode_batch(texts, padding_side="left")
  T = max(map(len, seqs))
  assert toks.dtype == np.int32 and lens.dtype == np.int32 and toks.shape == (3, T)
  np.testing.assert_array_equal(lens, [len(s) for s in seqs])
  for b, s in enumerate(seqs):
    assert toks[b].tolist() == [P] * (T - len(s)) + s
  toks, lens = tok.encode_batch(texts, padding_side="right", pad_to_multiple_of=8)
  assert toks.shape[1] % 8 == 0 and toks.shape[1] >= T
  for b, s in enumerate(seqs):
    assert toks[b].tolist() == s + [P] * (toks.shape[1] - len(s))
  toks, _ = tok.encode_batch(texts, max_length=T + 3)
  assert toks.shape == (3, T + 3)
  with pytest.raises(ValueError, match="sequence 2 has .* more than max_length=2"):
    tok.encode_batch(texts, max_length=2)
  with pytest.raises(ValueError, match="padding_side"):
    pad_sequences([[1]], 0, padding_side="middle")


def test_bad_checkpoints(hf_dir, tmp_path):
  d = tmp_path / "bad"
  d.mkdir()
  with pytest.raises(TokenizerFileError, match="neither tokenizer.json nor tokenizer.model"):
    load_tokenizer(str(d))
  (d / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
  with pytest.raises(ValueError, match="no eos token"):
    load_tokenizer(str(d))
  _write_json(d / "tokenizer_config.json", {"eos_token": "<|nope|>"})
  with pytest.raises(ValueError, match="eos_token '<\\|nope\\|>'.*not in the vocabulary"):
    load_tokenizer(str(d))
  _write_json(d / "tokenizer_config.json", {})
  _write_json(d / "generation_config.json", {"eos_token_id": 10**6})
  with pytest.raises(ValueError, match="eos id 1000000 is outside the vocabulary"):
    load_tokenizer(str(d))


def test_tokenizer_must_fit_the_model(hf_dir, tmp_path):
  """A checkpoint written by transformers with vocab_size 128 cannot take the 320-id BPE
  tokenizer; one with exactly max_id + 1 rows can (the bound is strict, ids < vocab_size)."""
  from hf_fixtures import make_hf_checkpoint  # pylint: disable=g-import-not-at-top (torch)
  tok = load_tokenizer(str(hf_dir))
  raw = HFTok.from_file(str(hf_dir / "tokenizer.json"))
  assert tok.max_id == max(raw.get_vocab(with_added_tokens=True).values()) == 319

  def model_vocab(n):
    make_hf_checkpoint(str(tmp_path / f"v{n}"), "qwen3_tied", vocab_size=n)
    return json.loads((tmp_path / f"v{n}" / "config.json").read_text())["vocab_size"]

  small = model_vocab(128)
  with pytest.raises(TokenizerMismatchError,
                     match=f"tokenizer at {hf_dir} \\(tokenizer.json\\) has largest token id "
                           "319, but the model's vocab_size is 128"):
    check_tokenizer_fits(tok, small)
  check_tokenizer_fits(tok, model_vocab(320))


def test_tokenizer_fit_names_added_special_ids(sp_dir, tmp_path):
  """sentencepiece with tokenizer_config added tokens past its pieces: the pad id is named."""
  d = tmp_path / "sp_added"
  d.mkdir()
  (d / "tokenizer.model").write_bytes((sp_dir / "tokenizer.model").read_bytes())
  n = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model")).get_piece_size()
  _write_json(d / "tokenizer_config.json", {
      "bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>",
      "added_tokens_decoder": {str(n): {"content": "<|im_end|>", "special": True},
                               str(n + 1): {"content": "<|pad|>", "special": True}}})
  tok = load_tokenizer(str(d))
  assert tok.max_id == n + 1
  with pytest.raises(TokenizerMismatchError, match=f"has pad id {n + 1}, but the model's "
                                                   f"vocab_size is {n + 1}"):
    check_tokenizer_fits(tok, n + 1)
  with pytest.raises(TokenizerMismatchError, match=f"has eos id {n}, but the model's "
                                                   f"vocab_size is {n}"):
    check_tokenizer_fits(tok, n)
  check_tokenizer_fits(tok, n + 2)


def test_package_never_imports_torch_or_transformers():
  code = ("import sys, trm_jax.data, pyarrow.parquet; "
          "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
          "assert not bad, bad")
  env = {k: v for k, v in os.environ.items()}
  subprocess.run([sys.executable, "-c", code], check=True, env=env)
