"""On-policy distillation (docs/opd.md): flags, the top-k token sets, teacher routing over real engines,
the advantage penalty in the trainer, and a student pulled toward what its teacher prefers."""

from __future__ import annotations

import math

import pytest
import torch

from miles_platform.config import ConfigError, RunConfig, parse_run_config
from miles_platform.data.sample import Sample
from miles_platform.models.checkpoint import load_hf_model, load_tokenizer, save_hf_checkpoint
from miles_platform.rollout import client as engine_client
from miles_platform.rollout.client import EngineClient
from miles_platform.rollout.engine_server import start_engine_server
from miles_platform.rollout.generate_hub.endpoint import append_output
from miles_platform.rollout.opd import TeacherRoutingError, TeacherScorer, route
from miles_platform.rollout.opd_topk import position_reverse_kl, selected_token_ids
from miles_platform.training.actor import TrainBatch, TrainerActor

KEY = "k"
PROMPTS = [[5, 9, 17], [22, 30, 41, 7], [3, 88, 12], [60, 61]]


# ----------------------------------------------------------------------------- flags


def _argv(*extra: str) -> list[str]:
    return ["--rollout-batch-size", "2", *extra]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--opd-kl-coef", "0.5"], "--opd-kl-coef: on-policy distillation flags; add --use-opd"),
        (["--use-opd"], "--use-opd needs --opd-type"),
        (["--use-opd", "--opd-type", "megatron"], "needs --opd-teacher-load"),
        (["--use-opd", "--opd-type", "sglang", "--rm-url", "http://h/generate", "--opd-teacher-load", "/t"],
         "--opd-teacher-load must not be set with --opd-type sglang"),
        (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/t", "--opd-teacher-urls", "a=http://h"],
         "sglang-mode OPD only"),
        (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/t", "--opd-log-prob-top-k", "4"],
         "sglang-mode OPD only"),
        (["--use-opd", "--opd-type", "sglang"], "needs a teacher"),
        (["--use-opd", "--opd-type", "sglang", "--opd-teacher-urls", "math"], "expected NAME=URL"),
        (["--use-opd", "--opd-type", "sglang", "--opd-teacher-urls", "a=http://x", "a=http://y"], "duplicate"),
        (["--use-opd", "--opd-type", "sglang", "--rm-url", "http://h", "--opd-top-k-strategy", "both"],
         "invalid choice"),
        (["--use-opd", "--opd-type", "sglang", "--rm-url", "http://h", "--opd-log-prob-top-k", "-1"], ">= 0"),
        (["--use-opd", "--opd-type", "sglang", "--rm-url", "http://h", "--rollout-top-k", "8"], "replay"),
        (["--use-opd", "--opd-type", "sglang", "--rm-url", "http://h", "--opd-teacher-ckpt-step", "3"],
         "--opd-teacher-ckpt-step"),
    ],
)  # fmt: skip
def test_opd_flags_are_checked_before_anything_starts(argv, match, capsys):
    with pytest.raises((ConfigError, SystemExit)) as e:
        parse_run_config(_argv(*argv))
    text = str(e.value) + capsys.readouterr().err
    assert match in text


def test_the_documented_opd_configurations_validate():
    sglang = parse_run_config(_argv("--use-opd", "--opd-type", "sglang", "--rm-url", "http://t:1/generate",
                                    "--opd-log-prob-top-k", "16", "--opd-top-k-strategy", "xor"))  # fmt: skip
    assert sglang.teacher_urls() == {"default": "http://t:1/generate"}
    routed = parse_run_config(_argv("--use-opd", "--opd-type", "sglang", "--rm-url", "http://ignored",
                                    "--opd-teacher-urls", "math=http://a/generate?x=1", "default=http://b"))  # fmt: skip
    assert routed.teacher_urls() == {
        "math": "http://a/generate?x=1",
        "default": "http://b",
    }  # --rm-url ignored
    assert (
        parse_run_config(_argv("--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/t")).opd_kl_coef
        == 1.0
    )


# ----------------------------------------------------------------------------- top-k sets (hand-built)

