"""The policy's tokenizer: the character tokenizer keeps its ids and layout; a
checkpoint's BPE tokenizer with a Qwen-style chat template renders prompts
exactly as transformers does, stops on every eos, pads with its pad id, and
bad files fail naming the file and field."""

import json
import logging
import re
from dataclasses import replace

import pytest
from chat_checkpoint import ENDOFTEXT, IM_END, IM_START, TEMPLATE, tokenizer_files, train_bpe
from transformers import AutoTokenizer

from tracefp4.components import steps
from tracefp4.components.architecture import get_preset
from tracefp4.components.bootstrap import make_batch
from tracefp4.components.checkpoint import config_to_hf, read_policy_folder
from tracefp4.components.model import build_model
from tracefp4.components.rollout import TorchEngine
from tracefp4.components.tasks import format_example, split
from tracefp4.components.tokenizer import (
    BOS,
    EOS,
    GENERATION_CONFIG,
    PAD,
    SPECIAL_TOKENS_MAP,
    TOKENIZER,
    TOKENIZER_CONFIG,
    UNK,
    VOCAB_SIZE,
    TokenizerError,
    build_tokenizer,
    load_tokenizer,
)
from tracefp4.schemas import load_config

BPE = train_bpe()
IDS = {name: BPE.token_to_id(name) for name in (ENDOFTEXT, IM_START, IM_END)}


def folder_of(tmp_path, files: dict[str, bytes], name="ckpt"):
    folder = tmp_path / name
    folder.mkdir()
    for file, data in files.items():
        (folder / file).write_bytes(data)
    return folder


def edited(files: dict[str, bytes], name: str, **changes) -> dict[str, bytes]:
    """``files`` with the JSON file ``name``'s keys changed (None: removed)."""
    value = json.loads(files[name])
    value.update(changes)
    return {**files, name: json.dumps({k: v for k, v in value.items() if v is not None}).encode()}


@pytest.fixture
def chat(tmp_path):
    return folder_of(tmp_path, tokenizer_files(BPE))


# -- the character tokenizer of the presets -------------------------------------------------------------------------


def test_character_tokenizer_keeps_its_ids_and_layout():
    tok = build_tokenizer()
    assert tok.vocab_size == VOCAB_SIZE == 100 and not tok.chat
    assert [tok.hf.convert_tokens_to_ids(t) for t in ("<pad>", "<bos>", "<eos>", "<unk>")] == [PAD, BOS, EOS, UNK]
    assert (tok.pad_id, tok.eos_ids, tok.end_id, tok.bos_id) == (0, (2,), 2, 1)
    assert tok.encode_prompt("12+3=") == [1, 22, 23, 16, 24, 34]  # <bos> then one id per character, as ever
    assert tok.encode_answer("15") == [22, 26, 4] and tok.stop_ids == (EOS, 4)  # the answer ends with the newline
    printable = "".join(chr(c) for c in range(32, 127)) + "\n"
    assert tok.decode(tok.encode(printable)) == printable
    assert tok.encode("1é\x00") == [tok.encode("1")[0], UNK, UNK]
    assert tok.decode([BOS, *tok.encode("7+1="), PAD, EOS]) == "<bos>7+1=<pad>"  # every token shown but the last eos
    assert build_tokenizer().files() == tok.files()  # deterministic


def test_character_tokenizer_files_round_trip_and_transformers_reads_them(tmp_path):
    tok = build_tokenizer()
    folder = tmp_path / "ckpt"  # as a checkpoint carries them (checkpoint.save_model's extra files)
    folder.mkdir()
    for name, data in tok.files().items():
        (folder / name).write_bytes(data)
    assert sorted(p.name for p in folder.iterdir()) == sorted([TOKENIZER, TOKENIZER_CONFIG, GENERATION_CONFIG])
    generation = json.loads((folder / GENERATION_CONFIG).read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"], generation["bos_token_id"]) == ([EOS], PAD, BOS)
    loaded = load_tokenizer(folder)
    assert loaded.files() == tok.files() and loaded.stop_ids == tok.stop_ids
    text = "numbers 3 7 25 target 46:"
    assert loaded.encode_prompt(text) == tok.encode_prompt(text)
    hf = AutoTokenizer.from_pretrained(folder)  # what a serving engine reads
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id) == (EOS, PAD, BOS)


# -- a checkpoint's BPE tokenizer with a chat template --------------------------------------------------------------


