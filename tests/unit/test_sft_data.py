"""``--sft`` data: records to tokens with an assistant-only loss mask, packing with per-document
positions and attention, and the key property: a packed batch gives the loss sum, count and
gradients of the same conversations run one per row, padded."""

import dataclasses
import json
import shlex

import numpy as np
import pytest
import torch

from meshtron.config import build_config
from meshtron.data.builder import MicroBatchIterator, build_datasets
from meshtron.data.chat_template import ChatTemplate, conversation_template, find_chat_template
from meshtron.data.sft_dataset import pack_documents, read_conversations, record_messages, tokenize_conversation, tokenize_file
from meshtron.data.tokenizers import ByteTokenizer, HuggingFaceTokenizer, train_bpe_tokenizer
from meshtron.errors import ConfigError
from meshtron.models import build_model
from meshtron.validation import validate

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "content": "Green, and red."},
]


def conversations(n: int, seed: int = 0) -> list[dict]:
    """``n`` records of both forms with replies of varied length."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        reply = " ".join(["word"] * int(rng.integers(1, 12)))
        if i % 3 == 0:
            out.append({"prompt": f"Question {i}?", "response": reply})
        else:
            out.append({"messages": [{"role": "user", "content": f"Say {i} words"}, {"role": "assistant", "content": reply},
                                     {"role": "user", "content": "More"}, {"role": "assistant", "content": reply[: i % 7 + 1]}]})  # fmt: skip
    return out


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def sft_config(path: str, *extra: str, seq: int = 64):
    return build_config(None, shlex.split(f"--preset tiny-llama --sft --data-path {path} --tokenizer-type ByteTokenizer "
                                          f"--seq-length {seq} --split 100,0,0 {' '.join(extra)}"))  # fmt: skip


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory):
    """A small BPE tokenizer.json with ChatML's special tokens and its chat template beside it."""
    from tokenizers import Tokenizer

    folder = tmp_path_factory.mktemp("chatml")
    path = train_bpe_tokenizer([m["content"] for m in CONVERSATION] * 20, 300, str(folder / "tokenizer.json"))
    tok = Tokenizer.from_file(path)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(path)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return str(folder)


def test_plain_layout_trains_on_replies_and_their_end_only():
    tok = ByteTokenizer()
    for record in ({"messages": CONVERSATION}, {"prompt": "Name a colour.", "response": "Blue.", "system": "Be brief."}):
        messages = record_messages(record, "record")
        ids, assistant = tokenize_conversation(messages, tok, None)
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        trained = [i for i, a in zip(ids, assistant) if a]
        assert trained == [t for r in replies for t in [*tok.encode(r), tok.eod]]
        assert bytes(i for i, a in zip(ids, assistant) if not a).decode().startswith("System: Be brief.\n\nUser: Name a colour.\n\nAssistant: ")


def test_chat_template_matches_transformers_and_masks_each_reply_with_its_end(chatml_tokenizer):
    from transformers import PreTrainedTokenizerFast

    template = find_chat_template(chatml_tokenizer)
    tok = HuggingFaceTokenizer.from_file(chatml_tokenizer)
    ids, assistant = tokenize_conversation(CONVERSATION, tok, template)
    hf = PreTrainedTokenizerFast(tokenizer_file=f"{chatml_tokenizer}/tokenizer.json", chat_template=CHATML)
    assert tok.decode(ids) == hf.apply_chat_template(CONVERSATION, tokenize=False)
    assert ids == list(hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"])
    runs, run = [], []
    for i, a in zip(ids, assistant):
        if a:
            run.append(i)
        elif run:
            runs, run = runs + [tok.decode(run)], []
    assert runs + ([tok.decode(run)] if run else []) == ["Blue.<|im_end|>\n", "Green, and red.<|im_end|>\n"]
    prompt = {"prompt": "Name a colour.", "response": "Blue."}
    ids, assistant = tokenize_conversation(record_messages(prompt, "record"), tok, template)
    assert tok.decode([i for i, a in zip(ids, assistant) if a]) == "Blue.<|im_end|>\n"
    assert tok.decode(ids).startswith("<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n")


LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == (1 if messages[0]['role'] == 'system' else 0)) and m['role'] != 'system' %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def test_template_with_bos_and_its_own_errors(chatml_tokenizer, tmp_path):
    """Special tokens from tokenizer_config.json, loops and filters render as transformers renders
    them; the template's raise_exception stops tokenization naming the file and line."""
    from transformers import PreTrainedTokenizerFast

    (tmp_path / "tokenizer.json").write_text(open(f"{chatml_tokenizer}/tokenizer.json").read())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": LLAMA3_STYLE, "bos_token": {"content": "<|im_start|>"}}))
    template = find_chat_template(str(tmp_path / "tokenizer.json"))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), chat_template=LLAMA3_STYLE, bos_token="<|im_start|>")
    assert template.render(CONVERSATION, False) == hf.apply_chat_template(CONVERSATION, tokenize=False)
    tok = HuggingFaceTokenizer.from_file(str(tmp_path))
    ids, assistant = tokenize_conversation(CONVERSATION, tok, template)
    assert ids[0] == tok.encode_text("<|im_start|>")[0] and tok.decode([i for i, a in zip(ids, assistant) if a]) == "Blue.<|eot_id|>Green, and red.<|eot_id|>"
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "response": "b"}, {"messages": CONVERSATION[1:2] + CONVERSATION[1:3]}])
    with pytest.raises(ValueError, match=f"{bad}:2: chat template .*tokenizer_config.json: roles must alternate"):
        tokenize_file(bad, tok, template)