STUDENT = {1: math.log(0.6), 2: math.log(0.4)}  # student top-2 at one position
TEACHER = {2: math.log(0.5), 3: math.log(0.5)}  # teacher top-2
T_ON_S = {1: math.log(0.3), 2: math.log(0.5)}  # teacher scoring the student's ids
S_ON_T = {2: math.log(0.4), 3: math.log(0.2)}  # student scoring the teacher's ids


@pytest.mark.parametrize(
    "strategy, ids",
    [("only-student", [1, 2]), ("only-teacher", [2, 3]), ("intersection", [2]), ("union", [1, 2, 3]),
     ("xor", [1, 3])],
)  # fmt: skip
def test_each_top_k_strategy_selects_the_documented_set(strategy, ids):
    assert selected_token_ids(strategy, list(STUDENT), list(TEACHER)) == ids
    # the estimate with uniform weights is the mean log-ratio over exactly that set (xor: the sum)
    s = {**S_ON_T, **STUDENT}
    t = {**T_ON_S, **TEACHER}
    ratios = [s[x] - t[x] for x in ids]
    want = sum(ratios) if strategy == "xor" else sum(ratios) / len(ratios)
    assert position_reverse_kl(strategy, "none", STUDENT, TEACHER, T_ON_S, S_ON_T) == pytest.approx(want)


@pytest.mark.parametrize("mode, probs", [("student_p", (0.6, 0.4)), ("teacher_p", (0.3, 0.5))])
def test_top_k_weights_are_the_softmax_over_the_set(mode, probs):
    w = [p / sum(probs) for p in probs]
    want = w[0] * math.log(0.6 / 0.3) + w[1] * math.log(0.4 / 0.5)
    assert position_reverse_kl("only-student", mode, STUDENT, TEACHER, T_ON_S, S_ON_T) == pytest.approx(want)


# ----------------------------------------------------------------------------- real engines


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory, tiny_hf_checkpoint):
    """The tiny checkpoint's architecture with other random weights: a teacher that disagrees."""
    from miles_platform.models.qwen3 import build_model

    model = load_hf_model(tiny_hf_checkpoint)
    path = tmp_path_factory.mktemp("other") / "ckpt"
    return str(
        save_hf_checkpoint(build_model(model.config, seed=7), load_tokenizer(tiny_hf_checkpoint), path)
    )


@pytest.fixture(scope="module")
def engines(tiny_hf_checkpoint, other_checkpoint):
    student = start_engine_server(tiny_hf_checkpoint, api_key=KEY)
    other = start_engine_server(other_checkpoint, api_key=KEY)
    client = EngineClient(student.url, KEY)
    yield student, other, client
    client.close()
    student.stop()
    other.stop()


def _samples(url: str, top_k: int = 0, metadata=None, repeat: int = 1, seed: int = 0) -> list[Sample]:
    """Real rollouts of PROMPTS (each `repeat` times) from the engine at `url`."""
    params = {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True}
    prompts = PROMPTS * repeat
    outs = engine_client.post(url, "/generate", {"input_ids": prompts, "sampling_params": [
        {**params, "sampling_seed": seed * 1000 + i} for i in range(len(prompts))], "return_logprob": True,
        **({"top_logprobs_num": top_k} if top_k else {})}, api_key=KEY)  # fmt: skip
    samples = []
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        s = Sample(index=i, prompt_tokens=p, metadata=dict((metadata or [{}] * len(prompts))[i]))
        append_output(s, out, replay=False)
        samples.append(s)
    return samples


def _cfg(**kw) -> RunConfig:
    base = dict(rollout_batch_size=2, n_samples_per_prompt=2, api_key=KEY, use_opd=True, opd_type="sglang")
    return RunConfig(**{**base, **kw}).validate()