def test_prompts_are_the_chat_template_rendering_transformers_gives(chat):
    tok = load_tokenizer(chat)
    hf = AutoTokenizer.from_pretrained(chat)
    assert tok.chat and tok.vocab_size == BPE.get_vocab_size()
    for task in ("arithmetic", "countdown", "program"):
        for p in split(task, 4, 0, seed=1, difficulty=2)[0]:
            messages = [{"role": "user", "content": format_example(p)}]
            expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            assert tok.encode_prompt(format_example(p)) == list(expected)
    text = tok.hf.decode(tok.encode_prompt("12+3="))
    assert text == f"{IM_START}user\n12+3={IM_END}\n{IM_START}assistant\n"


def test_eos_list_ends_answers_and_stops_generation(chat, tmp_path):
    tok = load_tokenizer(chat)
    assert tok.eos_ids == (IDS[IM_END], IDS[ENDOFTEXT]) and tok.stop_ids == tok.eos_ids  # no newline stop
    assert tok.end_id == IDS[IM_END] and tok.pad_id == IDS[ENDOFTEXT] and tok.bos_id is None
    assert tok.encode_answer("25+3*7") == tok.encode("25+3*7") + [IDS[IM_END]]
    assert tok.decode(tok.encode_answer("25+3*7")) == "25+3*7"
    files = tokenizer_files(BPE)
    single = load_tokenizer(folder_of(tmp_path, edited(files, GENERATION_CONFIG, eos_token_id=IDS[IM_END]), "one"))
    assert single.eos_ids == (IDS[IM_END],)  # an int is a list of one
    no_generation = {k: v for k, v in files.items() if k != GENERATION_CONFIG}
    fallback = load_tokenizer(folder_of(tmp_path, no_generation, "none"))
    assert fallback.eos_ids == (IDS[IM_END],) and fallback.pad_id == IDS[ENDOFTEXT]  # tokenizer_config's tokens
    repeated = edited(files, GENERATION_CONFIG, eos_token_id=[IDS[IM_END], IDS[ENDOFTEXT], IDS[IM_END]])
    assert load_tokenizer(folder_of(tmp_path, repeated, "repeated")).eos_ids == tok.eos_ids


def test_pad_id_comes_from_the_files_and_pads_batches(chat, tmp_path):
    tok = load_tokenizer(chat)
    files = tokenizer_files(BPE)
    from_generation = edited(files, TOKENIZER_CONFIG, pad_token=None)
    assert load_tokenizer(folder_of(tmp_path, from_generation, "gen")).pad_id == IDS[ENDOFTEXT]
    problems = split("arithmetic", 3, 0, seed=0, difficulty=1)[0] + split("program", 1, 0, seed=0, difficulty=1)[0]
    batch = make_batch(tok, problems, max_len=128)
    for i, p in enumerate(problems):
        prompt, answer = tok.encode_prompt(format_example(p)), tok.encode_answer(p.answer)
        n = int(batch.lengths[i])
        assert batch.tokens[i, :n].tolist() == prompt + answer and (batch.tokens[i, n:] == tok.pad_id).all()
        assert batch.tokens[i, 1:][batch.target[i]].tolist() == answer  # the SFT target ends with <|im_end|>
    assert (batch.tokens == tok.pad_id).any()  # some row was padded
    generation = json.loads(tok.files()[GENERATION_CONFIG])
    assert generation["eos_token_id"] == [IDS[IM_END], IDS[ENDOFTEXT]] and generation["pad_token_id"] == tok.pad_id
    assert generation["temperature"] == 0.6  # the source's other fields travel on


@pytest.mark.parametrize(
    "change, message",
    [
        ({"drop": TOKENIZER}, "tokenizer.json does not exist"),
        ({"drop": TOKENIZER_CONFIG}, "tokenizer_config.json does not exist"),
        ({GENERATION_CONFIG: {"eos_token_id": [IDS[IM_END], 5000]}}, "generation_config.json eos_token_id is 5000"),
        ({GENERATION_CONFIG: {"eos_token_id": IDS[ENDOFTEXT]}}, "eos_token '<|im_end|>' .* is not among"),
        ({GENERATION_CONFIG: {"pad_token_id": -1}, TOKENIZER_CONFIG: {"pad_token": None}}, "pad_token_id is -1"),
        ({GENERATION_CONFIG: {"pad_token_id": None}, TOKENIZER_CONFIG: {"pad_token": None}}, "no pad: set pad_token"),
        ({TOKENIZER_CONFIG: {"eos_token": "<|eot|>"}}, "eos_token '<|eot|>' is not a token of tokenizer.json"),
        ({TOKENIZER_CONFIG: {"chat_template": "{{ messages[0]['content'] | nosuchfilter }}"}}, "chat_template fails"),
        ({TOKENIZER_CONFIG: {"chat_template": "{{ raise_exception('no user turns') }}"}}, "chat_template fails"),
    ],
)
def test_bad_tokenizer_files_fail_naming_the_file_and_field(tmp_path, change, message):
    files = tokenizer_files(BPE)
    for name, keys in change.items():
        files = {k: v for k, v in files.items() if k != keys} if name == "drop" else edited(files, name, **keys)
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(folder_of(tmp_path, files))


