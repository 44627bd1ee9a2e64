"""The trainer-side customization hooks (config/hooks.py), each loaded by its dotted path and called
with the arguments Miles documents: the pg-loss reducer (Dr.GRPO changes the loss by its formula)."""

from __future__ import annotations

import hook_fns
import pytest
import torch
from loop_helpers import small_run_kwargs

from miles_platform.config import ConfigError, RunConfig, parse_run_config
from miles_platform.plugins import load_hook
from miles_platform.preflight import validate_before_start
from miles_platform.training.loss import policy_loss_function

T = torch.tensor
REDUCER = "hook_fns.get_pg_loss_reducer"


def _batch() -> dict:
    """Two samples on-policy (ratio 1): pg per token = -A; the first one's last token masked."""
    return {
        "advantages": [T([1.0, 1.0, 1.0]), T([-2.0, -2.0])],
        "old_log_probs": [T([-1.0, -1.0, -1.0]), T([-0.5, -0.5])],
        "rollout_log_probs": [T([-1.0, -1.0, -1.0]), T([-0.5, -0.5])],
        "loss_masks": [T([1.0, 1.0, 0.0]), T([1.0, 1.0])],
        "total_lengths": [7, 5],
    }


def _loss(per_token: bool = False, reducer: str | None = None):
    args = RunConfig(
        rollout_batch_size=1, calculate_per_token_loss=per_token, custom_pg_loss_reducer_function_path=reducer
    )
    lp = [T([-1.0, -1.0, -1.0], requires_grad=True), T([-0.5, -0.5], requires_grad=True)]
    loss, m = policy_loss_function(args, _batch(), lp)
    loss.backward()
    return loss, m, [x.grad for x in lp]


def test_dr_grpo_reducer_divides_by_the_constant_not_the_token_count():
    hook_fns.CALLS.clear()
    base, base_m, base_grad = _loss()
    # the default: each sample's token mean, mean over samples: mean(-2 / 2, 4 / 2) = 0.5
    assert base.item() == pytest.approx(0.5)
    loss, m, grad = _loss(reducer=REDUCER)
    # Dr.GRPO: sum of (masked sum / 1000) over the micro-batch, over its 2 samples: (-2 + 4) / 1000 / 2
    assert loss.item() == pytest.approx(0.001) and m["pg_loss"].item() == pytest.approx(0.001)
    assert torch.allclose(grad[0], T([-0.0005, -0.0005, 0.0])) and torch.allclose(grad[1], T([0.001, 0.001]))
    assert torch.allclose(base_grad[0], T([-0.25, -0.25, 0.0]))  # 1 / 2 tokens / 2 samples
    # only pg_loss: the other metrics keep the default reduction (as Miles)
    assert m["ppo_kl"] == base_m["ppo_kl"] and m["pg_clipfrac"] == base_m["pg_clipfrac"]
    # called with Miles' positional arguments: total lengths, response lengths, per-token switch
    assert hook_fns.CALLS["reducer"] == [([7, 5], [3, 2], False)]


def test_per_token_reducer_is_divided_by_the_token_count():
    hook_fns.CALLS.clear()
    loss, _, _ = _loss(per_token=True, reducer=REDUCER)
    # the reducer's token sum (-2 + 4) over the micro-batch's 4 loss tokens = the built-in per-token mean
    assert loss.item() == pytest.approx(_loss(per_token=True)[0].item()) == pytest.approx(0.5)
    assert hook_fns.CALLS["reducer"][0][2] is True


