"""The coloured-square task (diffusion/task.py) and the tiny DiT pipeline format (diffusion/model.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from miles_platform.diffusion import model, task
from miles_platform.errors import CheckpointError, DataError

ALL_PROMPTS = task.train_prompts() + task.eval_prompts()


def _other_quadrant(position: str) -> str:
    return next(p for p in task.POSITIONS if p != position)


def test_splits_hold_out_combinations_but_not_attributes():
    train, held_out = set(task.train_prompts()), set(task.eval_prompts())
    assert len(train) == 12 and len(held_out) == 4 and not train & held_out
    train_attrs = [task.parse_prompt(p) for p in train]
    assert {a["colour"] for a in train_attrs} == set(task.COLOURS)
    assert {a["position"] for a in train_attrs} == set(task.POSITIONS)


@pytest.mark.parametrize("prompt", ALL_PROMPTS)
def test_reward_sees_each_attribute(prompt):
    rng = np.random.default_rng(0)
    attrs = task.parse_prompt(prompt)
    right = task.render(attrs, rng)
    assert task.attribute_reward(prompt, right) == pytest.approx(1.0)
    assert task.attribute_reward(prompt, torch.from_numpy(right)) == pytest.approx(1.0)

    moved = task.render({**attrs, "position": _other_quadrant(attrs["position"])}, rng)
    checks = task.attribute_checks(prompt, moved)
    assert checks["reward"] < 0.05 and checks["position_ok"] < 0.05 and checks["colour_ok"] > 0.95

    for colour in task.COLOURS:
        if colour != attrs["colour"]:
            checks = task.attribute_checks(prompt, task.render({**attrs, "colour": colour}, rng))
            assert checks["reward"] < 0.05 and checks["colour_ok"] < 0.05 and checks["position_ok"] > 0.95


def test_reward_is_zero_for_blank_and_partial_for_smears():
    prompt = task.eval_prompts()[0]
    assert task.attribute_reward(prompt, np.full((3, 16, 16), -1.0, np.float32)) == 0.0
    assert task.attribute_reward(prompt, np.full((3, 16, 16), -0.6, np.float32)) == 0.0  # faint haze
    rng = np.random.default_rng(1)
    right = task.render(task.parse_prompt(prompt), rng)
    both = np.maximum(right, right[..., ::-1])  # the square and its mirror image: half the mass is right
    assert task.attribute_reward(prompt, both) == pytest.approx(0.5, abs=0.01)
    noisy = right + 0.1 * rng.standard_normal(right.shape).astype(np.float32)
    assert task.attribute_reward(prompt, noisy) > 0.95


def test_batched_rewards_match_single():
    rng = np.random.default_rng(2)
    prompts = [ALL_PROMPTS[i % len(ALL_PROMPTS)] for i in range(40)]
    images = rng.uniform(-1, 1, size=(40, 3, 16, 16)).astype(np.float32)
    batched = task.attribute_rewards(prompts, images)
    assert batched.shape == (40,)
    np.testing.assert_allclose(
        batched, [task.attribute_reward(p, im) for p, im in zip(prompts, images)], atol=1e-6
    )


def test_parse_errors_name_the_prompt():
    assert task.parse_prompt("A Blue square, bottom-right!") == {"colour": "blue", "position": "bottom right"}
    for bad in ("a square in the top left", "a red square on the left", "a red blue square in the top left"):
        with pytest.raises(ValueError, match=repr(bad)):
            task.parse_prompt(bad)


def test_png_round_trip():
    rng = np.random.default_rng(3)
    square = task.render(task.parse_prompt(ALL_PROMPTS[0]), rng)
    np.testing.assert_array_equal(task.from_png(task.to_png(square)), square)
    x = rng.uniform(-1, 1, size=(3, 16, 16)).astype(np.float32)
    back = task.from_png(task.to_png(x))
    assert back.shape == (3, 16, 16) and back.dtype == np.float32
    assert np.abs(back - x).max() <= 1 / 127.5 + 1e-6
    grid = task.from_png(task.image_grid(np.stack([x] * 5), nrow=4, scale=2))
    assert grid.shape == (3, 2 * (2 * 17 + 1), 2 * (4 * 17 + 1))


@pytest.mark.parametrize("rate", [0.0, 0.65])
def test_sft_mirror_error_rate(rate):
    prompts, images = task.sft_examples(2000, seed=4, error_rate=rate, error="mirror")
    assert images.shape == (2000, 3, 16, 16) and set(prompts) <= set(task.train_prompts())
    checks = [task.attribute_checks(p, im) for p, im in zip(prompts, images)]
    wrong = np.mean([c["position_ok"] < 0.5 for c in checks])
    assert abs(wrong - rate) < 0.035
    assert min(c["colour_ok"] for c in checks) == 1.0  # colours are always right
    # the wrong ones are mirrored: the square is in the right row, the other column
    assert all(c["reward"] in (0.0, 1.0) for c in checks)


@pytest.mark.parametrize("rate", [0.0, 0.65])
def test_sft_dim_error_rate_is_what_the_reward_sees(rate):
    """The default error: `rate` of the squares are dark (DIM_LEVEL); position always right; the
    reward gives a dark square a quarter, a full one 1."""
    prompts, images = task.sft_examples(2000, seed=4, error_rate=rate)
    checks = [task.attribute_checks(p, im) for p, im in zip(prompts, images)]
    assert min(c["position_ok"] for c in checks) > 0  # in the right quadrant
    dim = np.mean([c["reward"] < 0.5 for c in checks])
    assert abs(dim - rate) < 0.035
    assert sorted({round(c["reward"], 2) for c in checks}) == ([1.0] if rate == 0 else [0.25, 1.0])


def test_unknown_sft_error_is_refused():
    with pytest.raises(DataError, match="one of dim, mirror"):
        task.sft_examples(4, seed=0, error="blur")


def test_write_diffusion_data(tmp_path):
    paths = task.write_diffusion_data(tmp_path, seed=0, n_sft=64, n_train=48, n_eval=8)
    train = [json.loads(line) for line in open(paths["train"])]
    evals = [json.loads(line) for line in open(paths["eval"])]
    assert len(train) == 48 and len(evals) == 8
    assert {r["prompt"] for r in train} == set(task.train_prompts())  # every train prompt, equally often
    assert {r["prompt"] for r in evals} == set(task.eval_prompts())
    assert all(json.loads(r["label"]) == task.parse_prompt(r["prompt"]) for r in train + evals)
    prompts, images = task.read_sft_parquet(paths["sft"])
    ref_prompts, ref_images = task.sft_examples(64, 0)
    assert prompts == ref_prompts
    np.testing.assert_array_equal(images, ref_images)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left


def test_sigma_schedule():
    s = model.sigma_schedule(10, shift=3.0)
    assert s.shape == (11,) and s.dtype == torch.float32
    assert s[0] == 1.0 and s[-1] == 0.0 and bool((s[1:] < s[:-1]).all())
    assert s[5] > model.sigma_schedule(10, shift=1.0)[5]  # shift spends more steps at high noise


@pytest.fixture(scope="module")
def saved_pipeline(tmp_path_factory):
    enc = model.PromptEncoder(seed=5)
    pipe = model.DiTPipeline(model.build_tiny_dit(5, enc), enc, flow_shift=2.0)
    path = tmp_path_factory.mktemp("pipe") / "base"
    model.save_pipeline(pipe, path)
    return pipe, path


def _velocity(pipe: model.DiTPipeline) -> torch.Tensor:
    prompts = task.eval_prompts()
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    cond, pooled = pipe.text_encoder(prompts)
    with torch.no_grad():
        return model.velocity(pipe.transformer, x, torch.tensor([0.9, 0.5, 0.3, 0.1]), cond, pooled)


def test_pipeline_round_trip_is_bit_identical(saved_pipeline):
    pipe, path = saved_pipeline
    index = json.loads((path / "model_index.json").read_text())
    assert (index["_class_name"], index["task"], index["family"]) == (
        "MilesTinyDiTPipeline",
        "t2i",
        "tiny_dit",
    )
    loaded = model.load_pipeline(path)
    assert loaded.flow_shift == 2.0
    assert not any(p.requires_grad for p in loaded.text_encoder.parameters())
    v = _velocity(pipe)
    assert v.shape == (4, 3, 16, 16) and v.abs().max() > 0
    assert torch.equal(_velocity(loaded), v)
    other = model.build_tiny_dit(6, pipe.text_encoder)
    assert not torch.equal(_velocity(model.DiTPipeline(other, pipe.text_encoder)), v)  # the check can fail
    a = model.sample_ode(loaded, task.eval_prompts(), seed=1, num_steps=2)
    assert torch.equal(a, model.sample_ode(pipe, task.eval_prompts(), seed=1, num_steps=2))
    assert a.min() >= -1 and a.max() <= 1


@pytest.mark.parametrize(
    "missing", ["transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"]
)
def test_incomplete_pipeline_is_refused(saved_pipeline, tmp_path, missing):
    import shutil

    _, path = saved_pipeline
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (broken / missing).unlink()
    with pytest.raises(CheckpointError, match=f"{broken}.*{missing}"):
        model.load_pipeline(broken)


def test_corrupt_weights_are_refused(saved_pipeline, tmp_path):
    import shutil

    _, path = saved_pipeline
    broken = tmp_path / "corrupt"
    shutil.copytree(path, broken)
    (broken / "text_encoder" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=str(broken)):
        model.load_pipeline(broken)