def test_generation_tags_render_their_body(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML.replace(
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}",
        "{{ '<|im_start|>' + m['role'] + '\\n' }}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}")}))  # fmt: skip
    tagged = find_chat_template(str(tmp_path))
    assert "generation" in tagged.text
    assert tagged.render(CONVERSATION, False) == ChatTemplate("plain ChatML", CHATML, {}).render(CONVERSATION, False)


def test_template_choice(chatml_tokenizer, tmp_path):
    assert conversation_template("auto", "HuggingFaceTokenizer", chatml_tokenizer) is not None
    assert conversation_template("plain", "HuggingFaceTokenizer", chatml_tokenizer) is None
    assert conversation_template("auto", "ByteTokenizer", "") is None
    with pytest.raises(ValueError, match="--sft-chat-template plain"):
        conversation_template("tokenizer", "HuggingFaceTokenizer", str(tmp_path))


@pytest.mark.parametrize("line, message", [
    ('{"messages": [{"role": "user", "content": "hi"}', "not valid JSON"),
    ('["a"]', "must be a JSON object"),
    ('{"text": "hi"}', "no 'messages' and no 'prompt'/'response'"),
    ('{"messages": []}', "non-empty list"),
    ('{"messages": [{"role": "user"}]}', "message 0 must be an object with string 'role' and 'content'"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ('{"prompt": "hi", "response": 3}', "response is not"),
])  # fmt: skip
def test_malformed_record_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "response": "fine"}) + "\n\n" + line + "\n")
    with pytest.raises(ValueError, match=f"{path}:3: .*{message}".replace("[", r"\[").replace("(", r"\(")):
        read_conversations(str(path))


def test_packing_is_next_fit_in_seeded_epochs():
    positions = np.array([30, 10, 25, 40, 5, 64, 12])
    docs = np.arange(7)
    a, b = pack_documents(positions, docs, 12, 64, seed=3), pack_documents(positions, docs, 12, 64, seed=3)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["document_order"], pack_documents(positions, docs, 12, 64, seed=4)["document_order"])
    order, starts = a["document_order"], a["sample_starts"]
    assert len(starts) == 13
    first_epoch = order[:7]
    assert sorted(first_epoch.tolist()) == list(range(7))  # every document once per epoch
    for i in range(12):
        members = order[starts[i] : starts[i + 1]]
        assert positions[members].sum() <= 64
        if i + 1 < 12:  # next fit: the next sample's first document did not fit
            assert positions[members].sum() + positions[order[starts[i + 1]]] > 64


