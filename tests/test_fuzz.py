"""Property-based fuzzing (hypothesis, bounded examples): loaders, parsers and the engine's request
parser either accept an input or refuse it with the project's own error naming the problem; no
input makes them raise anything else (a traceback) or loop."""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_platform.data.dataset import load_prompt_dataset
from miles_platform.errors import CheckpointError, DataError, PublicationError
from miles_platform.models.checkpoint import _check_safetensors
from miles_platform.rollout.engine_core import EngineCore
from miles_platform.rollout.engine_requests import RequestError
from miles_platform.weights import delta_format

# derandomized: CI explores the same examples every run (no flaky red); raise max_examples locally to hunt
FAST = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12,
)


@FAST
@given(
    rows=st.lists(
        st.dictionaries(st.sampled_from(["prompt", "label", "id", "metadata", "x"]), json_values, max_size=5),
        max_size=5,
    ),
    junk=st.binary(max_size=40),
)
def test_prompt_dataset_loader_accepts_or_names_the_problem(tmp_path_factory, rows, junk):
    d = tmp_path_factory.mktemp("ds")
    for name, data in (
        ("rows.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode()),
        ("junk.jsonl", junk),
    ):
        p = d / name
        p.write_bytes(data)
        try:
            recs = load_prompt_dataset(str(p), input_key="prompt", label_key="label")
        except DataError as e:
            assert str(p) in str(e) or name in str(e)
        else:
            assert all(isinstance(r.prompt, str) and r.id for r in recs)
            assert len({r.id for r in recs}) == len(recs)


@FAST
@given(latest=st.binary(max_size=16), index=json_values | st.binary(max_size=40), version=st.integers(0, 3))
def test_publication_pointer_and_index_parsers_refuse_garbage(tmp_path_factory, latest, index, version):
    pub = tmp_path_factory.mktemp("pub")
    (pub / delta_format.LATEST).write_bytes(latest)
    try:
        v = delta_format.read_latest(pub)
        assert v is None or v >= 0
    except (PublicationError, UnicodeDecodeError) as e:
        assert isinstance(e, PublicationError), f"LATEST {latest!r}: {type(e).__name__}"
    vd = pub / delta_format.version_dir_name(version)
    vd.mkdir()
    (vd / delta_format.INDEX).write_bytes(index if isinstance(index, bytes) else json.dumps(index).encode())
    try:
        idx = delta_format.read_index(pub, version)
        assert idx["version"] == version
    except PublicationError:
        pass


@FAST
@given(head=st.binary(max_size=64), header=json_values, pad=st.integers(0, 64))
def test_safetensors_check_refuses_garbage(tmp_path_factory, head, header, pad):
    d = tmp_path_factory.mktemp("st")
    for i, data in enumerate([head, _fake_safetensors(header, pad)]):
        p = d / f"{i}.safetensors"
        p.write_bytes(data)
        try:
            _check_safetensors(p)
        except CheckpointError as e:
            assert str(p) in str(e)


def _fake_safetensors(header, pad: int) -> bytes:
    h = json.dumps(header).encode()
    return len(h).to_bytes(8, "little") + h + b"\0" * pad


@pytest.fixture(scope="module")
def core(tiny_hf_checkpoint):
    c = EngineCore(tiny_hf_checkpoint, num_threads=1)
    yield c
    c.stop()


body_keys = st.sampled_from(["input_ids", "text", "sampling_params", "rid", "return_logprob", "stream",
                             "return_sampling_mask", "min_weight_version", "bogus"])  # fmt: skip
sampling = st.dictionaries(
    st.sampled_from(["temperature", "top_p", "top_k", "min_p", "max_new_tokens", "stop", "stop_token_ids",
                     "sampling_seed", "n", "frequency_penalty", "zzz"]),
    json_scalars | st.lists(json_scalars, max_size=3), max_size=4,
)  # fmt: skip


@FAST
@given(
    body=st.dictionaries(body_keys, json_values, max_size=5),
    ids=st.lists(st.integers(-5, 70000), max_size=6)
    | st.lists(st.lists(st.integers(0, 60), max_size=4), max_size=3),
    sp=sampling | st.lists(sampling, max_size=3),
    text=st.text(string.printable, max_size=10),
)
def test_generate_body_parser_accepts_or_gives_a_400_message(core, body, ids, sp, text):
    for b in (body, {**body, "input_ids": ids, "sampling_params": sp}, {"text": text, "sampling_params": sp}):
        b = {k: v for k, v in b.items() if not (k == "text" and "input_ids" in b)}
        try:
            reqs, _ = core.request_parser.parse_body(b)
        except RequestError as e:
            assert str(e)
            continue
        for r in reqs:
            p = r.params
            assert p.temperature >= 0 and p.temperature == p.temperature  # never NaN (was silently greedy)
            assert 0 < p.top_p <= 1 and r.max_new_tokens >= 0 and r.prompt_ids
