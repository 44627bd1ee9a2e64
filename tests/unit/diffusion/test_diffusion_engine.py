"""The diffusion engine over loopback HTTP and the trainer that re-scores its trajectories.

The contract of Flow-GRPO: before any optimizer step the trainer's log-prob of every recorded
x_t -> x_{t+1} transition equals the engine's (ratio 1) up to forward-precision noise, for each SDE
type; the dtype contract keeps fp32 only where the family's rules say.
"""

import httpx
import pytest
import torch

from miles_platform.data.dataset import PromptRecord
from miles_platform.diffusion import task
from miles_platform.diffusion.config import parse_diffusion_config
from miles_platform.diffusion.engine import decode_outputs, start_diffusion_engine
from miles_platform.diffusion.family import TINY_DIT, dit_forward
from miles_platform.diffusion.model import DiTPipeline, PromptEncoder, build_tiny_dit, save_pipeline
from miles_platform.diffusion.rollout import DiffusionRollout
from miles_platform.diffusion.trainer import DiffusionTrainer
from miles_platform.errors import ConfigError

KEY = "test-secret"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A fresh (untrained) tiny DiT: the contract holds for any weights, trained or not."""
    enc = PromptEncoder(seed=0)
    path = tmp_path_factory.mktemp("dit") / "base"
    save_pipeline(DiTPipeline(build_tiny_dit(0, enc), enc, 1.0), path)
    return str(path)


def _cfg(base, *extra, dtype="fp32", sde="sde", loss="policy_loss"):
    args = ["--hf-checkpoint", base, "--diffusion-task", "t2i", "--prompt-data", "unused.jsonl",
            "--rollout-batch-size", "3", "--n-samples-per-prompt", "4", "--num-rollout", "1",
            "--rollout-microgroup-size", "3", "--diffusion-debug-mode", "--debug-skip-optimizer-step",
            "--diffusion-forward-dtype", dtype, "--sglang-dit-precision", dtype, "--diffusion-sde-type", sde,
            "--loss-type", loss, "--micro-batch-size", "5", *extra]  # fmt: skip
    if loss == "policy_loss":
        args += ["--diffusion-step-strategy-path", "sde_window", "--diffusion-num-sde-steps", "4"]
    return parse_diffusion_config(args)


def _records(n=3):
    return [
        PromptRecord(id=str(i), prompt=p, label=None, metadata={})
        for i, p in enumerate(task.train_prompts()[:n])
    ]


def _step0(base, dtype, sde, engine_dtype=None):
    cfg = _cfg(base, dtype=dtype, sde=sde)
    srv = start_diffusion_engine(base, api_key=KEY, dit_precision=engine_dtype or dtype)
    try:
        ro = DiffusionRollout(cfg, srv.url, KEY)
        samples, traj, _ = ro.generate(0, _records(), "t")
        ro.close()
    finally:
        srv.stop()
    metrics = DiffusionTrainer(cfg).train(0, traj.to_dict())
    return samples, traj, metrics


@pytest.mark.parametrize("sde", ["sde", "cps"])
def test_trainer_rescoring_matches_the_engine_at_step_0_in_fp32(base, sde):
    samples, traj, m = _step0(base, "fp32", sde)
    assert traj.log_probs.shape == (12, 4) and traj.latents.shape == (12, 4, 3, 16, 16)
    assert traj.log_probs.abs().min() > 0  # real densities, not the zeros of ODE steps
    assert m["train/log_prob_mean_abs_diff"] < 1e-6, m
    assert m["train/ratio_abs_minus_1"] < 1e-6, m
    assert m["train/model_output_max_abs_diff"] < 1e-5, m
    # the shard rows carry the engine's per-step log-probs and a decodable PNG
    assert samples[0].diffusion_log_probs == pytest.approx(traj.log_probs[0].double().tolist())
    assert task.from_png(samples[0].image_png).shape == (3, 16, 16)


def test_ode_trajectories_replay_exactly_in_the_trainer_forward(base):
    """ODE (NFT's dynamics) has no log-prob; what must agree is the DiT forward on the recorded states."""
    cfg = _cfg(
        base,
        "--use-ema",
        "--rollout-weights",
        "ema",
        "--rollout-return-full-trajectory",
        sde="ode",
        loss="nft",
    )
    srv = start_diffusion_engine(base, api_key=KEY)
    try:
        ro = DiffusionRollout(cfg, srv.url, KEY)
        _, traj, _ = ro.generate(0, _records(2), "t")
        ro.close()
    finally:
        srv.stop()
    trainer = DiffusionTrainer(cfg)
    cond, pooled = trainer.text_encoder(traj.prompts)
    k = traj.latents.shape[1]
    for i in range(k):
        v = dit_forward(trainer.model, traj.latents[:, i], traj.sigmas[:, i], cond, pooled, "fp32", TINY_DIT)
        assert (v - traj.model_output[:, i]).abs().max() < 1e-5
        # the Euler step itself: x_{t+1} = x_t + (sigma_next - sigma) v
        dt = (traj.next_sigmas[:, i] - traj.sigmas[:, i]).view(-1, 1, 1, 1)
        assert torch.allclose(
            traj.next_latents[:, i], traj.latents[:, i] + dt * traj.model_output[:, i], atol=1e-6
        )


def test_bf16_contract_agrees_and_a_mismatched_engine_shows_in_the_ratio(base):
    """The bf16 contract: engine DiT at bf16 with the rule parameters kept fp32, trainer FSDP2 gather
    bf16 with the same per-parameter map, autocast on both, one `dit_forward`: on CPU the two
    forwards are the same kernels, so the ratio is 1. An engine at bf16 re-scored by an fp32 trainer
    (the pairing --diffusion-forward-dtype != --sglang-dit-precision refuses) is off by rounding."""
    _, _, aligned = _step0(base, "bf16", "sde")
    assert aligned["train/ratio_abs_minus_1"] < 1e-3, aligned
    _, _, mixed = _step0(base, "fp32", "sde", engine_dtype="bf16")
    assert mixed["train/model_output_mean_abs_diff"] > 1e-4, mixed
    assert mixed["train/ratio_abs_minus_1"] > 10 * aligned["train/ratio_abs_minus_1"] + 1e-4, (mixed, aligned)


def test_microgroups_are_one_rng_stream_per_sample(base):
    """Miles' seed layout: a request's seed expands to seed, seed+1, ...; a group split into
    microgroups of 2 (seeds s, s+2) yields exactly the images of one request of 4 (seed s)."""
    srv = start_diffusion_engine(base, api_key=KEY)
    sp = {"num_inference_steps": 4, "sde_steps": [0, 1, 2], "return_steps": [1]}
    prompt = task.train_prompts()[0]
    try:

        def post(reqs):
            r = httpx.post(f"{srv.url}/rollout/generate", json={"requests": reqs},
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=60)  # fmt: skip
            assert r.status_code == 200 and r.headers["content-type"] == "application/msgpack"
            return decode_outputs(r.content)

        whole = post([{"prompt": prompt, "num_outputs_per_prompt": 4, "seed": 100, "sampling_params": sp}])
        split = post(
            [
                {"prompt": prompt, "num_outputs_per_prompt": 2, "seed": s, "sampling_params": sp}
                for s in (100, 102)
            ]
        )
        assert whole[0]["meta_info"]["seeds"] == [100, 101, 102, 103]
        assert torch.equal(whole[0]["images"], torch.cat([o["images"] for o in split]))
        assert torch.equal(whole[0]["log_probs"], torch.cat([o["log_probs"] for o in split]))
        other = post([{"prompt": prompt, "num_outputs_per_prompt": 1, "seed": 104, "sampling_params": sp}])
        assert not torch.equal(other[0]["images"][0], whole[0]["images"][0])
    finally:
        srv.stop()


def test_engine_endpoints_need_the_secret_and_refuse_bad_requests(base, tmp_path):
    srv = start_diffusion_engine(base, api_key=KEY, weight_roots=[str(tmp_path)])
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "a red square in the top left", "sampling_params": {"num_inference_steps": 2}}
    try:
        assert httpx.get(f"{srv.url}/health").status_code == 200  # liveness only
        assert httpx.post(f"{srv.url}/rollout/generate", json=body).status_code == 401
        assert httpx.get(f"{srv.url}/get_model_info").status_code == 401
        bad = dict(body, sampling_params={"num_inference_steps": 2, "temperature": 1.0})
        r = httpx.post(f"{srv.url}/rollout/generate", json=bad, headers=auth)
        assert r.status_code == 400 and "temperature" in r.text
        r = httpx.post(
            f"{srv.url}/rollout/generate", json=dict(body, sampling_params={"height": 64}), headers=auth
        )
        assert r.status_code == 400 and "16x16" in r.text
        r = httpx.post(f"{srv.url}/update_weights_from_disk", json={"model_path": base}, headers=auth)
        assert r.status_code == 403  # outside the run's weight roots
        info = httpx.get(f"{srv.url}/get_model_info", headers=auth).json()
        assert info["family"] == "tiny_dit" and info["weight_version"] == 0
    finally:
        srv.stop()