def _direct_scores(url: str, samples: list[Sample]) -> list[list[float]]:
    outs = engine_client.post(url, "/generate", {"input_ids": [s.tokens for s in samples],
        "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0}, api_key=KEY)  # fmt: skip
    return [[e[0] for e in o["meta_info"]["input_token_logprobs"][1:]][-s.response_length :]
            for o, s in zip(outs, samples, strict=True)]  # fmt: skip


def test_routing_sends_each_sample_to_the_teacher_its_metadata_names(engines):
    student, other, client = engines
    tags = [{"opd_teacher": "same"}, {"opd_teacher": "other"}, {}, {"opd_teacher": "physics"}]
    samples = _samples(student.url, metadata=tags)
    cfg = _cfg(
        opd_teacher_urls=[f"same={student.url}/generate", f"other={other.url}", f"default={other.url}"]
    )
    before = student.core.stats["num_scored_requests"], other.core.stats["num_scored_requests"]
    metrics = TeacherScorer(cfg, cfg.teacher_urls(), student.url, client).score(samples)
    by_same, by_other = _direct_scores(student.url, samples), _direct_scores(other.url, samples)
    assert samples[0].teacher_log_probs == pytest.approx(by_same[0], abs=1e-5)
    for i in (1, 2, 3):  # named "other"; no name and an unknown name fall back to default (= other)
        assert samples[i].teacher_log_probs == pytest.approx(by_other[i], abs=1e-5)
        assert samples[i].teacher_log_probs != pytest.approx(by_same[i], abs=1e-3)
    # one batched request per teacher, whatever the number of samples routed to it
    after = student.core.stats["num_scored_requests"], other.core.stats["num_scored_requests"]
    assert (after[0] - before[0], after[1] - before[1]) == (1 + 4, 3 + 4)  # + the direct scoring above
    assert metrics["opd/teacher_log_probs"] < 0


def test_routing_without_default_fails_loudly():
    urls = {"math": "http://m", "code": "http://c"}
    s = [Sample(index=0, metadata={"opd_teacher": "code"}), Sample(index=1, metadata={"opd_teacher": "math"})]
    assert route(s, urls, "opd_teacher") == {"http://c": [0], "http://m": [1]}
    assert route(s, {"code": "http://c", "default": "http://d"}, "opd_teacher") == {
        "http://c": [0],
        "http://d": [1],
    }
    with pytest.raises(TeacherRoutingError, match="names teacher 'physics'.*default"):
        route([Sample(index=3, metadata={"opd_teacher": "physics"})], urls, "opd_teacher")
    with pytest.raises(TeacherRoutingError, match="has no metadata key 'task'"):
        route([Sample(index=4)], urls, "task")


def test_top_k_reverse_kl_is_zero_for_an_identical_teacher_and_matches_a_forward_otherwise(
    engines, reference_lp
):
    student, other, client = engines
    for teacher, zero in ((student, True), (other, False)):
        samples = _samples(student.url, top_k=3)
        cfg = _cfg(rm_url=teacher.url, opd_log_prob_top_k=3, opd_top_k_strategy="union")
        TeacherScorer(cfg, cfg.teacher_urls(), student.url, client).score(samples)
        for s in samples:
            assert len(s.opd_reverse_kl) == s.response_length and s.rollout_topk_token_ids is None
            if zero:
                assert max(map(abs, s.opd_reverse_kl)) < 1e-5
            else:  # union of both top-3 sets, student_p weights, from plain forwards of both models
                ps, pt = reference_lp("student", s.tokens), reference_lp("other", s.tokens)
                want = []
                for p in range(len(s.prompt_tokens), len(s.tokens)):
                    ids = list(
                        dict.fromkeys(ps[p - 1].topk(3).indices.tolist() + pt[p - 1].topk(3).indices.tolist())
                    )
                    w = torch.softmax(ps[p - 1, ids], 0)
                    want.append(float((w * (ps[p - 1, ids] - pt[p - 1, ids])).sum()))
                assert s.opd_reverse_kl == pytest.approx(want, abs=1e-4)


@pytest.fixture(scope="module")
def reference_lp(tiny_hf_checkpoint, other_checkpoint):
    models = {"student": load_hf_model(tiny_hf_checkpoint), "other": load_hf_model(other_checkpoint)}

    def lp(name, ids):
        with torch.no_grad():
            return torch.log_softmax(models[name](input_ids=torch.tensor([ids])).logits[0].float(), -1)

    return lp


# ----------------------------------------------------------------------------- the trainer


def _train_once(ckpt: str, samples: list[Sample], rewards: list[float], **opd) -> tuple[dict, dict]:
    # SGD: the step is linear in the gradient (Adam's first step is sign(g): noise-level gradients flip)
    cfg = RunConfig(hf_checkpoint=ckpt, rollout_batch_size=2, n_samples_per_prompt=2, num_rollout=1, lr=1.0,
                    optimizer="sgd", weight_decay=0.0, rm_type="math", **opd).validate()  # fmt: skip
    for s, r in zip(samples, rewards, strict=True):
        s.raw_reward = r
    trainer = TrainerActor(cfg)
    metrics = trainer.train(0, TrainBatch.from_samples(samples))
    return trainer.get_hf_weights(), metrics


def test_an_identical_teacher_gives_zero_penalty_and_leaves_the_grpo_update_unchanged(
    engines, tiny_hf_checkpoint
):
    student, _, client = engines
    samples = _samples(student.url)
    rewards = [1.0, 0.0, 0.0, 1.0]
    w0 = load_hf_model(tiny_hf_checkpoint).state_dict()
    grpo, _ = _train_once(tiny_hf_checkpoint, samples, rewards)
    # sglang mode: the student's own engine scores its tokens
    cfg = _cfg(rm_url=student.url)
    TeacherScorer(cfg, cfg.teacher_urls(), student.url, client).score(samples)
    engine_teacher, m = _train_once(tiny_hf_checkpoint, samples, rewards, use_opd=True, opd_type="sglang",
                                    rm_url=student.url, api_key=KEY)  # fmt: skip
    assert abs(m["opd/reverse_kl"]) < 1e-6
    # megatron mode (here on the FSDP backend): the same checkpoint frozen in the trainer
    in_trainer, m2 = _train_once(tiny_hf_checkpoint, samples, rewards, use_opd=True, opd_type="megatron",
                                 opd_teacher_load=tiny_hf_checkpoint)  # fmt: skip
    assert m2["opd/reverse_kl"] == 0.0
    step = max((grpo[k] - w0[k]).abs().max().item() for k in grpo)
    assert step > 1e-3  # the GRPO step moved the weights ...
    for k in grpo:  # ... and the identical teacher changed nothing about it
        assert torch.equal(in_trainer[k], grpo[k]), k
        assert (engine_teacher[k] - grpo[k]).abs().max().item() < 1e-3 * step, k


def _prefers(ckpt: str, token: int, path, steps: int = 40) -> str:
    """The checkpoint trained a few steps to put its mass on `token` after any context: a teacher
    that prefers it (saved as an HF dir the engine serves)."""
    model, tok = load_hf_model(ckpt), load_tokenizer(ckpt)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, len(tok), (8, 12), generator=gen)
        loss = -torch.log_softmax(model(input_ids=ids).logits.float(), -1)[..., token].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return str(save_hf_checkpoint(model, tok, path))


def test_a_teacher_that_prefers_a_token_raises_the_students_log_prob_of_it(tiny_hf_checkpoint, tmp_path):
    """Pure OPD (reward 0) on real rollouts: generate -> teacher scores -> train -> new weights to the engine."""
    x = 42
    # a student that samples x now and then (~7%, else the signal is a rare event) and a teacher sure of it
    student_dir = _prefers(tiny_hf_checkpoint, x, tmp_path / "student", steps=9)
    teacher_dir = _prefers(tiny_hf_checkpoint, x, tmp_path / "teacher")
    student, teacher = (
        start_engine_server(student_dir, api_key=KEY),
        start_engine_server(teacher_dir, api_key=KEY),
    )
    client = EngineClient(student.url, KEY)
    try:

        def lp_of_x(url):  # mean log-prob of x after every response prefix of fresh rollouts
            samples = _samples(student.url)
            body = {"input_ids": [s.tokens for s in samples], "sampling_params": {"max_new_tokens": 0},
                    "return_logprob": True, "logprob_start_len": 1, "token_ids_logprob": [x]}  # fmt: skip
            outs = engine_client.post(url, "/generate", body, api_key=KEY)
            vals = [pos[0][0] for o in outs for pos in o["meta_info"]["input_token_ids_logprobs"]]
            return sum(vals) / len(vals)

        before, teacher_lp = lp_of_x(student.url), lp_of_x(teacher.url)
        assert teacher_lp > math.log(0.5) > before  # the teacher does prefer x; the student does not
        cfg = RunConfig(hf_checkpoint=student_dir, rollout_batch_size=32, n_samples_per_prompt=1,
                        num_rollout=8, lr=1e-2, weight_decay=0.0, micro_batch_size=32, use_opd=True,
                        opd_type="sglang", rm_url=teacher.url, api_key=KEY).validate()  # fmt: skip
        trainer, scorer = TrainerActor(cfg), TeacherScorer(cfg, cfg.teacher_urls(), student.url, client)
        kls = []
        for step in range(cfg.num_rollout):
            samples = _samples(student.url, repeat=8, seed=step + 1)
            scorer.score(samples)
            for s in samples:
                s.raw_reward = 0.0
            kls.append(trainer.train(step, TrainBatch.from_samples(samples))["opd/reverse_kl"])
            student.core.update_weights_from_tensors(trainer.get_hf_weights(), step + 1)
        after = lp_of_x(student.url)
        assert after > before + 1.0, (before, after, kls)
        assert kls[-1] < kls[0]  # and the student's reverse KL to the teacher fell
    finally:
        client.close()
        student.stop()
        teacher.stop()


MEGATRON_SCRIPT = """
import json, sys, torch
from miles_platform.config import RunConfig
from miles_platform.data.sample import Sample
from miles_platform.training.actor import TrainBatch, TrainerActor

ckpt, other = sys.argv[1], sys.argv[2]
gen = torch.Generator().manual_seed(0)
samples = [Sample(prompt_tokens=torch.randint(0, 100, (4,), generator=gen).tolist(),
                  response_tokens=torch.randint(0, 100, (5,), generator=gen).tolist(),
                  rollout_log_probs=[0.0] * 5, loss_mask=[1] * 5, raw_reward=r) for r in (1.0, 0.0, 0.0, 1.0)]
out = {}
for name, opd in (("grpo", {}), ("same", {"opd_teacher_load": ckpt}), ("other", {"opd_teacher_load": other})):
    if opd:
        opd = {"use_opd": True, "opd_type": "megatron", **opd}
    cfg = RunConfig(hf_checkpoint=ckpt, train_backend="megatron", rollout_batch_size=2, n_samples_per_prompt=2,
                    num_rollout=1, lr=1.0, optimizer="sgd", weight_decay=0.0, **opd).validate()
    trainer = TrainerActor(cfg)
    m = trainer.train(0, TrainBatch.from_samples(samples))
    w = trainer.get_hf_weights()
    out[name] = {"rkl": m.get("opd/reverse_kl"), "w": {k: v.flatten()[:64].tolist() for k, v in w.items()}}
print(json.dumps(out))
"""


def test_the_in_trainer_teacher_on_the_megatron_backend(tiny_hf_checkpoint, other_checkpoint):
    """--opd-type megatron on --train-backend megatron: the frozen teacher is used (a different one
    gives a reverse KL), and the same checkpoint as teacher leaves the GRPO step exactly as it was."""
    import json
    import os
    import subprocess
    from pathlib import Path

    from loop_helpers import warm_python

    repo = Path(__file__).resolve().parents[3]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
    proc = subprocess.run([*warm_python(), "-c", MEGATRON_SCRIPT, tiny_hf_checkpoint, other_checkpoint],
                          capture_output=True, text=True, env=env, timeout=300, cwd=repo)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["same"]["rkl"] == 0.0 and abs(out["other"]["rkl"]) > 1e-4  # two random tiny models: close
    assert out["same"]["w"] == out["grpo"]["w"]
    assert out["other"]["w"] != out["grpo"]["w"]