def test_a_template_from_chat_template_jinja_is_used_and_kept(tmp_path):
    files = edited(tokenizer_files(BPE), TOKENIZER_CONFIG, chat_template=None)
    files["chat_template.jinja"] = TEMPLATE.encode()
    tok = load_tokenizer(folder_of(tmp_path, files))
    assert tok.chat and tok.files()["chat_template.jinja"] == TEMPLATE.encode()
    assert tok.hf.decode(tok.encode_prompt("1+1=")).endswith(f"{IM_START}assistant\n")
    broken = folder_of(tmp_path, {**files, "chat_template.jinja": b"{% for %}"}, "broken")
    with pytest.raises(TokenizerError, match=re.escape(f"{broken}/chat_template.jinja fails to render")):
        load_tokenizer(broken)  # the folder named, as the other tokenizer errors name it


def test_a_policy_folder_whose_tokenizer_has_no_chat_template_is_warned_of(tmp_path, caplog):
    """Its prompts are plain text: as meant for a base model's folder, unawares for a chat model's copied without
    its chat_template.jinja. The library's character tokenizer is plain text by design, and says nothing."""
    config = json.dumps({**config_to_hf(get_preset("tiny")), "vocab_size": 4096})
    plain = folder_of(tmp_path, edited(tokenizer_files(BPE), TOKENIZER_CONFIG, chat_template=None), "plain")
    characters = folder_of(tmp_path, build_tokenizer().files(), "characters")
    chat = folder_of(tmp_path, tokenizer_files(BPE), "chat")
    for folder in (plain, characters, chat):
        (folder / "config.json").write_text(config)
    with caplog.at_level(logging.WARNING, logger="tracefp4.checkpoint"):
        assert not read_policy_folder(plain)[1].chat
        assert f"{plain} has no chat template (chat_template.jinja, or chat_template in" in caplog.text
        caplog.clear()
        for quiet in (characters, chat):
            read_policy_folder(quiet)
        assert caplog.text == ""
        # one whose template ignores add_generation_prompt: the response would follow the user's turn
        turns = TEMPLATE.partition("{% if add_generation_prompt %}")[0]
        headless = folder_of(tmp_path, tokenizer_files(BPE, template=turns), "headless")
        (headless / "config.json").write_text(config)
        assert read_policy_folder(headless)[1].chat
    assert f"{headless}: its chat template renders no generation prompt (add_generation_prompt" in caplog.text


def test_special_tokens_in_special_tokens_map_json_are_read_and_kept(tmp_path):
    """transformers 4 wrote the special tokens to special_tokens_map.json and
    reads them there: eos and pad set only there are the tokenizer's (eos was
    generation_config's first id, and the file was not carried on), and a map
    that sets one apart from tokenizer_config.json is refused."""
    files = edited(tokenizer_files(BPE), TOKENIZER_CONFIG, eos_token=None, pad_token=None)
    files = edited(files, GENERATION_CONFIG, eos_token_id=[IDS[ENDOFTEXT], IDS[IM_END]], pad_token_id=None)
    special = {"eos_token": {"content": IM_END, "special": True}, "pad_token": ENDOFTEXT}
    tok = load_tokenizer(folder_of(tmp_path, {**files, SPECIAL_TOKENS_MAP: json.dumps(special).encode()}))
    assert tok.end_id == IDS[IM_END] == tok.hf.eos_token_id and tok.pad_id == IDS[ENDOFTEXT]
    assert json.loads(tok.files()[SPECIAL_TOKENS_MAP]) == special
    apart = {**tokenizer_files(BPE), SPECIAL_TOKENS_MAP: json.dumps({"eos_token": ENDOFTEXT}).encode()}
    with pytest.raises(TokenizerError, match="tokenizer_config.json and special_tokens_map.json set eos_token apart"):
        load_tokenizer(folder_of(tmp_path, apart, "apart"))


