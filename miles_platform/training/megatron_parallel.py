"""Megatron model parallelism without transformer-engine: the layout (Miles' flags), the local
layer spec with a norm that supports sequence parallelism, and the model chunks of this rank.

Layout: `--tensor-model-parallel-size` (TP), `--sequence-parallel` (SP), `--pipeline-model-parallel-size`
(PP) with `--num-layers-per-virtual-pipeline-stage` (interleaved PP) or
`--decoder-first/last-pipeline-num-layers` (uneven PP), `--expert-model-parallel-size` (EP) and
`--expert-tensor-parallel-size` (ETP), `--context-parallel-size` (CP: megatron_cp.py's attention in the
local spec). megatron's rank order is tp-cp-ep-dp-pp: TP ranks are
consecutive, so with Miles' placement (`--actor-num-gpus-per-node` ranks per node) a TP group sits
inside a node. Data parallel = world / (TP x PP x CP).

Layer specs: the bridge's, per decoder layer (`decoder_layer_specs`: an MoE model whose config has a
`moe_layer_freq` list gets its dense layers' spec without experts, DeepSeek-V3's first layers), sliced
per (virtual) pipeline stage (`stage_block_spec`); MLA models get `MLATransformerConfig`.

`RMSNorm` replaces the local spec's `WrappedTorchNorm` (torch.nn.RMSNorm, which refuses
`sequence_parallel`): the same arithmetic (`F.rms_norm`), and its weight carries
`sequence_parallel = config.sequence_parallel`. Under SP each TP rank normalizes its slice of the
sequence, so the weight's gradient is a partial sum: megatron's `finalize_model_grads` all-reduces
the gradients of parameters so marked over the TP group (as TE's norms are marked on a GPU).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from miles_platform.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    """A megatron model-parallel layout; `Layout.from_cfg(cfg)` reads Miles' flags."""

    tp: int = 1
    pp: int = 1
    sp: bool = False
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    layers_per_virtual_stage: int | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    @classmethod
    def from_cfg(cls, cfg: Any) -> Layout:
        """Miles' flags of a RunConfig (getattr: tests pass SimpleNamespace configs too)."""
        return cls(
            tp=int(getattr(cfg, "tensor_model_parallel_size", 1) or 1),
            pp=int(getattr(cfg, "pipeline_model_parallel_size", 1) or 1),
            sp=bool(getattr(cfg, "sequence_parallel", False)),
            cp=int(getattr(cfg, "context_parallel_size", 1) or 1),
            ep=int(getattr(cfg, "expert_model_parallel_size", 1) or 1),
            etp=getattr(cfg, "expert_tensor_parallel_size", None),
            layers_per_virtual_stage=getattr(cfg, "num_layers_per_virtual_pipeline_stage", None),
            first_stage_layers=getattr(cfg, "decoder_first_pipeline_num_layers", None),
            last_stage_layers=getattr(cfg, "decoder_last_pipeline_num_layers", None),
        )

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    def data_parallel(self, world_size: int) -> int:
        if world_size % self.model_parallel:
            raise ConfigError(
                f"{world_size} trainer ranks do not split into tensor x pipeline x context parallel = "
                f"{self.tp} x {self.pp} x {self.cp}: the world size must be a multiple of their product"
            )
        return world_size // self.model_parallel

    def virtual_stages(self, num_layers: int) -> int | None:
        """megatron's virtual_pipeline_model_parallel_size for --num-layers-per-virtual-pipeline-stage."""
        if self.layers_per_virtual_stage is None:
            return None
        per_stage, rem = divmod(num_layers, self.pp)
        if rem or per_stage % self.layers_per_virtual_stage:
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage {self.layers_per_virtual_stage}: the model's "
                f"{num_layers} layers over --pipeline-model-parallel-size {self.pp} stages do not split "
                "into virtual stages of that many layers"
            )
        return per_stage // self.layers_per_virtual_stage

    def transformer_config_kwargs(self, num_layers: int) -> dict[str, Any]:
        return dict(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.virtual_stages(num_layers),
            sequence_parallel=self.sp and self.tp > 1,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp or self.tp,
            num_layers_in_first_pipeline_stage=self.first_stage_layers,
            num_layers_in_last_pipeline_stage=self.last_stage_layers,
        )

    def init_kwargs(self, num_layers: int | None = None) -> dict[str, Any]:
        """kwargs of parallel_state.initialize_model_parallel."""
        return dict(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.virtual_stages(num_layers) if num_layers else None,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
        )