def test_bf16_dtype_census_keeps_fp32_only_where_the_rules_say(base):
    cfg = _cfg(base, dtype="bf16")
    trainer = DiffusionTrainer(cfg)
    census = trainer.dtype_census()
    assert census["master_weights"] == {"fp32": sum(census["master_weights"].values())}
    # gather dtype: fp32 exactly for the family's rule parameters (timestep embedder, final modulation)
    gathered = trainer.model.precision_plan.param_dtype
    fp32_params = sorted(n for n, d in gathered.items() if d == "fp32")
    assert fp32_params and all(
        n.startswith(("time_text_embed.timestep_embedder.", "norm_out.linear.")) for n in fp32_params
    )
    assert {d for n, d in gathered.items() if n not in fp32_params} == {"bf16"}
    # activations: fp32 only on the timestep path (input_dtype_policy passes it through, as sglang-d
    # feeds it); autocast runs every matmul, the rule modules' too, at bf16
    fp32_modules = sorted(m for m, io in census["modules"].items() if "fp32" in io["in"] + io["out"])
    assert fp32_modules == ["<root>", "time_text_embed", "time_text_embed.time_proj"], fp32_modules
    assert census["activations"].get("bf16", 0) > 5 * census["activations"].get("fp32", 0), census[
        "activations"
    ]


