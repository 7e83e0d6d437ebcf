"""The character-level tokenizer of the task prompts and answers.

One token per character over a fixed vocabulary (the special tokens, newline
and printable ASCII: 100 ids, so it fits the ``smoke`` preset's vocabulary of
256), built with Hugging Face ``tokenizers`` so that it saves as
``tokenizer.json`` beside a checkpoint and loads back with
``tokenizers.Tokenizer.from_file`` or
``transformers.PreTrainedTokenizerFast(tokenizer_file=...)``. Any other
character encodes as ``<unk>``; the literal text ``<pad>``, ``<bos>`` or
``<eos>`` encodes as that special token (no task writes one).
"""

import os
import tempfile
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD, BOS, EOS, UNK = range(len(SPECIALS))
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))  # newline, space and printable ASCII
VOCAB_SIZE = len(SPECIALS) + len(CHARS)
FILENAME = "tokenizer.json"


def build_tokenizer() -> Tokenizer:
    """The tokenizer; the same ids on every call."""
    vocab = {token: i for i, token in enumerate(SPECIALS + tuple(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character alone
    tok.decoder = decoders.Fuse()  # join characters back without separators
    # <unk> stays an ordinary token, so a decode shows where characters were lost
    tok.add_special_tokens(list(SPECIALS[:3]))
    return tok


def save_tokenizer(tok: Tokenizer, folder: str | os.PathLike) -> Path:
    """Write ``folder/tokenizer.json`` atomically (a reader never sees half a file)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / FILENAME
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{FILENAME}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(tok.to_str())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_tokenizer(folder: str | os.PathLike) -> Tokenizer:
    """The tokenizer saved in ``folder``."""
    path = Path(folder) / FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer at {path}")
    return Tokenizer.from_file(str(path))


def encode(tok: Tokenizer, text: str, bos: bool = False) -> list[int]:
    """Token ids of ``text``, one per character, after ``<bos>`` if asked."""
    ids = tok.encode(text, add_special_tokens=False).ids
    return [BOS, *ids] if bos else ids


def decode(tok: Tokenizer, ids: list[int]) -> str:
    """Text of ``ids`` without <pad>, <bos> and <eos>."""
    return tok.decode(list(ids), skip_special_tokens=True)