class RMSNorm(torch.nn.Module):
    """torch.nn.RMSNorm's arithmetic with megatron's norm constructor, usable under sequence
    parallelism (see the module docstring)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"RMSNorm built for normalization={config.normalization!r}")
        self.normalized_shape = (hidden_size,)
        self.eps = eps
        # layernorm_zero_centered_gamma (Qwen3.5): the weight is stored as w and applied as 1 + w
        self.zero_centered = bool(config.layernorm_zero_centered_gamma)
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered:  # 1 + w and the scaling in fp32, then cast (HF's Qwen3_5RMSNorm; TE's kernel)
            w = 1.0 + self.weight.float()
            return torch.nn.functional.rms_norm(x.float(), self.normalized_shape, w, self.eps).to(x.dtype)
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight, self.eps)


def _with_modules(spec, replace: dict):
    """A copy of a local layer spec with every module class in `replace` swapped for its value."""
    spec = copy.deepcopy(spec)

    def walk(sub) -> None:
        if sub is None or not dataclasses.is_dataclass(sub):
            return
        for f in dataclasses.fields(sub):
            v = getattr(sub, f.name)
            if isinstance(v, type) and v in replace:
                setattr(sub, f.name, replace[v])
            elif hasattr(v, "submodules"):
                walk(v.submodules)

    walk(spec.submodules)
    return spec


def decoder_layer_specs(bridge, hf_config: dict[str, Any], config, use_te: bool) -> list:
    """The layer spec of every decoder layer of the model: the bridge's, and where the bridge's
    `moe_layer_freq` list has a 0 (DeepSeek-V3's first dense layers) the same without experts; each
    then as the bridge's `adapt_layer_spec` changes it (MiniMax-M2's whole-projection q/k norms)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    def spec(**kw):
        if use_te:
            return specs.get_gpt_layer_with_transformer_engine_spec(**kw)
        return specs.get_gpt_layer_local_spec(**kw, normalization="RMSNorm")

    kwargs = bridge.layer_spec_kwargs(hf_config)
    layer = spec(**kwargs)
    if not isinstance(config.moe_layer_freq, list):
        layers = [layer] * config.num_layers
    else:
        dense = spec(**{**kwargs, "num_experts": None})
        layers = [layer if moe else dense for moe in config.moe_layer_freq]
    adapted = {id(s): bridge.adapt_layer_spec(s, use_te) for s in layers}  # one copy per distinct spec
    layers = [adapted[id(s)] for s in layers]
    if config.experimental_attention_variant == "gated_delta_net":  # Qwen3.5's linear-attention layers
        from miles_platform.training.megatron_gdn import gdn_layer_spec

        gdn = {id(s): gdn_layer_spec(s, use_te) for s in layers}
        layers = [
            gdn[id(s)] if linear else s
            for s, linear in zip(layers, config.linear_attention_freq, strict=True)
        ]
    return layers


