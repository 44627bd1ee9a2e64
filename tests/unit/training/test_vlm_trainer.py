"""A vision-language train step on the fsdp backend (in-process TrainerActor, models/vlm.py): the
engine's image samples score within 1e-3 of the engine in fp32, the images count, the vision tower
trains unless --freeze-vision-tower."""

from __future__ import annotations

import pytest
import torch
from loop_helpers import square_image_uri

from miles_platform.config import RunConfig
from miles_platform.models import vlm
from miles_platform.training.actor import TrainerActor
from miles_platform.training.train_batch import TrainBatch


def _uri(color) -> str:
    return square_image_uri(color, 32, (6, 6, 22, 22))


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """The tiny VLM and 4 engine samples of 2 image prompts (and their images)."""
    from miles_platform.rollout.engine_core import EngineCore

    path = vlm.save_tiny_vlm_checkpoint(tmp_path_factory.mktemp("vl") / "tiny-vl")
    core = EngineCore(path)
    try:
        images = [_uri((255, 0, 0)), _uri((0, 0, 255))]
        prompt = core.tokenizer(f"{vlm.VISION_START}{vlm.IMAGE_PAD}{vlm.VISION_END}How many?")["input_ids"]
        sp = [
            {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": s, "ignore_eos": True}
            for s in range(4)
        ]
        body = {"input_ids": [prompt] * 4, "image_data": [[images[i // 2]] for i in range(4)],
                "sampling_params": sp, "return_logprob": True}  # fmt: skip
        futures, _ = core.submit_json(body)
        outs = [f.result(60) for f in futures]
    finally:
        core.stop()
    return path, prompt, images, outs


def _batch(rollout, swap: bool = False) -> TrainBatch:
    _, prompt, images, outs = rollout
    toks = [prompt + o["output_ids"] for o in outs]
    lps = [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]
    imgs = [[images[(i // 2 + swap) % 2]] for i in range(4)]
    return TrainBatch(toks, [4] * 4, [[1] * 4] * 4, [1.0, 0.0, 0.0, 1.0], lps, images=imgs)


def _actor(path, save, **kw) -> TrainerActor:
    cfg = RunConfig(hf_checkpoint=path, rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4,
                    lr=1e-2, save=save, num_rollout=2, micro_batch_size=2, multimodal_keys='{"image": "images"}',
                    **kw)  # fmt: skip
    return TrainerActor(cfg.validate())


def _split(weights):
    vis = {k: v.clone() for k, v in weights.items() if ".visual." in f".{k}"}
    return vis, {k: v.clone() for k, v in weights.items() if k not in vis}


@pytest.mark.parametrize("freeze", [False, True])
def test_vlm_step_matches_engine_logprobs_and_trains(rollout, tmp_path, freeze):
    path = rollout[0]
    actor = _actor(path, str(tmp_path / "ck"), freeze_vision_tower=freeze)
    vis0, text0 = _split(actor.get_hf_weights())
    assert vis0 and text0
    m = actor.train(0, _batch(rollout))
    assert m["train/train_rollout_logprob_abs_diff"] < 1e-3  # --ci-test's trainer-vs-engine check, fp32
    assert abs(m["train/step0_ppo_kl"]) < 1e-6
    vis1, text1 = _split(actor.get_hf_weights())
    assert any(not torch.equal(text0[k], text1[k]) for k in text0)
    vis_moved = any(not torch.equal(vis0[k], vis1[k]) for k in vis0)
    assert vis_moved is not freeze


def test_the_trainer_sees_the_images(rollout, tmp_path):
    """The same tokens with each prompt's image swapped score away from the engine."""
    m = _actor(rollout[0], str(tmp_path / "ck")).train(0, _batch(rollout, swap=True))
    assert m["train/train_rollout_logprob_abs_diff"] > 1e-3


def test_miles_platform_sft_trains_on_image_rows(rollout, tmp_path, capsys):
    """`miles-platform sft --multimodal-keys`: image + text rows (JSONL, data URIs) train a VLM through
    the RL trainer; the saved dir loads with its image processor and puts more probability on the
    response given its image; a bad image names its file and line; --from-scratch is refused."""
    import json

    from miles_platform.data.images import from_data_uri
    from miles_platform.errors import DataError, MilesError
    from miles_platform.models.checkpoint import load_hf_checkpoint
    from miles_platform.training.sft import cli_main

    path, _, images, _ = rollout
    data = tmp_path / "sft.jsonl"
    rows = [{"prompt": "How many shapes are in <image>?", "response": f" {i % 2 + 1}", "images": [images[i % 2]]}
            for i in range(4)]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--hf-checkpoint", path, "--prompt-data", str(data), "--save", str(tmp_path / "out"),
            "--multimodal-keys", '{"image": "images"}', "--train-iters", "3", "--global-batch-size", "4",
            "--micro-batch-size", "4", "--lr", "1e-2", "--lr-warmup-iters", "0", "--json"]  # fmt: skip
    assert cli_main(argv) == 0
    assert json.loads(capsys.readouterr().out)["num_samples"] == 4

    def nll(hf_dir) -> float:  # of row 0's response with its image
        model, tok = load_hf_checkpoint(hf_dir)
        v = vlm.PromptVision(hf_dir)
        p = v.expand(
            tok.encode(f"How many shapes are in {vlm.VISION_START}{vlm.IMAGE_PAD}{vlm.VISION_END}?"),
            [images[0]],
        )
        ids = torch.tensor([p + tok.encode(" 1") + [tok.eos_token_id]])
        px = vlm.process_images(v.processor, [from_data_uri(images[0])])
        with torch.no_grad():
            return -float(vlm.token_logprobs(vlm.vlm_logits(model, ids, **px), ids, len(p)).sum())

    assert nll(tmp_path / "out") < nll(path) - 0.5
    data.write_text(json.dumps({**rows[0], "images": ["data:image/png;base64,aGVsbG8="]}) + "\n")
    with pytest.raises(DataError, match=r"sft.jsonl:1: key 'images' image 0: not a readable image"):
        cli_main(argv)
    with pytest.raises(MilesError, match="not --from-scratch"):
        cli_main(["--from-scratch", *argv[2:]])
