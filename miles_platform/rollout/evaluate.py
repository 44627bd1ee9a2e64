"""Evaluate a policy on eval datasets: pass@1 (greedy), pass@k (unbiased, n samples), mean reward.

Metric names say how they were sampled (miles_platform/metric_names.py): `pass@1` is the greedy answer;
what n samples at temperature T give is `pass@<n>(T=<T>)` and `mean_reward@<n>(T=<T>)`.

Scoring uses the RL reward hub (`rm_hub.compute_rewards`), so an eval number and a training
reward mean the same thing. Generation runs on the embedded engine (`EngineCore`, in-process):
the same scheduler and sampler (rollout/sampling.py) as a rollout, each sample a seeded draw of
its own (`eval_requests`); a caller that owns engines passes `generate_fn` with the same
signature to route eval through them instead (`manager.router_generate_fn`, the same requests).

Image prompts (`multimodal_keys`, Miles' `--multimodal-keys` read as `train` reads them): a generate
function is then called with `images=` (per prompt its data URIs, or None) and sends them as
SGLang's `image_data` (`eval_image_data`); text datasets call it as before.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from miles_platform.config.reward import RewardSettings
from miles_platform.data.sample import Sample, Status
from miles_platform.metric_names import is_greedy_metric, sampled_name
from miles_platform.progress import Progress
from miles_platform.rollout.engine_core import EngineCore
from miles_platform.rollout.passrate import compute_pass_rate, pass_at_k

GenerateFn = Callable[..., list[list[str]]]


# ---------------------------------------------------------------- generation
EVAL_SEED_STRIDE = 1000003  # row k of an eval call draws with sampling_seed = seed * stride + k


def eval_requests(
    tok,
    prompts: Sequence[str],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    n: int,
    seed: int,
) -> tuple[list[list[int]], list[dict]]:
    """The engine requests of one eval generation: each prompt `n` times, as token ids without special
    tokens, row k drawing with its own seed (`seed * EVAL_SEED_STRIDE + k`), stopping at EOS. The
    in-process engine (`evaluate`'s own) and the run's engines (`manager.router_generate_fn`) both
    answer these, so a seed gives the same samples whichever computed the eval."""
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
              "stop_token_ids": [tok.eos_token_id]}  # fmt: skip
    encoded = tok(list(prompts), add_special_tokens=False)["input_ids"] if prompts else []  # one batch
    ids = [e for e in encoded for _ in range(n)]
    return ids, [{**params, "sampling_seed": seed * EVAL_SEED_STRIDE + k} for k in range(len(ids))]


def eval_image_data(images: Sequence[list[str] | None] | None, n: int) -> list | None:
    """`image_data` of `eval_requests`' batch: each prompt's images `n` times (None: no images)."""
    if not images or not any(images):
        return None
    return [imgs or None for imgs in images for _ in range(n)]


def engine_generate_fn(core: EngineCore, on_response: Callable[[int], Any] | None = None) -> GenerateFn:
    """`evaluate`'s generate function on an in-process `EngineCore`: the engine's scheduler and sampler
    (rollout/sampling.py: seeded per-row draws, top-k / top-p / min-p), one batch per call.
    `on_response(1)` after each response, in order (progress)."""

    def generate(prompts, max_new_tokens, temperature, top_p, top_k, n, seed, images=None):
        ids, params = eval_requests(
            core.tokenizer, prompts, max_new_tokens, temperature, top_p, top_k, n, seed
        )
        texts = []
        if ids:
            body = {"input_ids": ids, "sampling_params": params}
            image_data = eval_image_data(images, n)
            if image_data is not None:  # the engine expands each image's pad (rollout/engine_vlm.py)
                body["image_data"] = image_data
            futures, _ = core.submit_json(body)
            for f in futures:
                texts.append(f.result()["text"])
                if on_response is not None:
                    on_response(1)
        return [texts[i * n : (i + 1) * n] for i in range(len(prompts))]

    return generate


@contextlib.contextmanager
def policy_engine(policy: str | os.PathLike | EngineCore) -> Iterator[EngineCore]:
    """An `EngineCore` serving `policy`: a running one as it is (its owner stops it), or one started
    on an HF dir (an object-store export is downloaded first) and stopped on exit."""
    if isinstance(policy, EngineCore):
        yield policy
        return
    if not isinstance(policy, str | os.PathLike):
        raise TypeError(f"evaluate: policy is an HF dir or a running EngineCore, not {type(policy).__name__}")
    from miles_platform.store.remote import local_dir

    with local_dir(os.fspath(policy)) as d:  # the engine has loaded the weights when its constructor returns
        core = EngineCore(d)
    try:
        yield core
    finally:
        core.stop()


# ---------------------------------------------------------------- metrics
def load_eval_rows(
    path: str,
    input_key: str = "prompt",
    label_key: str = "label",
    metadata_key: str = "metadata",
    apply_chat_template: bool = False,
    tokenizer: Any | None = None,
    chat_template_kwargs: dict | None = None,
    multimodal_keys: dict[str, str] | None = None,
) -> list[dict]:
    """Eval prompts, read exactly like training prompts (same keys, same chat template, the
    images of `multimodal_keys` under "images" as data URIs)."""
    from miles_platform.data.dataset import load_prompt_dataset

    records = load_prompt_dataset(path, input_key, label_key, metadata_key, apply_chat_template, tokenizer,
                                  chat_template_kwargs=chat_template_kwargs,
                                  multimodal_keys=multimodal_keys)  # fmt: skip
    return [
        {"prompt": r.prompt, "label": r.label, "metadata": r.metadata, "images": r.images} for r in records
    ]


def _eval_sample(row: dict, r: str | Sample, gi: int, index: int) -> Sample:
    """The Sample to grade: a generate function's own (status, metadata such as tool_call_count
    kept) with the row's label and metadata, or one made from a response text."""
    meta = dict(row.get("metadata") or {})
    if isinstance(r, Sample):
        r.group_index, r.index, r.label = gi, index, row["label"]
        r.metadata = {**meta, **(r.metadata or {})}
        return r
    return Sample(group_index=gi, index=index, prompt=row["prompt"], response=r, label=row["label"],
                  metadata=meta, status=Status.COMPLETED.value)  # fmt: skip