def stage_block_spec(layer_specs: list, config, vp_stage: int | None, use_te: bool):
    """The decoder block of this (virtual) pipeline stage: its slice of `layer_specs`. The local spec
    gets our RMSNorm inside (under context parallelism our core attention, megatron_cp; with MLA
    megatron_mla's); a transformer-engine model of one layer kind keeps its single layer spec."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    offset = layer_offset(config, vp_stage)
    mine = layer_specs[offset : offset + n]
    if use_te:
        if all(s is layer_specs[0] for s in layer_specs):
            return layer_specs[0]
        from megatron.core.extensions.transformer_engine import TENorm

        return TransformerBlockSubmodules(layer_specs=mine, layer_norm=TENorm)
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    replace: dict = {WrappedTorchNorm: RMSNorm}
    if config.context_parallel_size > 1:
        from miles_platform.training.megatron_cp import ContextParallelAttention

        replace[DotProductAttention] = ContextParallelAttention
    if config.multi_latent_attention:
        from miles_platform.training.megatron_mla import MLADotProductAttention

        replace[DotProductAttention] = MLADotProductAttention
    swapped: dict[int, Any] = {}  # one copy per layer kind
    for s in mine:
        if id(s) not in swapped:
            swapped[id(s)] = _with_modules(s, replace)
    return TransformerBlockSubmodules(layer_specs=[swapped[id(s)] for s in mine], layer_norm=RMSNorm)


def stage_flags(vp_stage: int | None) -> tuple[bool, bool]:
    """(pre_process, post_process) of this rank's (virtual) pipeline stage."""
    from megatron.core import parallel_state as ps

    return (
        ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
    )


def layer_offset(config, vp_stage: int | None) -> int:
    """Global index of this chunk's first decoder layer."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return int(get_transformer_layer_offset(config, vp_stage=vp_stage))


def _gloo_pipeline() -> bool:
    """Pipeline stages talk over gloo. Its isend / irecv between two ranks match in posting order,
    and batched p2p posts both directions' sends before the receives, so with 2 stages (next rank =
    previous rank) an activation could land in a gradient's buffer: megatron's unbatched p2p posts
    them in an order that matches (even ranks send first, odd ranks receive first)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return False
    return dist.get_backend(ps.get_pipeline_model_parallel_group()) == "gloo"


