"""Tokenizers behind one small interface: HF `tokenizer.json` and sentencepiece `tokenizer.model`.

`load_tokenizer(path)` reads a checkpoint directory (or a direct path to one of the two files)
and returns a `Tokenizer` with `encode`, `decode`, `encode_batch` (padded int32 arrays),
special ids (`bos_id`, `eos_id`, `pad_id`, `stop_ids`) and `apply_chat_template`.

Where the ids come from (first hit wins):
  * eos:  tokenizer_config `eos_token` -> generation_config `eos_token_id` -> sentencepiece eos.
          `stop_ids` is the ordered union of the tokenizer's eos and every generation_config
          eos id (instruct checkpoints list several, e.g. `<|im_end|>` and `<|endoftext|>`).
  * bos:  tokenizer_config `bos_token` -> generation_config `bos_token_id` -> sentencepiece bos
          -> None (Qwen has no bos).
  * pad:  tokenizer_config `pad_token` -> generation_config `pad_token_id` -> sentencepiece pad
          -> eos. Padded positions are masked everywhere, so pad only has to be a valid id.
`special_tokens_map.json` (the legacy file) is read when tokenizer_config lacks a token.

Chat templates are rendered with jinja2 directly, in the same sandbox transformers uses
(`ImmutableSandboxedEnvironment`, trim_blocks, lstrip_blocks, loopcontrols, its `tojson`,
`raise_exception`, `strftime_now`), with the named special tokens as template variables, so the
rendered text equals `AutoTokenizer.apply_chat_template(..., tokenize=False)`. The template comes
from `chat_template.jinja` if present, else tokenizer_config's `chat_template` (a string or a list
of named templates). This module never imports torch or transformers.

Why a re-implementation instead of wrapping a library. `AutoTokenizer` (transformers) does all
of this, but transformers is only a test dependency here, and with torch installed importing
it pulls torch into the JAX process (seconds of import and its memory); the test suite uses it
as the reference, so every behaviour below is checked against it. The libraries this module
does use each give one part:
  * `tokenizers` reads tokenizer.json: encode/decode and the added tokens stored in the file.
    It does not know which token is eos, pad or bos (tokenizer_config.json,
    special_tokens_map.json, generation_config.json say that), nor chat templates.
  * `sentencepiece` reads tokenizer.model: encode/decode of its pieces. It never matches
    control pieces (<s>, </s>) written in text, and tokenizer_config's added tokens
    (`<|im_end|>` beyond the model's pieces) do not exist for it.
  * chat templates live in tokenizer_config.json or chat_template.jinja and need jinja2 set up
    as transformers sets it up (sandbox, trim/lstrip blocks, its `tojson`, `raise_exception`,
    `{% generation %}`), with the named special tokens as variables.
What is left to write is that glue: the special-id resolution, the sentencepiece special-string
split, and the template environment, about 400 lines with `check_tokenizer_fits` and padding.

Deviations from transformers:
  * `{% generation %}` blocks render their body; assistant-token masks are not computed.
  * sentencepiece: text is split on the special-token strings (bos/eos/pad/unk and
    tokenizer_config `added_tokens_decoder`) and each piece between them is encoded on its own, so
    sentencepiece's dummy prefix applies per piece (transformers' `legacy=True` Llama behaviour).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from datetime import datetime
from typing import Any, Mapping, Optional, Sequence

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The named special tokens transformers exposes to chat templates (SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")


def _token_content(value: Any) -> Optional[str]:
  """tokenizer_config stores a token as a string or as an AddedToken dict {"content": ...}."""
  if value is None:
    return None
  if isinstance(value, Mapping):
    return value.get("content")
  return str(value)


class TokenizerFileError(ValueError):
  """A tokenizer is missing, or one of its files is unreadable or inconsistent; the message
  names the file (and the key)."""


def _read_json(path: str) -> dict:
  """A JSON object from `path` ({} when there is no such file), or one line naming it."""
  if not os.path.exists(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      out = json.load(f)
  except json.JSONDecodeError as e:
    raise TokenizerFileError(f"{path}: not valid JSON (line {e.lineno} column {e.colno}: "
                             f"{e.msg})") from None
  except (OSError, UnicodeDecodeError) as e:
    raise TokenizerFileError(f"{path}: cannot be read ({e})") from None
  if not isinstance(out, dict):
    raise TokenizerFileError(f"{path}: expected a JSON object, got {type(out).__name__}")
  return out


def _as_id_list(value: Any, where: str) -> list[int]:
  """A token id or list of them (generation_config.json's `where`) as a list."""
  if value is None:
    return []
  ids = list(value) if isinstance(value, (list, tuple)) else [value]
  if not all(isinstance(v, int) and not isinstance(v, bool) for v in ids):
    raise TokenizerFileError(f"{where} must be a token id or a list of them, got {value!r}")
  return ids


# ---------------------------------------------------------------------------------------------
# Backends: the two file formats, reduced to text <-> ids and token lookup.
# ---------------------------------------------------------------------------------------------


class _HFBackend:
  """`tokenizer.json` through the `tokenizers` library; special tokens live in the file."""

  def __init__(self, file: str):
    import tokenizers  # pylint: disable=g-import-not-at-top
    self.file = file
    try:
      self.tok = tokenizers.Tokenizer.from_file(file)
    except Exception as e:  # pylint: disable=broad-except  (the library raises bare Exception)
      raise TokenizerFileError(f"{file}: not a readable tokenizer ({e})") from None
    self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

  def max_id(self) -> int:
    # Not vocab_size - 1: added tokens may sit at arbitrary ids, leaving holes.
    return max(self.tok.get_vocab(with_added_tokens=True).values())

  def token_to_id(self, token: str) -> Optional[int]:
    return self.tok.token_to_id(token)

  def encode(self, text: str, add_special_tokens: bool) -> list[int]:
    return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

  def encode_many(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
    encs = self.tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
    return [e.ids for e in encs]

  def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
    return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


class _SPBackend:
  """`tokenizer.model` through sentencepiece, plus the special strings sentencepiece cannot see.

  sentencepiece treats control pieces (<s>, </s>) as unmatchable in text, so a rendered chat
  template containing them would be split into characters; we cut the text on those strings
  first and map them straight to their ids.
  """

  def __init__(self, file: str, add_bos: bool, add_eos: bool):
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top
    self.file = file
    try:
      self.sp = spm.SentencePieceProcessor(model_file=file)
    except (OSError, RuntimeError) as e:
      raise TokenizerFileError(f"{file}: not a readable sentencepiece model ({e})") from None
    self.n_pieces = self.sp.get_piece_size()
    self.add_bos, self.add_eos = add_bos, add_eos
    self.special: dict[str, int] = {}   # special string -> id
    self.extra: dict[int, str] = {}     # ids beyond the sentencepiece vocab -> string
    self._split_re: Optional[re.Pattern] = None
    self.vocab_size = self.n_pieces

  def register_special(self, content: str, idx: int) -> None:
    """Adds a string that must encode to exactly `idx` (an added token or a control piece)."""
    self.special[content] = idx
    if idx >= self.n_pieces:
      self.extra[idx] = content
      self.vocab_size = max(self.vocab_size, idx + 1)
    # Longest first, so "<|im_end|>" wins over a prefix of it.
    alts = sorted(self.special, key=len, reverse=True)
    self._split_re = re.compile("(" + "|".join(re.escape(a) for a in alts) + ")")

  def max_id(self) -> int:
    return max([self.n_pieces - 1, *self.special.values()])

  def token_to_id(self, token: str) -> Optional[int]:
    if token in self.special:
      return self.special[token]
    idx = self.sp.piece_to_id(token)
    # piece_to_id answers unk for unknown pieces; only accept unk if it was asked for.
    if idx == self.sp.unk_id() and token != self.sp.id_to_piece(idx):
      return None
    return idx

  def encode(self, text: str, add_special_tokens: bool) -> list[int]:
    ids: list[int] = []
    if add_special_tokens and self.add_bos and self.sp.bos_id() >= 0:
      ids.append(self.sp.bos_id())
    pieces = self._split_re.split(text) if self._split_re is not None else [text]
    for piece in pieces:
      if not piece:
        continue
      if piece in self.special:
        ids.append(self.special[piece])
      else:
        ids.extend(self.sp.encode(piece))
    if add_special_tokens and self.add_eos and self.sp.eos_id() >= 0:
      ids.append(self.sp.eos_id())
    return ids

  def encode_many(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
    return [self.encode(t, add_special_tokens) for t in texts]

  def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
    special_ids = {v: k for k, v in self.special.items()}
    out, run = [], []
    for i in ids:
      i = int(i)
      if i in special_ids or i in self.extra:
        if run:
          out.append(self.sp.decode(run))
          run = []
        if not skip_special_tokens:
          out.append(special_ids.get(i, self.extra.get(i)))
      else:
        run.append(i)
    if run:
      out.append(self.sp.decode(run))
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# Chat templates.
# ---------------------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
  """Accepts `{% generation %}...{% endgeneration %}` (used for assistant masks) and renders
  the body unchanged; we never ask for the mask."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

  def _render(self, caller):
    return caller()


def _compile_template(source: str) -> jinja2.Template:
  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson HTML-escapes; templates expect plain json.dumps (as in transformers).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[_GenerationTag, jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
  return env.from_string(source)


def _read_chat_template(directory: str, config: dict) -> Optional[str | dict[str, str]]:
  jinja_file = os.path.join(directory, "chat_template.jinja")
  if os.path.exists(jinja_file):
    with open(jinja_file, encoding="utf-8") as f:
      return f.read()
  template = config.get("chat_template")
  if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
    return {t["name"]: t["template"] for t in template}
  return template


# ---------------------------------------------------------------------------------------------
# The interface.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Tokenizer:
  """Host-side tokenizer. Construct with `load_tokenizer`."""
  backend: Any                          # _HFBackend | _SPBackend
  path: str                             # the checkpoint directory it was read from
  bos_id: Optional[int]
  eos_id: int
  pad_id: int
  stop_ids: tuple[int, ...]             # every id that ends generation; stop_ids[0] == eos_id
  special_tokens: dict[str, str]        # named special tokens, e.g. {"eos_token": "<|im_end|>"}
  chat_template: Optional[str | dict[str, str]]

  @property
  def vocab_size(self) -> int:
    return self.backend.vocab_size

  @property
  def max_id(self) -> int:
    """The largest id `encode` can return (pieces, added and special tokens)."""
    return self.backend.max_id()

  @property
  def kind(self) -> str:
    return "tokenizer.json" if isinstance(self.backend, _HFBackend) else "sentencepiece"

  def token_to_id(self, token: str) -> Optional[int]:
    return self.backend.token_to_id(token)

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Text -> ids. Special tokens are off by default because chat templates already write them
    (transformers also encodes rendered chats with add_special_tokens=False)."""
    return self.backend.encode(text, add_special_tokens)

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens)

  def encode_batch(self, texts: Sequence[str], *, padding_side: str = "right",
                   max_length: Optional[int] = None, pad_to_multiple_of: int = 1,
                   add_special_tokens: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Encodes and pads a batch.

    Args:
      texts: B strings.
      padding_side: "left" (prompts for generation: every prompt ends at column T-1, so the
        first sampled token lands in the same column for the whole batch) or "right".
      max_length: pad to exactly this T (a static shape for jit); a longer text is an error,
        never silently truncated. None pads to the longest text.
      pad_to_multiple_of: round T up to a multiple (fewer distinct shapes, fewer recompiles).
    Returns:
      tokens: [B, T] int32, pad_id outside the texts.
      lengths: [B] int32, the number of real tokens per row.
    """
    ids = self.backend.encode_many(texts, add_special_tokens)
    return pad_sequences(ids, self.pad_id, padding_side=padding_side, max_length=max_length,
                         pad_to_multiple_of=pad_to_multiple_of)

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                          add_generation_prompt: bool = True, tokenize: bool = False,
                          template_name: Optional[str] = None, **kwargs) -> str | list[int]:
    """Renders `messages` ([{"role": ..., "content": ...}, ...]) with the checkpoint's template.

    Extra keyword arguments become template variables (e.g. `enable_thinking=False` for Qwen3),
    overriding the special-token variables of the same name, as in transformers.
    """
    template = self.chat_template
    if template is None:
      raise ValueError(f"tokenizer at {self.path} has no chat template (looked for "
                       "chat_template.jinja and `chat_template` in tokenizer_config.json)")
    if isinstance(template, dict):
      name = template_name or "default"
      if name not in template:
        raise ValueError(f"tokenizer at {self.path}: no chat template named {name!r}; "
                         f"available: {sorted(template)}")
      template = template[name]
    # transformers drops None-valued keys (APIs send content=None); templates test presence.
    msgs = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
    variables = {**self.special_tokens, **kwargs}
    text = _compiled(template).render(messages=msgs, tools=None, documents=None,
                                      add_generation_prompt=add_generation_prompt, **variables)
    return self.encode(text) if tokenize else text


_TEMPLATE_CACHE: dict[str, jinja2.Template] = {}


def _compiled(source: str) -> jinja2.Template:
  if source not in _TEMPLATE_CACHE:
    _TEMPLATE_CACHE[source] = _compile_template(source)
  return _TEMPLATE_CACHE[source]


def pad_sequences(ids: Sequence[Sequence[int]], pad_id: int, *, padding_side: str = "right",
                  max_length: Optional[int] = None,
                  pad_to_multiple_of: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """Lists of ids -> ([B, T] int32 tokens, [B] int32 lengths). See `Tokenizer.encode_batch`."""
  if padding_side not in ("left", "right"):
    raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
  if pad_to_multiple_of < 1:
    raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
  lengths = np.array([len(s) for s in ids], dtype=np.int32)  # [B]
  longest = int(lengths.max()) if len(ids) else 0
  if max_length is not None:
    if longest > max_length:
      i = int(np.argmax(lengths))
      raise ValueError(f"sequence {i} has {longest} tokens, more than max_length={max_length}")
    T = max_length
  else:
    T = max(longest, 1)
  T = -(-T // pad_to_multiple_of) * pad_to_multiple_of
  tokens = np.full((len(ids), T), pad_id, dtype=np.int32)  # [B, T]
  for b, seq in enumerate(ids):
    if len(seq):
      if padding_side == "left":
        tokens[b, T - len(seq):] = seq
      else:
        tokens[b, :len(seq)] = seq
  return tokens, lengths


class TokenizerMismatchError(ValueError):
  """The tokenizer can produce an id the model has no embedding row for."""


def check_tokenizer_fits(tokenizer: Tokenizer, vocab_size: int) -> None:
  """Raises `TokenizerMismatchError` unless every id `tokenizer` can produce is < `vocab_size`.

  `vocab_size` is the model's (config.json `vocab_size`: its embedding and lm_head rows). A
  model may have more rows than the tokenizer has tokens (Qwen pads its vocabulary to a
  multiple of 128), never fewer: an id past the table embeds as NaN (`jnp.take` fills
  out-of-range rows) rather than failing, and an eos past it can never be sampled. Checked:
  every piece, added and special token (`max_id`), and the bos, eos, pad and stop ids.
  """
  named = [("eos id", tokenizer.eos_id), ("pad id", tokenizer.pad_id),
           ("bos id", tokenizer.bos_id), *(("stop id", i) for i in tokenizer.stop_ids),
           ("largest token id", tokenizer.max_id)]
  for what, idx in named:
    if idx is not None and idx >= vocab_size:
      raise TokenizerMismatchError(
          f"tokenizer at {tokenizer.path} ({tokenizer.kind}) has {what} {idx}, but the model's "
          f"vocab_size is {vocab_size}: ids must be < {vocab_size}; the tokenizer does not "
          "belong to this model")


def _tokenizer_file(path: str) -> tuple[str, str]:
  """(directory, file name) of the tokenizer at `path`: tokenizer.json, else tokenizer.model."""
  if os.path.isfile(path):
    return os.path.dirname(path) or ".", os.path.basename(path)
  if not os.path.isdir(path):
    raise TokenizerFileError(f"tokenizer path {path} does not exist")
  for candidate in ("tokenizer.json", "tokenizer.model"):
    if os.path.exists(os.path.join(path, candidate)):
      return path, candidate
  raise TokenizerFileError(f"{path}: no tokenizer (neither tokenizer.json nor tokenizer.model)")


def _backend(file: str, config: dict):
  """The tokenizer.json (`tokenizers`) or tokenizer.model (sentencepiece) backend, with the
  sentencepiece model's special pieces and the config's added tokens registered."""
  if file.endswith(".json"):
    return _HFBackend(file)
  backend = _SPBackend(file, add_bos=bool(config.get("add_bos_token", True)),
                       add_eos=bool(config.get("add_eos_token", False)))
  sp = backend.sp
  for idx in (sp.bos_id(), sp.eos_id(), sp.pad_id(), sp.unk_id()):
    if idx >= 0:
      backend.register_special(sp.id_to_piece(idx), idx)
  for idx, tok in config.get("added_tokens_decoder", {}).items():
    backend.register_special(_token_content(tok), int(idx))
  return backend


def _special_ids(backend, special_tokens: dict, gen_config: dict, directory: str,
                 fname: str) -> tuple:
  """(bos_id, eos_id, pad_id, stop_ids): each from tokenizer_config.json's token, else
  generation_config.json, else the sentencepiece model; pad falls back to eos."""
  def named_id(name: str) -> Optional[int]:
    content = special_tokens.get(name)
    if content is None:
      return None
    idx = backend.token_to_id(content)
    if idx is None:
      raise TokenizerFileError(f"{directory}: {name} {content!r} (tokenizer_config.json) is "
                               f"not in the vocabulary of {fname}")
    return idx

  def sp_id(attr: str) -> Optional[int]:
    if isinstance(backend, _SPBackend):
      idx = getattr(backend.sp, attr)()
      return idx if idx >= 0 else None
    return None

  gen = os.path.join(directory, "generation_config.json")
  gen_eos = _as_id_list(gen_config.get("eos_token_id"), f"{gen}: eos_token_id")
  eos_id = named_id("eos_token")
  if eos_id is None:
    eos_id = gen_eos[0] if gen_eos else sp_id("eos_id")
  if eos_id is None:
    raise TokenizerFileError(f"{directory}: no eos token (looked at tokenizer_config.json "
                             f"eos_token, generation_config.json eos_token_id and the {fname} "
                             "model)")
  stop_ids = tuple(dict.fromkeys([eos_id, *gen_eos]))

  bos_id = named_id("bos_token")
  if bos_id is None:
    gen_bos = _as_id_list(gen_config.get("bos_token_id"), f"{gen}: bos_token_id")
    bos_id = gen_bos[0] if gen_bos else sp_id("bos_id")

  pad_id = named_id("pad_token")
  if pad_id is None:
    gen_pad = _as_id_list(gen_config.get("pad_token_id"), f"{gen}: pad_token_id")
    pad_id = gen_pad[0] if gen_pad else sp_id("pad_id")
  if pad_id is None:
    pad_id = eos_id

  for name, idx in (("eos", eos_id), ("bos", bos_id), ("pad", pad_id), *(
      (f"generation_config eos_token_id {i}", i) for i in gen_eos)):
    if idx is not None and not 0 <= idx < backend.vocab_size:
      raise TokenizerFileError(f"{directory}: {name} id {idx} is outside the vocabulary "
                               f"[0, {backend.vocab_size})")
  return bos_id, eos_id, pad_id, stop_ids


def load_tokenizer(path: str) -> Tokenizer:
  """Loads the tokenizer of a checkpoint.

  Args:
    path: a checkpoint directory holding `tokenizer.json` or `tokenizer.model` (the former wins
      when both exist, as in transformers' fast tokenizers), or a path to either file.
  """
  directory, fname = _tokenizer_file(path)
  config = _read_json(os.path.join(directory, "tokenizer_config.json"))
  legacy_map = _read_json(os.path.join(directory, "special_tokens_map.json"))
  gen_config = _read_json(os.path.join(directory, "generation_config.json"))
  special_tokens = {}
  for name in _NAMED_TOKENS:
    content = _token_content(config.get(name, legacy_map.get(name)))
    if content is not None:
      special_tokens[name] = content
  backend = _backend(os.path.join(directory, fname), config)
  bos_id, eos_id, pad_id, stop_ids = _special_ids(backend, special_tokens, gen_config,
                                                  directory, fname)
  return Tokenizer(backend=backend, path=directory, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id,
                   stop_ids=stop_ids, special_tokens=special_tokens,
                   chat_template=_read_chat_template(directory, config))