def score(
    rewards: RewardSettings, rows: list[dict], responses: list[list[str]] | list[list[Sample]]
) -> list[list[float]]:
    """Rewards from the RL reward hub, one list per prompt."""
    from miles_platform.rollout.rm_hub import compute_rewards

    samples = [
        _eval_sample(row, r, gi, gi * len(resps) + j)
        for gi, (row, resps) in enumerate(zip(rows, responses, strict=True))
        for j, r in enumerate(resps)
    ]
    compute_rewards(rewards, samples)
    flat = [s.scalar_reward(rewards.eval_key) for s in samples]
    out, i = [], 0
    for resps in responses:
        out.append(flat[i : i + len(resps)])
        i += len(resps)
    return out


def greedy_pass_at_1(
    policy: str, eval_path: str, max_prompts: int | None = None, max_new_tokens: int = 8
) -> float:
    """Held-out greedy pass@1 of an HF dir on one eval file (`--rm-type math`): the number the
    learning tests, scripts and benches report."""
    res = evaluate(policy, [("eval", eval_path)], max_new_tokens=max_new_tokens, temperature=0.0,
                   max_prompts=max_prompts)  # fmt: skip
    return float(res["eval"]["pass@1"])


def evaluate(
    policy: str | EngineCore | None,
    datasets: list[tuple[str, str]],
    n_samples_per_eval_prompt: int = 1,
    max_new_tokens: int = 16,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    rm_type: str = "math",
    rewards: RewardSettings | None = None,
    seed: int = 0,
    generate_fn: GenerateFn | None = None,
    input_key: str = "prompt",
    label_key: str = "label",
    max_prompts: int | None = None,
    breakdown_key: str | None = "carry",
    metadata_key: str = "metadata",
    apply_chat_template: bool = False,
    tokenizer: Any | None = None,
    progress: bool = False,
    chat_template_kwargs: dict | None = None,
    log_passrate: bool = False,
    multimodal_keys: dict[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """name -> {"pass@1" (greedy), "pass@<n>(T=<T>)" (unbiased pass@k over n samples at
    `temperature`), "mean_reward@<n>(T=<T>)" (over the n samples), "n", "k", "num_prompts"} and,
    when rows carry metadata[breakdown_key], greedy accuracy per value ("pass@1/carry=True" ...).

    `policy` is an HF dir (served by an in-process `EngineCore` for the call) or a running
    `EngineCore`. `rewards` grade the answers (`cfg.reward_settings()`, `RewardSettings.of(flags)`);
    without them `rm_type` does.
    `generate_fn(prompts, max_new_tokens, temperature, top_p, top_k, n, seed) -> list[list[str]]`
    replaces the engine (e.g. the run's router; `policy` is then unused); it may answer Samples
    instead of texts (a custom generate function's, graded with their status; a multi-turn
    generator's add "tool_call_share": greedy episodes with >= 1 tool call). `input_key` ...
    `apply_chat_template` read the datasets as `train` reads prompts; the chat template is the
    policy's tokenizer's (or `tokenizer`'s, which a caller passing `generate_fn` must give).
    `progress`: a line on stderr every interval (responses generated of all datasets, ETA;
    miles_platform/progress.py). `multimodal_keys` ({"image": KEY}): the datasets' images, sent with
    their prompts (the policy must be a vision-language model).
    """
    if rewards is None:
        rewards = RewardSettings(rm_type=rm_type)
    with contextlib.ExitStack() as stack:
        core = None if generate_fn is not None else stack.enter_context(policy_engine(policy))
        tokenizer = core.tokenizer if core is not None and tokenizer is None else tokenizer
        k = n_samples_per_eval_prompt
        greedy_only = temperature is not None and temperature <= 0  # every sample is the greedy answer
        loaded = []  # every dataset read first: the progress total is every response to generate
        for name, path in datasets:
            rows = load_eval_rows(path, input_key, label_key, metadata_key, apply_chat_template, tokenizer,
                                  chat_template_kwargs, multimodal_keys)  # fmt: skip
            loaded.append((name, rows[:max_prompts]))
        total = sum(len(rows) * (1 + (0 if greedy_only else k)) for _, rows in loaded)
        bar = stack.enter_context(Progress("eval", total, unit="response", enabled=progress))
        generate = _counted(generate_fn, bar) if generate_fn else engine_generate_fn(core, bar.update)
        sampling = (max_new_tokens, temperature, top_p, top_k)
        return {
            name: _evaluate_rows(
                rows, generate, rewards, k, sampling, seed, breakdown_key, bar, name, log_passrate
            )
            for name, rows in loaded
        }


def _evaluate_rows(
    rows: list[dict], generate: GenerateFn, rewards: RewardSettings, k: int, sampling: tuple,
    seed: int, breakdown_key: str | None, bar: Progress, name: str, log_passrate: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """One dataset's metrics (see `evaluate`); `sampling`: (max_new_tokens, temperature, top_p, top_k)
    of the k samples."""
    max_new_tokens, temperature, _, _ = sampling
    bar.update(0, stage=name)
    prompts = [r["prompt"] for r in rows]
    images = [r.get("images") or None for r in rows]
    kw = {"images": images} if any(images) else {}  # text datasets: the generate function as before
    greedy_out = generate(prompts, max_new_tokens, 0.0, 1.0, -1, 1, seed, **kw)
    greedy = score(rewards, rows, greedy_out)
    if temperature is not None and temperature <= 0:  # every sample is the greedy answer
        sampled = [g * k for g in greedy]
    else:
        sampled = score(rewards, rows, generate(prompts, *sampling, k, seed, **kw))
    correct = [sum(1 for r in rs if r >= 1.0) for rs in sampled]
    res: dict[str, Any] = {
        "pass@1": sum(g[0] for g in greedy) / len(rows),
        sampled_name("pass", k, temperature): sum(pass_at_k(k, c, k) for c in correct) / len(rows),
        sampled_name("mean_reward", k, temperature): sum(map(sum, sampled)) / (len(rows) * k),
        "n": k,
        "k": k,
        "num_prompts": len(rows),
    }
    if log_passrate and k > 1:  # Miles' pass@1, 2, 4, ... of the k samples (loop_eval logs them)
        res["passrate"] = compute_pass_rate([r for rs in sampled for r in rs], k)
    share = tool_call_share(greedy_out)
    if share is not None:
        res["tool_call_share"] = share
    if breakdown_key and all(breakdown_key in (r.get("metadata") or {}) for r in rows):
        groups: dict[str, list[float]] = {}
        for r, g in zip(rows, greedy, strict=True):
            groups.setdefault(str(r["metadata"][breakdown_key]), []).append(g[0])
        for v, gs in sorted(groups.items()):
            res[f"pass@1/{breakdown_key}={v}"] = sum(gs) / len(gs)
    return res


def _counted(generate_fn: GenerateFn, bar: Progress) -> GenerateFn:
    """A caller's generate function, reporting its responses to `bar` after each call."""

    def generate(prompts, max_new_tokens, temperature, top_p, top_k, n, seed, **kw):
        out = generate_fn(prompts, max_new_tokens, temperature, top_p, top_k, n, seed, **kw)
        bar.update(len(prompts) * n)
        return out

    return generate


def tool_call_share(responses: list[list[Any]]) -> float | None:
    """Share of episodes with at least one tool call, when a multi-turn generate function made
    them (its Samples carry metadata.tool_call_count); None for plain texts."""
    flat = [r for rs in responses for r in rs]
    if not flat or not all(isinstance(r, Sample) and "tool_call_count" in r.metadata for r in flat):
        return None
    return sum(1 for r in flat if r.metadata["tool_call_count"] > 0) / len(flat)


EVAL_SOURCES = ("loop", "asset")  # writers of the `evals` table
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1}  # evaluate()'s one greedy answer per prompt


def evals_table_rows(
    partition_key: str, results: dict[str, dict[str, Any]], source: str, sampling: dict[str, Any]
) -> list[dict[str, Any]]:
    """`evals` table rows of one `evaluate` call: one per dataset x float metric, each naming its
    writer (`source`, one of EVAL_SOURCES) and the sampling that made it: `sampling` (max_new_tokens,
    temperature, top_p, top_k: EvalSettings.sampling's keys) with n samples for pass@k and mean
    reward; temperature 0, top_p 1, top_k -1 and one sample for the greedy metrics."""
    from miles_platform.store.paths import parse_partition_key

    if source not in EVAL_SOURCES:
        raise ValueError(f"evals source {source!r}: one of {EVAL_SOURCES}")
    _, version = parse_partition_key(partition_key)
    settings = {k: sampling[k] for k in ("temperature", "top_p", "top_k", "max_new_tokens")}

    def made_by(metric: str, n: int) -> dict[str, Any]:
        return (
            {"n_samples": 1, **settings, **GREEDY}
            if is_greedy_metric(metric)
            else {"n_samples": n, **settings}
        )

    return [
        {"version": version, "partition_key": partition_key, "dataset": name, "metric": metric,
         "value": float(value), "source": source, **made_by(metric, int(res["n"]))}
        for name, res in results.items()
        for metric, value in res.items()
        if isinstance(value, float)
    ]  # fmt: skip


# ---------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    """`miles-platform eval`: the dataset and reward flags are train's own (config.add_flags)."""
    from miles_platform.config import DATASET_FLAGS, REWARD_FLAGS, add_flags

    ap = argparse.ArgumentParser(
        allow_abbrev=False, prog="miles-platform eval", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--hf-checkpoint", required=True, help="HF dir of the policy: weights, config, tokenizer")
    ap.add_argument("--eval-prompt-data", nargs="+", required=True, metavar="NAME PATH",
                    help="one or more `name path` pairs (JSONL or Parquet, any fsspec URI)")  # fmt: skip
    add_flags(ap, ["n_samples_per_eval_prompt"])
    sampled = "of the sampled responses (pass@<n>(T=..), mean_reward@<n>(T=..); pass@1 is always greedy)"
    ap.add_argument("--eval-max-response-len", type=int, default=16,
                    help="max new tokens per response (default: %(default)s)")  # fmt: skip
    ap.add_argument("--eval-temperature", type=float, default=1.0,
                    help=f"temperature {sampled} (default: %(default)s)")  # fmt: skip
    ap.add_argument("--eval-top-p", type=float, default=1.0, help=f"top-p {sampled} (default: %(default)s)")
    ap.add_argument("--eval-top-k", type=int, default=-1,
                    help=f"top-k {sampled}; -1 disables (default: %(default)s)")  # fmt: skip
    add_flags(ap, REWARD_FLAGS, rm_type="math")
    add_flags(ap, DATASET_FLAGS, input_key="prompt", label_key="label")  # the normalized eval_dataset columns
    add_flags(ap, ["multimodal_keys"])  # image prompts (a vision-language policy)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    return ap


def cli_main(argv: list[str] | None = None) -> int:
    from miles_platform.rollout.rm_hub import validate_reward_config

    ap = build_parser()
    a = ap.parse_args(argv)
    if len(a.eval_prompt_data) % 2:
        ap.error(f"--eval-prompt-data takes NAME PATH pairs, got {a.eval_prompt_data}")
    rewards = RewardSettings.of(a)  # a --custom-rm-path function receives these flags, as in Miles
    validate_reward_config(rewards)
    from miles_platform.data.images import parse_multimodal_keys

    image_keys = parse_multimodal_keys(a.multimodal_keys)
    it = iter(a.eval_prompt_data)
    res = evaluate(
        a.hf_checkpoint,
        list(zip(it, it)),
        a.n_samples_per_eval_prompt,
        a.eval_max_response_len,
        a.eval_temperature,
        a.eval_top_p,
        a.eval_top_k,
        rewards=rewards,
        seed=a.seed,
        input_key=a.input_key,
        label_key=a.label_key,
        metadata_key=a.metadata_key,
        apply_chat_template=a.apply_chat_template,
        progress=True,
        multimodal_keys=image_keys,
    )
    if a.json:
        print(json.dumps(res))
    else:
        for name, m in res.items():
            print(
                f"eval/{name}: "
                + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in m.items())
            )
    return 0
