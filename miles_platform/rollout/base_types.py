"""The types custom rollout code is written against, as in Miles' `miles/rollout/base_types.py`.

--custom-generate-function-path (one sample's generation), either form:
    async def generate(input: GenerateFnInput) -> GenerateFnOutput          (new form)
    async def generate(args, sample, sampling_params) -> Sample             (old form, adapted at load)

--rollout-function-path (the whole rollout):
    def generate_rollout(args, rollout_id, data_source, evaluation=False)
        -> RolloutFnTrainOutput | list[list[Sample]]                         (sync or async)
    or a class: __init__(self, input: RolloutFnConstructorInput), __call__(self, input: RolloutFnTrainInput)

`args` is an argparse.Namespace: every RunConfig field, the flags a function's `add_arguments`
registered, and where generate requests go (`sglang_router_ip`, `sglang_router_port`, Miles' names;
`api_key` is the run's bearer token). Post with `miles_platform.rollout.generate_hub.post`.
"""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass, field
from typing import Any

from miles_platform.data.sample import Sample


class AdapterName:
    """The engine-side adapter name a LoRA run's requests carry (`lora_path`): `<run>@v<N>` of the
    version the engines serve; None until the first adapter is loaded. One object per run, read at
    request time by the rollout client, the generate state, the session server and OPD."""

    def __init__(self, run: str):
        self.run, self.current = run, None

    def of(self, version: int) -> str:
        return f"{self.run}@v{int(version)}"

    def __repr__(self) -> str:
        return f"AdapterName({self.current!r})"


def resolve_lora(name) -> str | None:
    """`lora_path` for a request: an AdapterName's current name, or the string given."""
    return name.current if isinstance(name, AdapterName) else name


@dataclass(frozen=True)
class GenerateState:
    """What a generate function needs besides its sample: the run's args, tokenizer and engine."""

    args: Namespace
    tokenizer: Any
    url: str  # the router (or the only engine): post to f"{url}/generate"
    api_key: str | None
    # --rollout-top-k > 0 / --rollout-top-p < 1: ask for return_sampling_mask and record each
    # token's support (Sample.rollout_sampling_support); never for eval (as in Miles)
    sampling_support_replay: bool = False
    sampling_params: dict[str, Any] = field(default_factory=dict)  # the run's defaults
    # --lora-rank > 0: the run's AdapterName (above); `lora_path` is the name
    # of the version the engines serve now, to send with every request
    adapter: Any = None
    # --use-rollout-routing-replay: (num_layers, top_k) of the MoE model; `request_payload` asks for
    # `return_routed_experts` and `append_output` records them on the sample (never for eval)
    moe_shape: tuple[int, int] | None = None
    # --loss-type score_centering: K candidates per generated token; `request_payload` asks for them
    # and `append_output(..., topk=endpoint.topk_width(state, body))` records them (never for eval)
    rollout_top_logprobs_num: int = 0

    @property
    def lora_path(self) -> str | None:
        return None if self.adapter is None else self.adapter.current


@dataclass(frozen=True)
class GenerateFnInput:
    state: GenerateState
    sample: Sample  # prompt, prompt_tokens, label, metadata set; response fields empty
    sampling_params: dict[str, Any]  # max_new_tokens, temperature, top_p, top_k, stop, sampling_seed ...
    evaluation: bool = False

    @property
    def args(self) -> Namespace:
        return self.state.args


@dataclass(frozen=True)
class GenerateFnOutput:
    samples: Sample | list[Sample]


@dataclass(frozen=True)
class RolloutFnConstructorInput:
    args: Namespace
    data_source: Any  # miles_platform.data.source.RolloutDataSource


@dataclass(frozen=True)
class RolloutFnTrainInput:
    rollout_id: int

    @property
    def evaluation(self) -> bool:
        return False


@dataclass(frozen=True)
class RolloutFnEvalInput:
    rollout_id: int

    @property
    def evaluation(self) -> bool:
        return True


@dataclass
class RolloutFnEvalOutput:
    """What an --eval-function-path function returns (Miles'): per eval dataset a dict with
    "rewards" (a list; None counts as 0) and optionally "truncated" and "samples"."""

    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnTrainOutput:
    samples: list[list[Sample]]  # --rollout-batch-size groups of --n-samples-per-prompt samples
    metrics: dict[str, Any] | None = None
