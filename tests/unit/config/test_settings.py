"""The typed views of a RunConfig the reward hub and the evals read."""

from miles_platform.config import EvalSettings, RewardSettings, RunConfig


def test_reward_settings_mirror_the_flags_and_hand_user_functions_the_run():
    cfg = RunConfig(rollout_batch_size=2, rm_type="dapo", reward_key="score", seed=9, label_key="answer")
    r = cfg.reward_settings()
    assert (r.rm_type, r.reward_key, r.seed, r.label_key, r.eval_key) == (
        "dapo",
        "score",
        9,
        "answer",
        "score",
    )
    assert r.user_args is cfg and RewardSettings.of(cfg) == r and RewardSettings.of(r) is r
    assert RewardSettings(rm_type="math").user_args.rm_type == "math"  # no run: the settings themselves


def test_eval_settings_inherit_rollout_sampling_as_miles():
    cfg = RunConfig(rollout_batch_size=2, rm_type="math", rollout_temperature=0.7, rollout_top_k=5,
                    rollout_top_p=0.9, eval_top_p=1.0, eval_prompt_data=["a", "/a.jsonl", "b", "/b.jsonl"])  # fmt: skip
    e = cfg.eval_settings()
    assert isinstance(e, EvalSettings) and e.datasets == (("a", "/a.jsonl"), ("b", "/b.jsonl"))
    assert e.sampling == {"max_new_tokens": 32, "temperature": 0.7, "top_p": 1.0, "top_k": 5}
    assert e.label_key == "label" and e.rewards == cfg.reward_settings() and e.rewards.user_args is cfg


def test_pure_opd_evals_grade_answers_with_math():
    cfg = RunConfig(rollout_batch_size=2, use_opd=True, opd_type="sglang", rm_url="http://t:1/generate")
    assert cfg.reward_settings().pure_opd
    assert cfg.eval_settings().rewards == RewardSettings(rm_type="math")
