"""Text <-> token ids for Llama/Qwen models, built on the Hugging Face `tokenizers` library.

A `Tokenizer` comes from a HF model directory (tokenizer.json), from the metadata embedded in
a GGUF file (SentencePiece-style "llama" or byte-level "gpt2" vocabularies), or is the built-in
byte tokenizer of the random demo model. `StreamDecoder` turns generated ids into text chunks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterable, Sequence
from functools import cached_property, partial
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from jaxinfer.errors import CheckpointError, UnsupportedModelError

from .gguf_file import text

# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
_TYPE_NORMAL = 1
_TYPE_UNKNOWN = 2
_TYPE_CONTROL = 3
_TYPE_USER_DEFINED = 4

_SPM_SPACE = "\u2581"  # "▁": SentencePiece's visible space

# Split regexes of byte-level BPE vocabularies, as written in the models' own tokenizer.json
# (llama.cpp selects the same ones from `tokenizer.ggml.pre`). Llama 3 groups digits in
# threes; Qwen2 splits every digit.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRES = ("llama-bpe", "llama3", "llama-v3")
_QWEN2_PRES = ("qwen2",)

_SUPPORTED_GGUF_MODELS = "'llama' (SentencePiece BPE) and 'gpt2' (byte-level BPE)"


class Tokenizer:
    """Encodes prompts and decodes generated ids; wraps one `tokenizers.Tokenizer` (`backend`)."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        kind: str,
        vocab_size: int,
        bos_id: int | None,
        eos_ids: tuple[int, ...],
        add_bos: bool,
        chat_template: str | None = None,
        eos_append: int | None = None,
    ) -> None:
        self.backend = backend
        self.kind = kind
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        # Without a BOS id there is nothing to prepend, whatever the metadata asks for.
        self.add_bos = add_bos and bos_id is not None
        self.chat_template = chat_template  # jinja source (tokenizer_config.json / GGUF)
        # The id the metadata says to append to a text (add_eos_token, or a post-processor
        # that appends one: Qwen3-Embedding's <|endoftext|>); None: nothing. `encode` appends
        # it only when asked (a text to embed): a prompt to continue must not end in EOS.
        self.eos_append = eos_append

    def token_text(self, token_id: int | None) -> str:
        """The text of one token (e.g. "<s>"), "" for None."""
        return "" if token_id is None else self.backend.id_to_token(token_id) or ""

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.kind}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_ids={self.eos_ids}, add_bos={self.add_bos})"
        )

    # ---- constructors ------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Loads tokenizer.json from a HF model directory (or the file itself), plus the
        BOS/EOS settings of tokenizer_config.json, config.json and generation_config.json."""
        path = Path(path)
        tok_file = path if path.is_file() else path / "tokenizer.json"
        folder = tok_file.parent
        if not tok_file.is_file():
            raise CheckpointError(
                f"no tokenizer.json in {folder}: jaxinfer needs the fast (tokenizers) file; "
                "if the model ships only tokenizer.model, save it once with transformers' "
                "AutoTokenizer.from_pretrained(dir).save_pretrained(dir)"
            )
        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises a bare Exception with its parse error
            raise CheckpointError(
                f"cannot load {tok_file} ({_one_line(e)}); the file is corrupt or from an "
                "unsupported tokenizers version, re-download it"
            ) from e

        tok_cfg = _read_json(folder / "tokenizer_config.json")
        model_cfg = _read_json(folder / "config.json")
        gen_cfg = _read_json(folder / "generation_config.json")

        def token_id(entry: Any) -> int | None:
            # tokenizer_config stores special tokens as a string or as an AddedToken dict.
            if isinstance(entry, dict):
                entry = entry.get("content")
            return backend.token_to_id(entry) if isinstance(entry, str) else None

        bos_id = _first_id(
            token_id(tok_cfg.get("bos_token")),
            model_cfg.get("bos_token_id"),
            gen_cfg.get("bos_token_id"),
        )
        eos_ids = (
            _id_list(gen_cfg.get("eos_token_id"))
            or _id_list(model_cfg.get("eos_token_id"))
            or _id_list(token_id(tok_cfg.get("eos_token")))
        )

        # What the post-processor does with add_special_tokens=True: compare a probe encoded
        # with and without it. A leading id that only appears "with" is the BOS it prepends.
        probe_with = backend.encode("Hello", add_special_tokens=True).ids
        probe_without = backend.encode("Hello", add_special_tokens=False).ids
        prepended = probe_with[0] if probe_with[:1] != probe_without[:1] else None
        if bos_id is None:
            bos_id = prepended
        add_bos = prepended is not None and prepended == bos_id
        if isinstance(tok_cfg.get("add_bos_token"), bool):
            add_bos = tok_cfg["add_bos_token"]  # an explicit setting overrides the template
        # Likewise a trailing id only "with" has is the EOS it appends.
        appended = probe_with[-1] if probe_with[-1:] != probe_without[-1:] else None
        if isinstance(tok_cfg.get("add_eos_token"), bool):
            eos = token_id(tok_cfg.get("eos_token"))
            if not tok_cfg["add_eos_token"]:
                appended = None
            elif appended is None:
                appended = eos if eos is not None else next(iter(eos_ids), None)

        return cls(
            backend,
            kind=f"tokenizer.json ({type(backend.model).__name__})",
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            bos_id=bos_id,
            eos_ids=eos_ids,
            add_bos=add_bos,
            chat_template=_hf_chat_template(folder, tok_cfg),
            eos_append=appended,
        )

    @classmethod
    def from_gguf(cls, fields: dict[str, Any], path: Path | str) -> Tokenizer:
        """Rebuilds the tokenizer stored in a GGUF file's `tokenizer.ggml.*` metadata (its
        fields as gguf_file.read gives them)."""
        meta = _GGUFMeta(fields, path)
        tok_model = meta.get("tokenizer.ggml.model")
        if tok_model is None:
            raise CheckpointError(
                f"{meta.name} has no tokenizer.ggml.model metadata; re-convert the model with "
                "llama.cpp's convert_hf_to_gguf.py, which embeds the tokenizer"
            )
        if tok_model not in ("llama", "gpt2"):
            raise UnsupportedModelError(
                f"GGUF tokenizer model {tok_model!r} is not supported; jaxinfer supports "
                f"{_SUPPORTED_GGUF_MODELS}"
            )

        tokens = meta.require("tokenizer.ggml.tokens")
        n = len(tokens)
        types = meta.get("tokenizer.ggml.token_type") or [_TYPE_NORMAL] * n
        meta.check_length("tokenizer.ggml.token_type", types, n)

        unk_id = meta.token_id("tokenizer.ggml.unknown_token_id", n)
        if unk_id is None and _TYPE_UNKNOWN in types:
            unk_id = types.index(_TYPE_UNKNOWN)
        bos_id = meta.token_id("tokenizer.ggml.bos_token_id", n)
        eos_ids = tuple(
            dict.fromkeys(  # ordered de-duplication: eot is often the same id as eos
                i
                for key in ("eos_token_id", "eot_token_id", "eom_token_id")
                if (i := meta.token_id(f"tokenizer.ggml.{key}", n)) is not None
            )
        )
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token"))

        # The first occurrence wins if a (broken) vocabulary repeats a piece.
        vocab: dict[str, int] = {}
        for i, piece in enumerate(tokens):
            vocab.setdefault(piece, i)

        if tok_model == "llama":
            scores = meta.require("tokenizer.ggml.scores", float)
            meta.check_length("tokenizer.ggml.scores", scores, n)
            add_prefix = meta.get("tokenizer.ggml.add_space_prefix")
            backend = _build_spm(
                vocab,
                _spm_merges(vocab, dict(zip(tokens, scores, strict=True))),
                unk=tokens[unk_id] if unk_id is not None else None,
                add_prefix_space=True if add_prefix is None else bool(add_prefix),
            )
            kind = f"SentencePiece BPE from GGUF ({n} tokens)"
            add_bos = True if add_bos is None else bool(add_bos)  # llama.cpp's SPM default
        else:
            merges = [_split_merge(m, meta.name) for m in meta.require("tokenizer.ggml.merges")]
            pre = meta.get("tokenizer.ggml.pre") or "default"
            backend = _build_byte_level_bpe(vocab, merges, pre)
            kind = f"byte-level BPE from GGUF (pre={pre}, {n} tokens)"
            add_bos = bool(add_bos)  # False unless the file asks for it

        # Control tokens (and the ids the metadata names) are specials: matched whole in the
        # text, skipped on decode. User-defined tokens are matched whole but decode as text,
        # as in HF tokenizers and llama.cpp.
        special_ids = {i for i, t in enumerate(types) if t in (_TYPE_CONTROL, _TYPE_UNKNOWN)}
        special_ids.update(i for i in (unk_id, bos_id, *eos_ids) if i is not None)
        user_ids = [i for i, t in enumerate(types) if t == _TYPE_USER_DEFINED]
        backend.add_special_tokens([_added(tokens[i], special=True) for i in sorted(special_ids)])
        backend.add_tokens([_added(tokens[i], special=False) for i in user_ids])
        template = meta.get("tokenizer.chat_template")
        return cls(
            backend, kind=kind, vocab_size=n, bos_id=bos_id, eos_ids=eos_ids, add_bos=add_bos,
            chat_template=template if isinstance(template, str) and template else None,
            eos_append=meta.token_id("tokenizer.ggml.eos_token_id", n) if add_eos else None,
        )  # fmt: skip

    @classmethod
    def byte_level(cls) -> Tokenizer:
        """The built-in tokenizer of the random demo model: 0 `<unk>`, 1 `<s>`, 2 `</s>`, then
        ids 3..258 = bytes 0x00..0xFF (the stories260K/Llama 2 id layout, without merges).

        It is a merge-less GPT-2 style byte-level BPE, so any text round-trips exactly, and
        random ids decode like llama.cpp: invalid UTF-8 becomes U+FFFD byte by byte, which
        keeps streamed text identical to `decode` even for garbage.
        """
        specials = ["<unk>", "<s>", "</s>"]
        vocab = {tok: i for i, tok in enumerate(specials)}
        vocab.update({char: len(specials) + b for b, char in enumerate(_byte_level_alphabet())})
        backend = HFTokenizer(models.BPE(vocab, [], unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([_added(tok, special=True) for tok in specials])
        # Text like "<s>" must stay bytes (round trip of arbitrary text), so specials are never
        # matched in the input; decode still skips them.
        backend.encode_special_tokens = True
        return cls(
            backend,
            kind="byte-level (built-in)",
            vocab_size=len(vocab),
            bos_id=1,
            eos_ids=(2,),
            add_bos=True,
        )

    # ---- encode / decode ---------------------------------------------------------------

    def encode(self, text: str, *, add_eos: bool = False) -> list[int]:
        """Token ids of `text`, with BOS first iff `add_bos`, and with `add_eos` the id the
        metadata appends (`eos_append`, if any) last. Special-token text (e.g.
        "<|im_start|>" from a chat template) becomes the special id."""
        # BOS is added here rather than by the tokenizer.json post-processor, so that one rule
        # (add_bos) holds for every kind and templates that also append EOS are ignored.
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_eos and self.eos_append is not None:
            ids.append(self.eos_append)
        # add_bos implies a BOS id (__init__)
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def decode(self, ids, keep: Collection[int] = ()) -> str:
        """Text of `ids` (any int sequence, e.g. a numpy row); special tokens are skipped, but
        those in `keep`, which read as their text (a chat format's tags: `specials`)."""
        ids = [int(i) for i in ids]
        if not keep:
            return self.backend.decode(ids, skip_special_tokens=True)
        kept = [i for i in ids if i in keep or i not in self.special_ids]
        return self.backend.decode(kept, skip_special_tokens=False)

    @cached_property
    def max_token_bytes(self) -> int:
        """At least the bytes of text any one token stands for: its vocabulary string's UTF-8
        bytes (byte-level, Metaspace and <0xNN> spellings all take at least as many)."""
        return max((len(s.encode()) for s in self.backend.get_vocab()), default=1)

    def too_long(self, text: str, tokens: int) -> int:
        """0 when `text` may encode to at most `tokens` tokens, or is short enough (64 Ki
        characters) to count exactly; else a count it surely exceeds, known without encoding
        it (a 15 MB text takes seconds and gigabytes to encode). Twice the margin, for
        normalizers that drop characters."""
        if len(text) <= 1 << 16:
            return 0
        at_least = len(text) // (2 * self.max_token_bytes)
        return at_least if at_least > tokens else 0

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """The special tokens' ids, which `decode` skips."""
        added = self.backend.get_added_tokens_decoder()
        return frozenset(i for i, token in added.items() if token.special)

    def specials(self, texts: Iterable[str]) -> tuple[int, ...]:
        """The ids of those `texts` that are each one special token of this vocabulary (a
        Mistral GGUF's `[TOOL_CALLS]`), sorted; texts that are not are left out."""
        ids = (self.backend.token_to_id(text) for text in texts)
        return tuple(sorted({i for i in ids if i is not None and i in self.special_ids}))

    def stream(self, context: Sequence[int] = (), keep: Collection[int] = ()) -> StreamDecoder:
        """A fresh incremental decoder for one generated sequence (`keep`: as in `decode`).

        `context` (the prompt's last ids) is decoded but never returned: the generated text is
        what it adds, so a continuation keeps its leading space ("Once upon" + " a time").
        """
        return StreamDecoder(self, context, keep)


class StreamDecoder:
    """Incremental decode: `push` returns only text whose characters are complete.

    A character can be split over several byte tokens, so text ending in an incomplete UTF-8
    sequence (decoded as U+FFFD) is held back until later ids complete it, or `flush` gives it
    up. The concatenation of every `push` result and `flush` equals `tokenizer.decode(all
    ids, keep)` (`keep`: the special ids that read as text). The one exception is garbage from
    SentencePiece byte fallback: a run of byte tokens that is not valid UTF-8 decodes to one
    U+FFFD per byte as a whole, so characters already streamed from its valid beginning differ
    from `decode`. Byte-level vocabularies have no such case.

    Each id costs bounded work: only a short window of recent ids is decoded (TGI/vLLM style),
    and a tail held back for more than `HOLD` ids (a run of bytes that never completes a
    character, which a grammar can force) is given up as far as its characters are final,
    so invalid bytes stream as U+FFFD, as `decode` spells them, instead of being held (and
    decoded again) to the end.
    """

    HOLD = 8  # ids a tail may be held back before a push gives up what is final of it

    def __init__(
        self, tokenizer: Tokenizer, context: Sequence[int] = (), keep: Collection[int] = ()
    ) -> None:
        keep = frozenset(keep)
        self._decode_ids = partial(tokenizer.decode, keep=keep)
        self._skipped = tokenizer.special_ids - keep
        self._reset()
        self._ids: list[int] = [int(i) for i in context]
        self._read = len(self._ids)
        self._emitted = len(self._decode_ids(self._ids))
        self._prefix = self._emitted

    def _reset(self) -> None:
        # The window ids[_start:] starts one chunk back: ids[_start:_read] are the tokens of
        # the last returned chunk, whose text (_prefix characters of the window's) is cut off
        # the window's text. Starting one chunk back keeps context-dependent decoding (the
        # leading-space strip, byte runs) the same as in a full decode.
        self._ids = []
        self._start = 0
        self._read = 0
        self._prefix = 0  # len(decode(ids[_start:_read]))
        self._emitted = 0  # characters returned so far

    def _decode(self, end: int) -> str:
        return self._decode_ids(self._ids[self._start : end])

    def push(self, ids) -> str:
        """Adds newly generated ids; returns the text they complete (possibly "")."""
        held = len(self._ids) - self._read  # ids held back before these
        # decode skips special ids (but those kept): leaving them out changes no text, and a
        # run of them no longer widens the window
        self._ids.extend(i for i in map(int, ids) if i not in self._skipped)
        end = len(self._ids)
        text = self._decode(end)
        if len(text) > self._prefix and not text.endswith("\ufffd"):
            # With valid UTF-8, `text` extends the last chunk's. Otherwise (see the class
            # docstring) the returned text cannot be taken back; go on after as many characters.
            return self._advance(end, text[self._prefix :])
        if held < self.HOLD:
            return ""  # nothing new, or the last character is still incomplete
        return self._give_up(text)

    def _give_up(self, text: str) -> str:
        """The held tail is long: return what a push per id would have returned by now, or
        else every character of `text` (the window's) but its last, the only one later bytes
        can change (an incomplete character is at most 3 bytes, so 3 ids back suffice)."""
        end = len(self._ids)
        cuts = [(j, self._decode(j)) for j in range(end - 1, max(self._read, end - 4), -1)]
        for j, done in cuts:
            if len(done) > self._prefix and not done.endswith("\ufffd"):
                return self._advance(j, done[self._prefix :])
        for j, done in cuts:
            # ids[:j] decode to the window's text up to a last character that later bytes
            # complete or break: that character as `text` has it is final too
            if self._prefix < len(done) < len(text) and done[:-1] == text[: len(done) - 1]:
                return self._advance(j, text[self._prefix : len(done)])
        # neither (ids that add no text): give the tail up as decoded so far
        return self._advance(end - 1, self._decode(end - 1)[self._prefix :])

    def _advance(self, read: int, chunk: str) -> str:
        """`chunk`, the text of ids[_read:read]; the next window starts at _read."""
        self._start, self._read = self._read, read
        self._prefix = len(self._decode(read))
        self._emitted += len(chunk)
        return chunk

    def flush(self) -> str:
        """Returns the held-back rest (an unfinished character decodes as U+FFFD) and starts
        a new sequence."""
        rest = self._decode_ids(self._ids)[self._emitted :]
        self._reset()
        return rest


# ---- builders ------------------------------------------------------------------------------


def _build_spm(
    vocab: dict[str, int], merges: list[tuple[str, str]], *, unk: str | None, add_prefix_space: bool
) -> HFTokenizer:
    """A SentencePiece BPE as HF's LlamaConverter builds it (legacy Llama fast tokenizer)."""
    backend = HFTokenizer(
        models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    # SentencePiece sees spaces as "▁" and, like llama.cpp, adds a dummy-prefix space so the
    # first word is tokenized like any other ("▁Once", not "Once").
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", _SPM_SPACE)]
    decode_steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.insert(0, normalizers.Prepend(_SPM_SPACE))
        decode_steps.append(decoders.Strip(" ", 1, 0))  # drop the dummy prefix again
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence(decode_steps)
    return backend


def _spm_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary, as HF's SentencePieceExtractor
    (`generate_merges`) derives them.

    Every split of a piece into two in-vocab halves is a merge. Merges are ranked by the
    merged piece's score (higher first), then by longer left half, then longer right half;
    remaining ties keep vocabulary order (pieces by id, the splits of one piece by the ids of
    their halves), which Python's stable sort preserves.
    """
    merges: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        splits = [
            (piece[:k], piece[k:], score)
            for k in range(1, len(piece))
            if piece[:k] in vocab and piece[k:] in vocab
        ]
        splits.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(splits)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _build_byte_level_bpe(
    vocab: dict[str, int], merges: list[tuple[str, str]], pre: str
) -> HFTokenizer:
    """A GPT-2 style byte-level BPE; the split regex (and normalizer) follow the model family
    named by GGUF `tokenizer.ggml.pre`, as in the family's own tokenizer.json."""
    # Llama 3 looks whole words up in the vocabulary before merging (ignore_merges).
    backend = HFTokenizer(models.BPE(vocab, merges, ignore_merges=pre in _LLAMA3_PRES))
    if pre in _LLAMA3_PRES or pre in _QWEN2_PRES:
        pattern = _LLAMA3_SPLIT if pre in _LLAMA3_PRES else _QWEN2_SPLIT
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:  # ByteLevel's built-in regex is GPT-2's
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _QWEN2_PRES:
        backend.normalizer = normalizers.NFC()  # Qwen2's tokenizer.json normalizes to NFC
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table (entry b stands for byte b), the alphabet
    that the ByteLevel pre-tokenizer and decoder of `tokenizers` use."""
    # Printable Latin-1 bytes stand for themselves; the other 68 (controls, space, 0x7F-0xA0,
    # 0xAD) are shifted, in byte order, to U+0100 onwards.
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = iter(range(0x100, 0x200))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def _added(content: str, *, special: bool) -> AddedToken:
    # normalized=False: matched against the raw text, before "▁"/NFC normalization.
    return AddedToken(content, special=special, normalized=False)


# ---- metadata helpers ----------------------------------------------------------------------


class _GGUFMeta:
    """Typed access to a GGUF file's key/value fields, with one-line errors."""

    def __init__(self, fields: dict[str, Any], path: Path | str) -> None:
        self._fields = fields
        self.name = f"GGUF file {path}"

    def get(self, key: str) -> Any:
        try:
            return text(self._fields.get(key))  # strings (and string arrays) decoded UTF-8
        except UnicodeDecodeError as e:
            raise CheckpointError(
                f"{self.name}: metadata {key} is unreadable ({_one_line(e)}); the file is "
                "corrupt, re-download or re-convert it"
            ) from e

    def require(self, key: str, kind: type = str) -> list:
        """A non-empty array of `kind` values."""
        value = self.get(key)
        if not isinstance(value, list) or not value:
            raise CheckpointError(
                f"{self.name} has no {key} (needed to build its tokenizer); re-convert the "
                "model with llama.cpp's convert_hf_to_gguf.py"
            )
        if not all(isinstance(v, kind) for v in value):
            raise CheckpointError(
                f"{self.name}: {key} holds values other than {kind.__name__}s; the file is "
                "corrupt, re-convert it"
            )
        return value

    def check_length(self, key: str, values: Any, n: int) -> None:
        if not isinstance(values, list) or len(values) != n:
            count = len(values) if isinstance(values, list) else "no array of"
            raise CheckpointError(
                f"{self.name}: {key} has {count} entries but tokenizer.ggml.tokens has "
                f"{n}; the file is corrupt, re-convert it"
            )

    def token_id(self, key: str, n: int) -> int | None:
        """A token id key; absent, out-of-range or 0xFFFFFFFF ("none") ids become None."""
        value = self.get(key)
        return value if isinstance(value, int) and 0 <= value < n else None


def _split_merge(merge: str, where: str) -> tuple[str, str]:
    # GGUF stores merges as "left right". Search from index 1 like llama.cpp, so a left half
    # that is itself a space character still splits correctly.
    cut = merge.find(" ", 1)
    if cut < 0:
        raise CheckpointError(
            f"{where}: tokenizer.ggml.merges entry {merge!r} is not 'left right'; the file is "
            "corrupt, re-convert it"
        )
    return merge[:cut], merge[cut + 1 :]


def _hf_chat_template(folder: Path, tok_cfg: dict) -> str | None:
    """The default chat template of a HF folder: chat_template.jinja (newer transformers),
    chat_template.json, or tokenizer_config.json's chat_template (a string, or a list of named
    templates of which "default" is used)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"cannot read {jinja}: {_one_line(e)}") from e
    template = _read_json(folder / "chat_template.json").get("chat_template")
    template = template or tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _read_json(path: Path) -> dict:
    """An optional JSON config file as a dict ({} when absent)."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"cannot read {path} ({_one_line(e)}); fix or re-download the file"
        ) from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} is not a JSON object; fix or re-download the file")
    return value


def _first_id(*candidates: Any) -> int | None:
    return next((c for c in candidates if isinstance(c, int) and not isinstance(c, bool)), None)


def _id_list(value: Any) -> tuple[int, ...]:
    """An `eos_token_id` value (int, list of ints or null) as a de-duplicated tuple."""
    values = value if isinstance(value, list) else [value]
    return tuple(dict.fromkeys(v for v in values if isinstance(v, int) and not isinstance(v, bool)))


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