def build_model_chunks(
    hf_config: dict[str, Any],
    layout: Layout,
    params_dtype: torch.dtype = torch.float32,
    use_te: bool = False,
    config_overrides: dict[str, Any] | None = None,
    device: torch.device | str | None = None,
):
    """([GPTModel per virtual pipeline stage of this rank], bridge) on `device` (default: CUDA's
    current device when there is one, else the CPU); parallel_state must be up.

    Logits stay vocab-parallel (`parallel_output=True`): [B, T, V / TP] on the last stage."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from miles_platform.models.bridge import get_bridge
    from miles_platform.training import megatron_shims

    bridge = get_bridge(hf_config)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    megatron_shims.apply_no_te_shims()
    base = bridge.transformer_config(hf_config)
    if base.get("experimental_attention_variant") == "gated_delta_net":
        from miles_platform.training.megatron_gdn import check_fla

        check_fla(device)
    if _gloo_pipeline():
        megatron_shims.tag_pipeline_shape_exchange()
    if layout.ep > 1:  # tokens per rank differ (samples of different lengths): allgather needs them equal
        base["moe_token_dispatcher_type"] = "alltoall"
    variable = layout.pp > 1 and "num_moe_experts" not in base
    if variable:  # megatron refuses variable lengths with its default (MoE-only) allgather dispatcher
        base["moe_token_dispatcher_type"] = "alltoall"
    # GPTModel's yarn rope reads `yarn_*` attributes TransformerConfig does not declare (Megatron-LM sets
    # them from its arguments): the bridge names them, they are set on the built config (GPT-OSS)
    yarn = {k: base.pop(k) for k in list(base) if k.startswith("yarn_")}
    config_class = MLATransformerConfig if base.get("multi_latent_attention") else TransformerConfig
    cfg = config_class(
        **base,
        **layout.transformer_config_kwargs(base["num_layers"]),
        batch_p2p_comm=not _gloo_pipeline(),
        # pipeline stages exchange each micro-batch's shape before its activations (dense models);
        # MoE's allgather dispatcher needs one shape: micro-batches are padded to it instead
        variable_seq_lengths=variable,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=device.type != "cuda",
        **(config_overrides or {}),
    )
    for k, v in yarn.items():
        setattr(cfg, k, v)
    layer_specs = decoder_layer_specs(bridge, hf_config, cfg, use_te)
    stages = cfg.virtual_pipeline_model_parallel_size
    chunks = []
    for vp in range(stages or 1):
        vp_stage = vp if stages else None
        pre, post = stage_flags(vp_stage)
        spec = stage_block_spec(layer_specs, cfg, vp_stage, use_te)
        with megatron_shims.tensor_cuda_is_cpu():
            model = GPTModel(
                cfg,
                spec,
                **bridge.gpt_model_kwargs(hf_config, layout.tp),
                pre_process=pre,
                post_process=post,
                parallel_output=True,
                vp_stage=vp_stage,
            )
        mark_expert_grads(model, layout)
        fix_sinks_and_biased_experts(model)
        chunks.append(to_device(model, device))
    return chunks, bridge


def mark_expert_grads(model: torch.nn.Module, layout: Layout) -> None:
    """Expert weights under an expert TP other than TP are reduced over the expert data-parallel
    group. megatron-core marks them so (`allreduce = False`) only at EP > 1; at EP 1 with expert TP 1
    and TP 2 each TP rank's experts take the gradient of its slice of the sequence, and the dense
    data-parallel group (which leaves out the TP peers) would never sum them (measured: the experts'
    gradients off by 3e-2 from the 1-rank step)."""
    if layout.ep > 1 or (layout.etp or layout.tp) == layout.tp:
        return
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            p.allreduce = False


def fix_sinks_and_biased_experts(model: torch.nn.Module) -> None:
    """Three megatron-core 0.16 spots of GPT-OSS's layers on the local spec, measured against the 1-rank
    step (tests/unit/training/test_megatron_layouts.py):
    - the learnable softmax offset (the sinks) is split with the heads over TP but carries no
      `tensor_model_parallel` mark, so the gradient norm counts TP rank 0's heads only: it is marked
      as split on dim 0, as the column-parallel weights are.
    - MLP adds an expert's fc2 bias into fc2's output in place (`output += output_bias *
      per_token_scale`, transformer/mlp.py). At TP 1 and EP 1 that output is the input that
      `_ReduceFromModelParallelRegion` hands back as it is, which autograd refuses to modify in place
      ("Output 0 of _ReduceFromModelParallelRegion is a view and is being modified inplace"): the fc2
      of each biased expert returns its own copy.
    - RowParallelLinear marks its bias `sequence_parallel` under SP, so finalize_model_grads sums its
      gradient over the TP group; an expert's gradients are also reduced over the expert data-parallel
      group, which at expert TP 1 holds those TP ranks: the fc2 bias counted twice (its update 5.7e-4
      off the 1-rank step at TP2 + SP). Its gradient is an expert's, reduced as the expert weights are."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    for name, m in model.named_modules():
        offset = getattr(m, "softmax_offset", None)
        if isinstance(offset, torch.nn.Parameter) and not hasattr(offset, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(offset, True, 0, 1)
        if ".local_experts." in name and name.endswith("linear_fc2") and getattr(m, "bias", None) is not None:
            m.forward = _copying_output(m.forward)
            m.bias.sequence_parallel = False


def _copying_output(forward):
    def copied(*args, **kwargs):
        output, bias = forward(*args, **kwargs)
        return output.clone(), bias

    return copied


def check_model_fits(layout: Layout, hf_config: dict[str, Any]) -> None:
    """The model's shapes split by the layout (before Ray): heads and query groups over TP, layers
    over (virtual / uneven) pipeline stages. ConfigError names the flag."""
    heads = int(hf_config["num_attention_heads"])
    groups = int(hf_config.get("num_key_value_heads") or heads)
    layers = int(hf_config["num_hidden_layers"])
    tp, pp = layout.tp, layout.pp
    if heads % tp or groups % tp:
        raise ConfigError(
            f"--tensor-model-parallel-size {tp}: the model's {heads} attention heads in {groups} query "
            "groups (num_key_value_heads) must both divide by it (each TP rank holds whole groups)"
        )
    first, last = layout.first_stage_layers, layout.last_stage_layers
    if first or last:
        middle = pp - bool(first) - bool(last)
        rest = layers - (first or 0) - (last or 0)
        if rest < 0 or (rest % middle if middle else rest):
            raise ConfigError(
                f"--pipeline-model-parallel-size {pp} with --decoder-first-pipeline-num-layers {first} / "
                f"--decoder-last-pipeline-num-layers {last}: the model's {layers} layers do not split so"
            )
    elif layers % pp:
        raise ConfigError(
            f"--pipeline-model-parallel-size {pp}: the model's {layers} layers do not divide by it"
        )
    layout.virtual_stages(layers)  # raises for --num-layers-per-virtual-pipeline-stage
    from miles_platform.models.families import routed_experts

    experts = routed_experts(hf_config)
    if why := layout_refusal(hf_config, layout):
        raise ConfigError(why)
    if layout.ep > 1 and (not experts or experts % layout.ep):
        raise ConfigError(
            f"--expert-model-parallel-size {layout.ep}: the model has {experts or 'no'} experts; EP splits an "
            "MoE model's experts evenly over its ranks"
        )
    if layout.etp is not None and not experts:
        raise ConfigError(
            f"--expert-tensor-parallel-size {layout.etp}: the model has no experts (it splits MoE experts only)"
        )
    etp = layout.etp or tp
    ffn = int(hf_config.get("moe_intermediate_size") or 0)
    if experts and ffn % etp:
        raise ConfigError(
            f"--expert-tensor-parallel-size {etp}: the experts' {ffn} hidden units (moe_intermediate_size) "
            "must divide by it"
        )
    if experts and tp > 1 and not layout.sp:
        raise ConfigError(
            f"an MoE model at --tensor-model-parallel-size {tp} needs --sequence-parallel: megatron-core's MoE "
            "layer refuses to train at TP > 1 without it ('performance may degrade if MoE and tensor "
            "parallelism are enabled without also enabling sequence parallelism')"
        )
    if experts and layout.cp > 1:
        raise ConfigError(
            f"an MoE model with --context-parallel-size {layout.cp}: not built. Routing replay (R3) and the aux "
            "loss take a micro-batch's tokens in sequence order, which CP splits into zigzag chunks per rank"
        )
    if experts and layout.pp > 1:
        raise ConfigError(
            "an MoE model with --pipeline-model-parallel-size > 1: not built (use --expert-model-parallel-size "
            "and --tensor-model-parallel-size). Routing replay (R3) and the aux loss read every layer's routes "
            "for a whole micro-batch, while pipeline stages hold some layers"
        )


def layout_refusal(hf_config: dict[str, Any], layout: Layout, *, step: bool = True) -> str | None:
    """The family's own refusal of `layout` (`Bridge.layout_refusal`); None for a model without a bridge,
    whose megatron refusal is its family's (preflight)."""
    from miles_platform.errors import CheckpointError
    from miles_platform.models.bridge import get_bridge

    try:
        bridge = get_bridge(hf_config)
    except CheckpointError:
        return None
    return bridge.layout_refusal(hf_config, layout, step=step)


def to_device(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model.to(device)`, with the tensors megatron keeps as plain attributes (RoPE's `inv_freq`,
    created on the CPU under `use_cpu_initialization`), which `.to` does not see."""
    model.to(device)
    for m in model.modules():
        for name, v in list(vars(m).items()):
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and v.device != device:
                if name not in m._buffers:
                    setattr(m, name, v.to(device))
    return model
