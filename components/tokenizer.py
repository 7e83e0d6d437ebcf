"""The policy's tokenizer: how prompts and answers become token ids, which ids
end a response and pad a batch, and the files that carry all of it beside
the weights.

One class, :class:`PolicyTokenizer`, over a ``transformers`` fast tokenizer,
from one of two sources:

- the character tokenizer of the library presets (:func:`build_tokenizer`):
  one token per character over the special tokens, newline and printable
  ASCII (100 ids, within the ``smoke`` preset's vocabulary of 256), built
  with Hugging Face ``tokenizers``; ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2;
- a checkpoint's own tokenizer (:func:`load_tokenizer`): ``tokenizer.json``,
  ``tokenizer_config.json`` (special tokens, ``chat_template``, or a
  ``chat_template.jinja`` beside it) and ``generation_config.json``
  (``eos_token_id``, an int or a list; ``pad_token_id``), the files a
  Hugging Face model folder has.

How a prompt and an answer are laid out (docs/pipeline.md, "The policy's
checkpoint folder"): with a chat template, the prompt is the template's
rendering of one user message with the generation prompt, and an answer ends
with the tokenizer's end-of-turn token (its ``eos_token``); generation stops
on every eos id. Without one (the character tokenizer), the prompt is
``bos`` (if the tokenizer has one) then the text, and an answer ends with the
tasks' newline end marker (:data:`.tasks.END`), on which generation also
stops: a plain tokenizer has no end of turn, and the presets are taught the
newline. A chat model writes newlines inside its turn (Qwen3's
``<think>\\n``), so for it the newline stops nothing.

:meth:`PolicyTokenizer.files` are the files a checkpoint of the policy
carries, so that the next step and a serving engine read the same tokens:
the source's files as read, with ``generation_config.json`` stating the eos
list and pad id resolved here.
"""

import functools
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from jinja2 import TemplateError
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:  # transformers loads in about 2 s: only a step that reads a tokenizer pays for it
    from transformers import PreTrainedTokenizerBase

from .tasks import END, THINK_END, THINK_START

TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE = "chat_template.jinja"  # transformers 5 may keep the template here instead of in tokenizer_config.json
SPECIAL_TOKENS_MAP = "special_tokens_map.json"  # transformers 4's special tokens, beside tokenizer_config.json
# what a checkpoint's tokenizer may consist of
FILES = (TOKENIZER, TOKENIZER_CONFIG, GENERATION_CONFIG, CHAT_TEMPLATE, SPECIAL_TOKENS_MAP)

# The character tokenizer's vocabulary; its ids never change.
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD, BOS, EOS, UNK = range(len(SPECIALS))
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))  # newline, space and printable ASCII
VOCAB_SIZE = len(SPECIALS) + len(CHARS)
_PROBE = [{"role": "user", "content": "1+1="}]  # a chat template must render this at load time


class TokenizerError(ValueError):
    """A checkpoint's tokenizer files are missing or inconsistent; the message names the file and field."""