@pytest.mark.parametrize(
    ("extra", "msg"),
    [
        (["--diffusion-sde-type", "ode"], "Flow-GRPO needs stochastic"),
        (["--diffusion-forward-dtype", "bf16"], "--sglang-dit-precision"),
        (["--diffusion-guidance-scale", "4.0"], "classifier-free guidance"),
        (["--loss-type", "nft"], "--use-ema"),
        (["--diffusion-nft-beta", "0.5"], "nft only"),
    ],
)
def test_contradictory_flags_are_refused_at_parse_time(base, extra, msg):
    with pytest.raises(ConfigError, match=msg):
        _cfg(base, *extra)


def test_preflight_checks_strategy_flags_and_prompts_before_anything_starts(base, tmp_path):
    from miles_platform.diffusion.loop import preflight
    from miles_platform.store.paths import StoragePaths

    data = task.write_diffusion_data(tmp_path / "data", n_sft=8)
    root = tmp_path / "root"
    cfg = _cfg(base, "--diffusion-sde-window-range", "6,2", "--prompt-data", data["train"])
    with pytest.raises(ConfigError, match="--diffusion-sde-window-range"):
        preflight(cfg, StoragePaths(str(root)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a cat on a mat"}\n')
    with pytest.raises(ConfigError, match="--prompt-data.*cat on a mat"):
        preflight(_cfg(base, "--prompt-data", str(bad)), StoragePaths(str(root)))
    assert not root.exists()