def test_samples_reset_positions_and_documents_and_cache(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", conversations(30))
    cfg = sft_config(path)
    train, valid, _ = build_datasets(cfg.data, ByteTokenizer(), (10, 0, 0), seed=1)
    assert valid is None and not train.cache_hit and len(train) == 10
    tok = ByteTokenizer()
    for i in range(len(train)):
        s = train[i]
        docs = train.documents(i)
        assert all(s[k].shape == (64,) for k in ("tokens", "labels", "loss_mask", "position_ids", "document_ids"))
        for k, d in enumerate(docs):
            where = s["document_ids"] == k
            alone = train.document_tensors(int(d))
            assert torch.equal(s["tokens"][where], alone["tokens"]) and torch.equal(s["position_ids"][where], torch.arange(int(where.sum())))
            assert torch.equal(s["labels"][where], alone["labels"]) and torch.equal(s["loss_mask"][where], alone["loss_mask"])
        assert s["loss_mask"][s["document_ids"] == len(docs)].sum() == 0  # padding
        same = s["document_ids"][1:] == s["document_ids"][:-1]
        assert torch.equal(s["labels"][:-1][same], s["tokens"][1:][same])  # labels are the next token inside a document
    trained_bytes = bytes(int(t) for t, m in zip(train[0]["labels"], train[0]["loss_mask"]) if m and t != tok.eod).decode()
    assert set(trained_bytes.replace("word", "").replace(" ", "")) <= set("wor")  # only replies
    again, _, _ = build_datasets(cfg.data, tok, (10, 0, 0), seed=1)
    assert again.cache_hit and all(torch.equal(again[i]["tokens"], train[i]["tokens"]) for i in range(10))
    assert "30 conversations packed into 10 sequences of 64" in train.describe()


def test_resumed_iterator_continues_with_the_same_samples(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", conversations(30))
    train, _, _ = build_datasets(sft_config(path).data, ByteTokenizer(), (12, 0, 0), seed=2)
    straight = MicroBatchIterator(train, 2, 0)
    batches = [next(straight) for _ in range(5)]
    resumed = MicroBatchIterator(build_datasets(sft_config(path).data, ByteTokenizer(), (12, 0, 0), seed=2)[0], 2, 6)
    for want in batches[3:]:
        got = next(resumed)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_packed_loss_equals_each_conversation_alone(tmp_path):
    """The key property: the same loss sum, count and gradients as one padded row per conversation."""
    path = write_jsonl(tmp_path / "chat.jsonl", conversations(24, seed=5))
    cfg = sft_config(path, seq=256)
    train, _, _ = build_datasets(cfg.data, ByteTokenizer(), (2, 0, 0), seed=0)
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(cfg.model, vocab_size=0), 320, 256)
    packed = {k: torch.stack([train[i][k] for i in range(2)]) for k in train[0]}
    assert (packed["document_ids"].amax(dim=1) >= 2).all()  # several conversations per row

    alone = [train.document_tensors(int(d)) for i in range(2) for d in train.documents(i)]
    rows = {k: torch.stack([torch.nn.functional.pad(a[k], (0, 256 - a[k].numel())) for a in alone]) for k in alone[0]}

    def loss_and_grads(batch, **position):
        model.zero_grad()
        per_token = model(batch["tokens"], labels=batch["labels"], **position)
        total, count = (per_token * batch["loss_mask"]).sum(), batch["loss_mask"].sum()
        (total / count).backward()
        return total.detach(), count, {n: p.grad.clone() for n, p in model.named_parameters()}, per_token.detach()

    total_p, count_p, grads_p, per_token_p = loss_and_grads(packed, position_ids=packed["position_ids"], document_ids=packed["document_ids"])
    total_a, count_a, grads_a, _ = loss_and_grads(rows)
    assert count_p == count_a and count_p > 50
    torch.testing.assert_close(total_p, total_a, rtol=1e-5, atol=1e-4)
    for name in grads_p:
        torch.testing.assert_close(grads_p[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)
    *_, per_token_wrong = loss_and_grads(packed)  # without the per-document rule the losses differ
    assert ((per_token_wrong - per_token_p).abs() * packed["loss_mask"]).amax() > 1e-3


@pytest.mark.parametrize("argv, message", [
    ("--sft --tokenizer-type ByteTokenizer", "--sft needs --data-path FILE.jsonl"),
    ("--sft --mock-data", "--sft needs --data-path FILE.jsonl"),
    ("--sft --data-path missing.jsonl --tokenizer-type ByteTokenizer", "no such file"),
    ("--sft --data-path {jsonl} --tokenizer-type ByteTokenizer --sft-chat-template jinja", "must be one of auto, tokenizer, plain"),
    ("--sft --data-path {jsonl} --tokenizer-type ByteTokenizer --sft-chat-template tokenizer", "no chat_template"),
    ("--sft --data-path {jsonl} --tokenizer-type ByteTokenizer --model-type bert", "--sft fine-tunes decoders"),
    ("--sft --data-path {jsonl} --tokenizer-type ByteTokenizer --eod-mask-loss", "drop it"),
    ("--data-path {jsonl} --tokenizer-type ByteTokenizer", "add --sft"),
])  # fmt: skip
def test_sft_flags_are_checked(tmp_path, argv, message):
    jsonl = write_jsonl(tmp_path / "chat.jsonl", conversations(3))
    with pytest.raises(ConfigError, match=message):
        validate(build_config(None, shlex.split(argv.format(jsonl=jsonl))), world_size=1)