@dataclass(frozen=True)
class PolicyTokenizer:
    """A fast tokenizer and the special ids the pipeline uses: ``pad_id``
    fills batches, generation stops on ``stop_ids`` (every eos id, and the
    newline for a tokenizer without a chat template), an answer ends with
    ``end_id``. ``sources`` are the files it was read from, written back by
    :meth:`files`."""

    hf: "PreTrainedTokenizerBase"
    pad_id: int
    eos_ids: tuple[int, ...]
    end_id: int
    bos_id: int | None
    sources: dict[str, bytes] = field(repr=False)

    @property
    def chat(self) -> bool:
        return self.hf.chat_template is not None

    @property
    def characters(self) -> bool:
        """Whether this is the library presets' character tokenizer (:func:`build_tokenizer`), plain text by
        design."""
        return self.sources.get(TOKENIZER) == _character_backend().to_str().encode()

    @property
    def vocab_size(self) -> int:
        """Ids in use, added tokens included: the model's vocabulary must hold them all."""
        return len(self.hf)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.eos_ids if self.chat else (*self.eos_ids, self._newline())

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as it is, no special tokens added."""
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def encode_prompt(self, text: str) -> list[int]:
        """What the policy is given for the task text ``text``: the chat
        template's rendering of it as a user message with the generation
        prompt, or, without a template, ``bos`` (when there is one) + ``text``."""
        if not self.chat:
            return ([] if self.bos_id is None else [self.bos_id]) + self.encode(text)
        return self._render([{"role": "user", "content": text}])

    def encode_answer(self, text: str) -> list[int]:
        """The answer ``text`` as the policy should write it, through its end:
        the end-of-turn token with a chat template, the tasks' newline without.
        Where the generation prompt opens the reasoning (Qwen3.5), the answer
        follows it closed empty, as the template renders a turn without
        thinking: the tasks read an answer after ``</think>`` alone
        (:meth:`response_text`), and one taught without it would score 0."""
        if not self.chat:
            return self.encode(text + END)
        if self._prompt_opens_thinking:
            text = f"\n{THINK_END}\n\n{text}"
        return self.encode(text) + [self.end_id]

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` with every token shown: a special token as its
        own text (``<pad>``), an id beyond the tokenizer's as U+FFFD; only the
        eos that ended a response has none. Decoding without the special tokens
        dropped both kinds, so an answer with such a token inside read as
        correct and RL rewarded writing it (a model's vocabulary may be larger
        than its tokenizer's: Qwen's has unused ids, the presets' 256-512 over
        the character tokenizer's 100)."""
        ids, size = list(ids), self.vocab_size  # a call into the tokenizer each time it is read
        if ids and ids[-1] in self.eos_ids:
            ids = ids[:-1]
        if not ids or max(ids) < size:
            return self.hf.decode(ids)
        runs: list[list[int]] = [[]]
        for i in ids:
            if i < size:
                runs[-1].append(i)
            else:
                runs.append([])  # U+FFFD between the runs around it
        return "\ufffd".join(self.hf.decode(run) for run in runs)

    def response_text(self, ids: list[int]) -> str:
        """A response as the tasks read it (:meth:`decode`), behind the
        ``<think>`` the generation prompt left open where it left one (Qwen3.5's
        template opens the reasoning itself): reasoning the length limit cut
        off is then no answer, as with a template whose policy opens it."""
        text = self.decode(ids)
        return THINK_START + text if self._prompt_opens_thinking else text

    @functools.cached_property
    def _prompt_opens_thinking(self) -> bool:
        if not self.chat:
            return False
        prompt = self.hf.decode(self._render([{"role": "user", "content": "1+1="}]))
        return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)

    def files(self) -> dict[str, bytes]:
        """The tokenizer files a checkpoint of the policy carries: the sources
        as read, ``generation_config.json`` with the eos list and pad id."""
        generation = json.loads(self.sources.get(GENERATION_CONFIG, b"{}"))
        generation.update(eos_token_id=list(self.eos_ids), pad_token_id=self.pad_id)
        if self.bos_id is not None:
            generation["bos_token_id"] = self.bos_id
        return {**self.sources, GENERATION_CONFIG: (json.dumps(generation, indent=2) + "\n").encode()}

    def opens_a_response(self) -> bool:
        """Whether the chat template's generation prompt follows a user's turn with something (an assistant
        header): a template that ignores ``add_generation_prompt`` has the response follow the user's turn."""
        bare = self.hf.apply_chat_template(_PROBE, add_generation_prompt=False, tokenize=True, return_dict=False)
        return list(bare) != self._render(_PROBE)

    def _render(self, messages: list[dict]) -> list[int]:
        try:
            ids = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        except TemplateError as e:
            where = CHAT_TEMPLATE if CHAT_TEMPLATE in self.sources else f"{TOKENIZER_CONFIG} chat_template"
            raise TokenizerError(f"{where} fails to render a user message: {type(e).__name__}: {e}") from None
        return list(ids)

    def _newline(self) -> int:
        ids = self.encode(END)
        if len(ids) != 1:
            raise TokenizerError(
                f"{TOKENIZER} encodes the answers' end marker {END!r} as {len(ids)} tokens; "
                f"a tokenizer without a chat template must encode it as one"
            )
        return ids[0]