def test_sampling_stops_each_trajectory_at_its_first_eos_and_pads_with_the_pad_id(chat):
    """A random policy over the BPE vocabulary samples each eos now and then:
    those trajectories end there, the others run to the token limit with none."""
    tok = load_tokenizer(chat)
    model = build_model(replace(get_preset("smoke"), vocab_size=tok.vocab_size), seed=3)
    config = load_config(None, preset="smoke", overrides={"rollout.max_new_tokens": 16})
    params = steps.sampling(config, tok, "rollout", 0)
    assert params.stop_tokens == tok.eos_ids and params.pad_token == tok.pad_id
    prompts = [tok.encode_prompt(format_example(p)) for p in split("countdown", 48, 0, seed=0, difficulty=1)[0]]
    trajectories = TorchEngine(model).generate(prompts, params)
    ended = {eos: 0 for eos in tok.eos_ids}
    for t in trajectories:
        at = [i for i, token in enumerate(t.response) if token in tok.eos_ids]
        if t.finish_reason == "stop":
            assert at == [len(t.response) - 1]
            ended[t.response[-1]] += 1
        else:
            assert not at and len(t.response) == 16
    assert min(ended.values()) >= 1, ended  # both eos ids stopped trajectories


def test_reasoning_a_template_opens_and_the_length_limit_cuts_is_no_answer(tmp_path, chat):
    """Qwen3.5's generation prompt ends inside ``<think>``, so its responses hold
    only the closing tag: read as they come, the first line of reasoning cut
    off by the length limit would be taken for the answer."""
    from tracefp4.components.tasks import get_task

    opening = TEMPLATE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
    assert opening != TEMPLATE
    thinking = load_tokenizer(folder_of(tmp_path, tokenizer_files(BPE, template=opening), "thinking"))
    problem, task = split("arithmetic", 4, 1, seed=0, difficulty=1)[0][0], get_task("arithmetic")
    finished = thinking.encode(f"so it is\n</think>\n\n{problem.answer}\n")
    cut_off = thinking.encode(f"{problem.answer}\nso it")
    assert task.reward(problem, thinking.response_text(finished)) == 1.0
    assert task.reward(problem, thinking.response_text(cut_off)) == 0.0
    plain = load_tokenizer(chat)  # a template that leaves the reasoning to the policy: the response as it is
    assert plain.response_text(cut_off) == plain.decode(cut_off)
    assert task.reward(problem, plain.response_text(cut_off)) == 1.0
    # what bootstrap SFT teaches the policy to write is an answer the reward takes, under either template: under
    # the opening one, after the reasoning closed empty (it had taught the bare answer, read as reasoning: 0)
    for tok in (thinking, plain):
        batch = make_batch(tok, [problem], max_len=128)
        taught = batch.tokens[0, batch.target[0].nonzero()[:, 0] + 1].tolist()  # target column t predicts t + 1
        assert taught == tok.encode_answer(problem.answer)
        assert task.reward(problem, tok.response_text(taught)) == 1.0
    assert thinking.decode(thinking.encode_answer("7")) == "\n</think>\n\n7"


def test_a_response_holding_a_token_its_text_did_not_show_earns_nothing(chat):
    """Decoding without special tokens dropped them and ids beyond the
    tokenizer (the presets' models have 256-512 ids over its 100), so a correct
    answer with such a token inside read as correct, and RL rewarded writing
    them. Every token shows now; only the eos that ends a response has no text."""
    from tracefp4.components.tasks import reward_of

    problem = split("arithmetic", 4, 1, seed=0, difficulty=1)[0][0]
    plain = build_tokenizer()
    answer = plain.encode_answer(problem.answer)
    assert reward_of(problem, plain.response_text(answer), finished=True) == 1.0
    assert (
        reward_of(problem, plain.response_text(answer[:-1] + [EOS]), finished=True) == 1.0
    )  # ended by eos, not the newline
    for planted, shown in ((VOCAB_SIZE, "\ufffd"), (300, "\ufffd"), (PAD, "<pad>"), (BOS, "<bos>"), (EOS, "<eos>")):
        spoiled = plain.response_text(answer[:1] + [planted] + answer[1:])
        assert spoiled == problem.answer[0] + shown + problem.answer[1:] + "\n"
        assert reward_of(problem, spoiled, finished=True) == 0.0
    chat_tokenizer = load_tokenizer(chat)
    answer = chat_tokenizer.encode_answer(problem.answer)
    assert answer[-1] == IDS[IM_END] and chat_tokenizer.response_text(answer) == problem.answer
    for planted in (IDS[IM_START], IDS[ENDOFTEXT], chat_tokenizer.vocab_size):
        assert (
            reward_of(problem, chat_tokenizer.response_text(answer[:1] + [planted] + answer[1:]), finished=True) == 0.0
        )
