"""Hugging Face fast tokenizers built without torch: from GGUF metadata, or tiny ones for the quickstart.

Every tokenizer here is a `transformers.PreTrainedTokenizerFast` over a `tokenizers.Tokenizer`,
so `save_pretrained(dir)` writes `tokenizer.json` + `tokenizer_config.json` that
`AutoTokenizer.from_pretrained(dir)` (and vLLM) reload, and `apply_chat_template` works (jinja2).

GGUF route (llama.cpp `tokenizer.ggml.*` keys): byte-level BPE (`tokenizer.ggml.model == "gpt2"`)
from the stored vocabulary and merges, with the pre-tokenizer that `tokenizer.ggml.pre` names
(SmolLM2's `smollm` splits every digit on its own before the GPT-2 byte-level regex).
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

from jaxrl_llm.core.errors import ModelFileError

# llama.cpp token types (gguf.TokenType): 3 = CONTROL (special), 4 = USER_DEFINED (added, whole).
_CONTROL = 3
_USER_DEFINED = 4

# Splits of llama.cpp's pre-tokenizer types that are not plain GPT-2. `None` = GPT-2 regex only
# (applied by ByteLevel(use_regex=True)); a string = a regex applied first, isolated.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE_TYPES = frozenset({"gpt2", "default"})
_DIGITS_THEN_GPT2_PRE_TYPES = frozenset({"smollm", "starcoder", "refact"})
_REGEX_PRE_TYPES = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


class TokenizerMetadataError(ModelFileError):
    """The GGUF tokenizer metadata is missing a field or describes an unsupported tokenizer."""


@dataclass(frozen=True)
class GGUFTokenizerMetadata:
    """The `tokenizer.*` keys of a GGUF file that define a byte-level BPE tokenizer."""

    model: str  # tokenizer.ggml.model, e.g. "gpt2"
    pre: str  # tokenizer.ggml.pre, e.g. "smollm"
    tokens: list[str]
    merges: list[str]
    token_types: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    unk_token_id: int | None = None
    pad_token_id: int | None = None
    add_bos_token: bool = False
    add_eos_token: bool = False
    chat_template: str | None = None
    model_max_length: int | None = None


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _GPT2_PRE_TYPES:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2_PRE_TYPES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _REGEX_PRE_TYPES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_PRE_TYPES[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    supported = sorted(_GPT2_PRE_TYPES | _DIGITS_THEN_GPT2_PRE_TYPES | set(_REGEX_PRE_TYPES))
    raise TokenizerMetadataError(
        f"tokenizer.ggml.pre={pre!r} is not supported; supported pre-tokenizers: {supported}"
    )


def _token(meta: GGUFTokenizerMetadata, key: str, token_id: int | None) -> str | None:
    if token_id is None:
        return None
    if not 0 <= token_id < len(meta.tokens):
        raise TokenizerMetadataError(
            f"tokenizer.ggml.{key}={token_id} is outside the vocabulary (size {len(meta.tokens)})"
        )
    return meta.tokens[token_id]


def tokenizer_from_gguf_metadata(meta: GGUFTokenizerMetadata) -> PreTrainedTokenizerFast:
    """Byte-level BPE `PreTrainedTokenizerFast` equal (ids) to the one the GGUF was made from."""
    if meta.model != "gpt2":
        raise TokenizerMetadataError(
            f"tokenizer.ggml.model={meta.model!r} is not supported (only byte-level BPE, 'gpt2', "
            "as used by SmolLM2, Llama 3 and Qwen2 GGUFs)"
        )
    if not meta.merges:
        raise TokenizerMetadataError("tokenizer.ggml.merges is missing or empty for a BPE model")
    if meta.token_types and len(meta.token_types) != len(meta.tokens):
        raise TokenizerMetadataError(
            f"tokenizer.ggml.token_type has {len(meta.token_types)} entries but "
            f"tokenizer.ggml.tokens has {len(meta.tokens)}"
        )
    vocab = {token: index for index, token in enumerate(meta.tokens)}
    if len(vocab) != len(meta.tokens):
        raise TokenizerMetadataError("tokenizer.ggml.tokens contains duplicate tokens")
    merges = []
    for index, merge in enumerate(meta.merges):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise TokenizerMetadataError(
                f"tokenizer.ggml.merges[{index}]={merge!r} is not two space-separated tokens"
            )
        merges.append((parts[0], parts[1]))

    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(meta.pre)
    backend.decoder = decoders.ByteLevel()
    types = meta.token_types or [0] * len(meta.tokens)
    # Control tokens (<|im_start|> ...) and user-defined ones must match whole, never be split.
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(meta.tokens, types) if k == _CONTROL]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(meta.tokens, types)
            if k == _USER_DEFINED
        ]
    )
    bos = _token(meta, "bos_token_id", meta.bos_token_id)
    eos = _token(meta, "eos_token_id", meta.eos_token_id)
    backend.post_processor = _post_processor(meta, bos, eos)

    kwargs: dict = {}
    if meta.model_max_length is not None:
        kwargs["model_max_length"] = meta.model_max_length
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=_token(meta, "unknown_token_id", meta.unk_token_id),
        pad_token=_token(meta, "padding_token_id", meta.pad_token_id),
        chat_template=meta.chat_template,
        clean_up_tokenization_spaces=False,
        **kwargs,
    )


def _post_processor(meta: GGUFTokenizerMetadata, bos: str | None, eos: str | None):
    """Add BOS/EOS around encoded text when the GGUF asks for it (SmolLM2: neither)."""
    single, pair, specials = "$A", "$A $B", []
    if meta.add_bos_token and bos is not None:
        single, pair = f"{bos} {single}", f"{bos} $A {bos} $B"
        specials.append((bos, meta.bos_token_id))
    if meta.add_eos_token and eos is not None:
        single, pair = f"{single} {eos}", f"{pair} {eos}"
        specials.append((eos, meta.eos_token_id))
    if not specials:
        return processors.ByteLevel(trim_offsets=False)
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


# --------------------------------------------------------------------------------------------
# Tiny tokenizers for the CPU quickstart (no download: built from an alphabet or trained here).

DEFAULT_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


def _wrap(
    backend: Tokenizer, specials: Sequence[str], chat_template: str | None
) -> PreTrainedTokenizerFast:
    """Name the conventional special tokens that are present (pad/bos/eos/unk by spelling)."""
    roles = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
    kwargs = {role: token for role, token in roles.items() if token in specials}
    extra = [t for t in specials if t not in roles.values()]
    if extra:
        kwargs["extra_special_tokens"] = extra
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
        **kwargs,
    )


# Alphabet of the char tokenizer random-init models use by default: every task prompt fits.
CHAR_ALPHABET = string.ascii_letters + string.digits + string.punctuation + " \n\t"


def char_tokenizer() -> PreTrainedTokenizerFast:
    """The default tokenizer of a random-init model (`data.tokenizer: char`)."""
    return build_char_tokenizer(CHAR_ALPHABET)


def _check_specials(specials: Sequence[str]) -> None:
    if len(set(specials)) != len(specials):
        raise ValueError(f"specials contains duplicates: {list(specials)}")
    if any(not s for s in specials):
        raise ValueError("specials contains an empty string")


def build_char_tokenizer(
    alphabet: Iterable[str],
    specials: Sequence[str] = DEFAULT_SPECIALS,
    *,
    chat_template: str | None = None,
) -> PreTrainedTokenizerFast:
    """One token per character of `alphabet` (ids after the `specials`, in the order given).

    Text with a character outside the alphabet maps it to `<unk>` when `<unk>` is in `specials`;
    without `<unk>` such text raises in `encode`. Decoding concatenates characters (no spaces
    inserted). Specials named `<pad>`, `<bos>`, `<eos>`, `<unk>` get those roles.
    """
    _check_specials(specials)
    chars = list(dict.fromkeys(alphabet))
    if not chars:
        raise ValueError("alphabet is empty")
    bad = [c for c in chars if len(c) != 1]
    if bad:
        raise ValueError(f"alphabet entries must be single characters, got {bad[:5]}")
    clash = [c for c in chars if c in specials]
    if clash:
        raise ValueError(f"alphabet characters {clash} are also special tokens")
    vocab = {token: index for index, token in enumerate([*specials, *chars])}
    unk = "<unk>" if "<unk>" in specials else None
    # BPE without merges = character-level with an explicit unknown token.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=unk, fuse_unk=False))
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    backend.decoder = decoders.Fuse()
    return _wrap(backend, specials, chat_template)


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    specials: Sequence[str] = DEFAULT_SPECIALS,
    *,
    chat_template: str | None = None,
    split_digits: bool = True,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on `texts` (any text encodes: all 256 bytes are in the vocab).

    `split_digits` splits numbers into single digits first, as SmolLM2 and Llama do for
    arithmetic. `vocab_size` must leave room for the specials and the 256 byte tokens.
    """
    _check_specials(specials)
    minimum = len(specials) + 256
    if vocab_size < minimum:
        raise ValueError(f"vocab_size={vocab_size} < {minimum} (specials + 256 byte tokens)")
    backend = Tokenizer(models.BPE(fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if split_digits
        else byte_level
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return _wrap(backend, specials, chat_template)