def _character_backend() -> Tokenizer:
    """The character tokenizer's ``tokenizers`` object; the same ids on every call."""
    vocab = {token: i for i, token in enumerate(SPECIALS + tuple(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character alone
    tok.decoder = decoders.Fuse()  # join characters back without separators
    # <unk> stays an ordinary token, so a decode shows where characters were lost
    tok.add_special_tokens(list(SPECIALS[:3]))
    return tok


def build_tokenizer() -> PolicyTokenizer:
    """The character tokenizer of the library presets (no chat template)."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "<pad>",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
    }
    sources = {
        TOKENIZER: _character_backend().to_str().encode(),
        TOKENIZER_CONFIG: (json.dumps(config, indent=2) + "\n").encode(),
        GENERATION_CONFIG: (json.dumps({"eos_token_id": EOS, "pad_token_id": PAD}, indent=2) + "\n").encode(),
    }
    return _from_sources(sources, "the character tokenizer")


def load_tokenizer(folder: str | os.PathLike) -> PolicyTokenizer:
    """The tokenizer of the checkpoint folder ``folder``: ``tokenizer.json``
    and ``tokenizer_config.json`` must be there; ``generation_config.json``
    and ``chat_template.jinja`` may be."""
    folder = Path(folder)
    for name in (TOKENIZER, TOKENIZER_CONFIG):
        if not (folder / name).is_file():
            raise TokenizerError(f"{folder / name} does not exist: a checkpoint folder must carry its tokenizer")
    return _from_sources({n: (folder / n).read_bytes() for n in FILES if (folder / n).is_file()}, str(folder))


def _json(sources: dict[str, bytes], name: str, where: str) -> dict:
    try:
        value = json.loads(sources.get(name, b"{}"))
    except (ValueError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{where}/{name}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{where}/{name} must hold a JSON object, got {type(value).__name__}")
    return value


def _special_tokens(sources: dict[str, bytes], config: dict, where: str) -> dict[str, tuple[str, object]]:
    """The pad, bos, eos and unk tokens the files set, each with the file that
    sets it: tokenizer_config.json, or special_tokens_map.json (transformers
    4 wrote them there, and reads them from there too); two files that set
    one of them apart are refused, since either may be the stale one."""
    files = {TOKENIZER_CONFIG: config, SPECIAL_TOKENS_MAP: _json(sources, SPECIAL_TOKENS_MAP, where)}
    found = {}
    for key in ("pad_token", "bos_token", "eos_token", "unk_token"):
        said = {}
        for name, values in files.items():
            value = values.get(key)
            if value is not None:
                said[name] = value.get("content") if isinstance(value, dict) else value  # "..." or an AddedToken
        if len(set(map(repr, said.values()))) > 1:
            raise TokenizerError(
                f"{where}: {TOKENIZER_CONFIG} and {SPECIAL_TOKENS_MAP} set {key} apart "
                f"({' and '.join(repr(v) for v in said.values())}); keep one"
            )
        if said:
            found[key] = next(iter(said.items()))
    return found


def _from_sources(sources: dict[str, bytes], where: str) -> PolicyTokenizer:
    """Read the files with transformers, then resolve and check the special ids."""
    config, generation = _json(sources, TOKENIZER_CONFIG, where), _json(sources, GENERATION_CONFIG, where)
    try:
        backend = Tokenizer.from_str(sources[TOKENIZER].decode())
    except Exception as e:  # tokenizers raises its own Exception subclass on a malformed tokenizer.json
        raise TokenizerError(f"{where}/{TOKENIZER}: not a tokenizer ({type(e).__name__}: {e})") from None
    size = backend.get_vocab_size(with_added_tokens=True)

    def token_id(value: object, what: str) -> int:
        if type(value) is not int or not 0 <= value < size:
            raise TokenizerError(f"{where}/{what} is {value!r}, not a token id of the vocabulary (0..{size - 1})")
        return value

    ids = {}
    for key, (name, content) in _special_tokens(sources, config, where).items():
        if not isinstance(content, str) or backend.token_to_id(content) is None:
            raise TokenizerError(f"{where}/{name}: {key} {content!r} is not a token of {TOKENIZER}")
        ids[key] = backend.token_to_id(content)
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:  # transformers reads a folder, as a serving engine does
        for name, data in sources.items():
            Path(tmp, name).write_bytes(data)
        try:
            hf = AutoTokenizer.from_pretrained(tmp, local_files_only=True)
        except (ValueError, OSError, ImportError) as e:
            raise TokenizerError(f"{where}: transformers cannot load the tokenizer ({type(e).__name__}: {e})") from None
    if len(hf) != size:
        raise TokenizerError(f"{where}: transformers reads {len(hf)} tokens from {TOKENIZER}, which holds {size}")
    eos_token, pad_token, bos_id = ids.get("eos_token"), ids.get("pad_token"), ids.get("bos_token")
    eos = generation.get("eos_token_id")
    if eos is None:
        if eos_token is None:
            raise TokenizerError(
                f"{where}: no eos: set eos_token_id in {GENERATION_CONFIG} or eos_token in {TOKENIZER_CONFIG}"
            )
        eos_ids = (eos_token,)
    else:
        listed = eos if isinstance(eos, list) and eos else [eos]
        eos_ids = tuple(dict.fromkeys(token_id(i, f"{GENERATION_CONFIG} eos_token_id") for i in listed))
    end_id = eos_ids[0] if eos_token is None else eos_token
    if end_id not in eos_ids:
        raise TokenizerError(
            f"{where}: {TOKENIZER_CONFIG} eos_token {hf.eos_token!r} ({end_id}) is not among {GENERATION_CONFIG} "
            f"eos_token_id {list(eos_ids)}: an answer would end with a token that does not stop generation"
        )
    if pad_token is not None:
        pad_id = pad_token
    elif generation.get("pad_token_id") is not None:
        pad_id = token_id(generation["pad_token_id"], f"{GENERATION_CONFIG} pad_token_id")
    else:
        raise TokenizerError(
            f"{where}: no pad: set pad_token in {TOKENIZER_CONFIG} or pad_token_id in {GENERATION_CONFIG}"
        )
    tok = PolicyTokenizer(hf, pad_id, eos_ids, end_id, bos_id, dict(sources))
    try:  # a broken template fails now, naming its file, not in the middle of a rollout
        if tok.chat:
            tok._render(_PROBE)
        else:
            tok._newline()
    except TokenizerError as e:  # it names the file within the folder
        raise TokenizerError(f"{where}/{e}") from None
    return tok