def test_custom_tis_function_is_called_with_miles_signature_and_its_result_trained(
    tiny_hf_checkpoint, tmp_path
):
    hook_fns.CALLS.clear()
    args = RunConfig(rollout_batch_size=1, use_tis=True, custom_tis_function_path="hook_fns.custom_tis")
    lp = [T([-1.0, -1.0, -1.0], requires_grad=True), T([-0.5, -0.5], requires_grad=True)]
    loss, m = policy_loss_function(args, _batch(), lp)
    # pg per token -A, halved; first tokens out, denominators kept: mean(-0.5 / 2, 1 / 2) = 0.125
    assert loss.item() == pytest.approx(0.125) and m["my_tis_weight"].item() == pytest.approx(0.5)
    loss.backward()
    assert torch.allclose(lp[0].grad, T([0.0, -0.125, 0.0])) and torch.allclose(lp[1].grad, T([0.0, 0.25]))
    assert hook_fns.CALLS["tis"] == [([3, 2], [3, 2], [7, 5], [3, 2], ["max_seq_lens", "parallel_state"])]
    kw = small_run_kwargs(
        tiny_hf_checkpoint, tmp_path, use_tis=True, custom_tis_function_path="hook_fns.tis_two_args"
    )
    with pytest.raises(ConfigError, match=r"--custom-tis-function-path .*must take 1 positional"):
        validate_before_start(RunConfig(**kw).validate())  # before Ray starts


def test_hook_flags_are_checked_before_start():
    base = ["--rollout-batch-size", "2"]
    with pytest.raises(ConfigError, match="--custom-pg-loss-reducer-function-path.*--loss-type sft_loss"):
        parse_run_config(
            [*base, "--custom-pg-loss-reducer-function-path", REDUCER, "--loss-type", "sft_loss"]
        )
    with pytest.raises(ConfigError, match="megatron hooks.*--train-backend fsdp"):
        parse_run_config([*base, "--custom-megatron-post-save-hook-path", "hook_fns.megatron_post_save"])
    cfg = parse_run_config([*base, "--custom-pg-loss-reducer-function-path", "hook_fns.two_args"])
    with pytest.raises(ConfigError, match=r"must take 4 positional.*Miles calls it as get_pg_loss_reducer\("):
        load_hook(cfg, "custom_pg_loss_reducer_function_path")
    cfg.custom_pg_loss_reducer_function_path = "hook_fns.nope"
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        load_hook(cfg, "custom_pg_loss_reducer_function_path")
    cfg.rollout_data_postprocess_path = "hook_fns.postprocess_args_only"  # Miles' (args)
    assert load_hook(cfg, "rollout_data_postprocess_path") is hook_fns.postprocess_args_only
    cfg.rollout_data_postprocess_path = "hook_fns.postprocess_mask_first_token"  # (args, rollout_data)
    assert load_hook(cfg, "rollout_data_postprocess_path") is hook_fns.postprocess_mask_first_token


def _trained(ckpt, batch, **kw) -> dict[str, torch.Tensor]:
    from miles_platform.training.actor import TrainerActor

    cfg = RunConfig(hf_checkpoint=ckpt, rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4,
                    micro_batch_size=2, lr=1e-2, **kw).validate()  # fmt: skip
    actor = TrainerActor(cfg)
    actor.train(0, batch)
    return {k: v.detach().clone() for k, v in actor.backend.named_parameters()}


def test_rollout_data_postprocess_masks_are_what_the_step_trains(tiny_hf_checkpoint):
    """Miles' hook after the log-probs and advantages: masking each response's first token in the hook
    trains exactly as a batch masked that way from the start; Miles' args-only form is called too."""
    from loop_helpers import random_train_batch

    hook_fns.CALLS.clear()
    rewards = [1.0, 0.0, 0.0, 1.0]
    hooked = _trained(tiny_hf_checkpoint, random_train_batch(0, rewards),
                      rollout_data_postprocess_path="hook_fns.postprocess_mask_first_token")  # fmt: skip
    (args, sizes), = hook_fns.CALLS["postprocess"]  # fmt: skip
    assert args.rollout_data_postprocess_path and sizes["log_probs"] == sizes["advantages"] == 4
    premasked = random_train_batch(0, rewards)
    for m in premasked.loss_masks:
        m[0] = 0
    want = _trained(tiny_hf_checkpoint, premasked)
    plain = _trained(tiny_hf_checkpoint, random_train_batch(0, rewards))
    assert all(torch.equal(hooked[k], want[k]) for k in want)
    assert any(not torch.equal(hooked[k], plain[k]) for k in plain)
    _trained(tiny_hf_checkpoint, random_train_batch(0, rewards),
             rollout_data_postprocess_path="hook_fns.postprocess_args_only")  # fmt: skip
    assert len(hook_fns.CALLS["postprocess_args"]) == 1


