import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles_platform.data.dataset import (
    content_hash,
    load_prompt_dataset,
    normalized_label_key,
    read_normalized_dataset,
    write_normalized_dataset,
)
from miles_platform.errors import DataError


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [
    {"input": "1+1=", "label": "2", "metadata": {"rm_type": "math"}},
    {"input": "2+3=", "label": 5},
    {"input": "7*6=", "label": "42", "metadata": None},
]


def test_jsonl_keys_labels_metadata(tmp_path):
    recs = load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", ROWS), label_key="label")
    assert [r.prompt for r in recs] == ["1+1=", "2+3=", "7*6="]
    assert [r.label for r in recs] == ["2", "5", "42"]  # labels become strings
    assert recs[0].metadata == {"rm_type": "math"} and recs[2].metadata == {}
    assert len({r.id for r in recs}) == 3


def test_custom_keys_and_given_ids(tmp_path):
    rows = [
        {"id": 7, "question": "q1", "answer": "a", "info": {"k": 1}},
        {"id": "x", "question": "q2", "answer": "b"},
    ]
    recs = load_prompt_dataset(
        write_jsonl(tmp_path / "d.jsonl", rows), input_key="question", label_key="answer", metadata_key="info"
    )
    assert [(r.id, r.prompt, r.label, r.metadata) for r in recs] == [
        ("7", "q1", "a", {"k": 1}),
        ("x", "q2", "b", {}),
    ]


def test_derived_ids_stable_and_unique_for_duplicate_rows(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"input": "same"}, {"input": "same"}, {"input": "other"}])
    a, b = load_prompt_dataset(p), load_prompt_dataset(p)
    assert [r.id for r in a] == [r.id for r in b]
    assert len({r.id for r in a}) == 3 and a[1].id == a[0].id + "-1"


def test_duplicate_given_id_names_both_lines(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"id": 1, "input": "a"}, {"id": 1, "input": "b"}])
    with pytest.raises(DataError, match=r"d.jsonl:2: duplicate id '1' \(first at .*d.jsonl:1\)"):
        load_prompt_dataset(p)


def test_malformed_jsonl_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"input": "ok"}\n\n{"input": "broken"\n')
    with pytest.raises(DataError, match=r"bad.jsonl:3: malformed JSON"):
        load_prompt_dataset(str(p))


def test_missing_input_key_names_key_and_present_keys(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"input": "a"}, {"prompt": "b", "label": "1"}])
    with pytest.raises(
        DataError,
        match=r"d.jsonl:2: missing key 'input' \(--input-key\); keys present: \['label', 'prompt'\]",
    ):
        load_prompt_dataset(p)


def test_missing_label_key(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"input": "a", "answer": "1"}])
    with pytest.raises(
        DataError,
        match=r"d.jsonl:1: missing key 'label' \(--label-key\); keys present: \['answer', 'input'\]",
    ):
        load_prompt_dataset(p, label_key="label")


def test_empty_dataset(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n  \n")
    with pytest.raises(DataError, match="empty.jsonl: dataset is empty"):
        load_prompt_dataset(str(p))


def test_non_utf8_names_file_and_line(tmp_path):
    p = tmp_path / "latin.jsonl"
    p.write_bytes(b'{"input": "ok"}\n{"input": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin.jsonl:2: not valid UTF-8"):
        load_prompt_dataset(str(p))


def test_empty_prompt_and_list_prompt_without_template(tmp_path):
    with pytest.raises(DataError, match=r"d.jsonl:1: key 'input' must be a non-empty string"):
        load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", [{"input": "  "}]))
    with pytest.raises(DataError, match="pass --apply-chat-template"):
        load_prompt_dataset(
            write_jsonl(tmp_path / "m.jsonl", [{"input": [{"role": "user", "content": "hi"}]}])
        )


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_prompt_dataset(str(tmp_path / "nope.jsonl"))


class FakeTokenizer:
    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        self.calls.append((messages, tokenize, add_generation_prompt))
        body = "".join(f"<|{m['role']}|>{m['content']}" for m in messages)
        return body + ("<|assistant|>" if add_generation_prompt else "")


def test_apply_chat_template_wraps_user_message_or_takes_messages(tmp_path):
    rows = [
        {"input": "2+2="},
        {"input": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
    ]
    tok = FakeTokenizer()
    recs = load_prompt_dataset(
        write_jsonl(tmp_path / "d.jsonl", rows), apply_chat_template=True, tokenizer=tok
    )
    assert recs[0].prompt == "<|user|>2+2=<|assistant|>"
    assert recs[1].prompt == "<|system|>s<|user|>u<|assistant|>"
    assert tok.calls[0] == ([{"role": "user", "content": "2+2="}], False, True)
    with pytest.raises(DataError, match="needs a tokenizer"):
        load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", rows), apply_chat_template=True)


def test_parquet_source(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(
        pa.table({"question": ["a", "b"], "answer": ["1", "2"], "metadata": ['{"x": 1}', None]}), p
    )
    recs = load_prompt_dataset(f"file://{p}", input_key="question", label_key="answer")
    assert [(r.prompt, r.label, r.metadata) for r in recs] == [("a", "1", {"x": 1}), ("b", "2", {})]


def test_parquet_wrong_schema_names_missing_columns(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["a"]}), p)
    with pytest.raises(
        DataError, match=r"lacks column\(s\) \['input', 'label'\]; columns present: \['text'\]"
    ):
        load_prompt_dataset(str(p), label_key="label")


def test_normalize_round_trip_and_content_hash(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", ROWS)
    recs = load_prompt_dataset(src, label_key="label")
    out = tmp_path / "store" / "datasets" / "p" / "data.parquet"
    info = write_normalized_dataset(recs, str(out), label_key="label")
    assert info.rows == 3 and info.bytes == out.stat().st_size and info.content_hash == content_hash(recs)
    assert pq.read_schema(out).names == ["id", "prompt", "label", "metadata"]
    assert read_normalized_dataset(str(out)) == recs
    assert normalized_label_key(str(out)) == "label"
    # same rows from Parquet give the same hash; a changed label changes it
    again = load_prompt_dataset(str(out), input_key="prompt", label_key="label")
    assert content_hash(again) == info.content_hash
    recs[1].label = "6"
    assert content_hash(recs) != info.content_hash
    assert [p.name for p in out.parent.iterdir()] == ["data.parquet"]  # no temp file left