def test_convert_samples_to_train_data_replaces_the_conversion():
    from miles_platform.data.sample import Sample
    from miles_platform.training.train_batch import TrainBatch, train_data

    samples = [
        Sample(
            prompt="p",
            prompt_tokens=[1, 2],
            response_tokens=[3, 4],
            loss_mask=[1, 1],
            raw_reward=r,
            reward=r,
            rollout_log_probs=[-0.1, -0.2],
            index=i,
        )  # fmt: skip
        for i, r in enumerate([1.0, 0.5])
    ]
    cfg = RunConfig(
        rollout_batch_size=1,
        custom_convert_samples_to_train_data_path="hook_fns.convert_samples_to_train_data",
    )
    hook_fns.CALLS.clear()
    got = train_data(cfg, samples)
    assert hook_fns.CALLS["convert"] == [(cfg, 2)]
    assert got.rewards == [2.0, 1.0] and TrainBatch.from_samples(samples).rewards == [1.0, 0.5]
    assert got.tokens == [[1, 2, 3, 4]] * 2 and got.loss_masks == [[1, 1]] * 2
    cfg.custom_convert_samples_to_train_data_path = "hook_fns.two_args"  # returns None
    with pytest.raises(ConfigError, match="returned a NoneType, not a dict"):
        train_data(cfg, samples)


def test_reward_post_process_replaces_the_group_normalization(tiny_hf_checkpoint):
    """--custom-reward-post-process-path: called with (args, samples); its rewards become GRPO's advantages
    as they are (Miles: the hook replaces the normalization), where the default normalizes per group."""
    from miles_platform.data.sample import Sample
    from miles_platform.preflight import check_hooks
    from miles_platform.training.actor import TrainerActor
    from miles_platform.training.train_batch import train_data

    kw = dict(
        hf_checkpoint=tiny_hf_checkpoint, rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=4
    )
    samples = [Sample(prompt_tokens=[5, 6, 7], response_tokens=[8, 9], loss_mask=[1, 1], rollout_log_probs=[-1.0, -1.0],
                      raw_reward=r, reward=r, group_index=i // 2, index=i) for i, r in enumerate([1.0, 0.0, 1.0, 1.0])]  # fmt: skip
    hook_fns.CALLS.clear()
    cfg = RunConfig(**kw, custom_reward_post_process_path="hook_fns.reward_post_process").validate()
    check_hooks(cfg)
    actor = TrainerActor(cfg)
    hooked = train_data(cfg, samples)
    assert hook_fns.CALLS["reward_post_process"] == [(4,)] and hooked.rewards_normalized
    adv, _ = actor._advantages(hooked, [0, 1, 2, 3], {}, None)
    assert [float(adv[i][0]) for i in range(4)] == [0.5, -0.5, 0.5, 0.5]
    plain = train_data(RunConfig(**kw).validate(), samples)
    adv, _ = actor._advantages(plain, [0, 1, 2, 3], {}, None)
    assert [round(float(adv[i][0]), 3) for i in range(4)] == [0.707, -0.707, 0.0, 0.0]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--custom-reward-post-process-path", "miles.rollout.on_policy_distillation.post_process_rewards"], "add --use-opd"),
        (["--custom-reward-post-process-path", "hook_fns.reward_post_process", "--loss-type", "sft_loss"], "trains on no reward"),
        (["--custom-reward-post-process-path", "hook_fns.reward_post_process",
          "--custom-convert-samples-to-train-data-path", "hook_fns.convert_samples_to_train_data"], "post-process the rewards there"),
    ],
)  # fmt: skip
def test_reward_post_process_is_refused_where_it_would_not_run(argv, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_run_config(["--rollout-batch-size", "2", *argv])
