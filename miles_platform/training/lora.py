"""LoRA with PEFT (the fsdp backend; the megatron backend's training/megatron_lora.py writes the same
files): target selection (Miles' groups and names), the adapter's PEFT-format files, and the merged
export. The base stays frozen; only lora_A / lora_B train.

Target selection follows Miles' `hf_lora_targets.py` for the Qwen3 / Llama layout:

    attn     q_proj, k_proj, v_proj, o_proj; with multi-latent attention (DeepSeek-V3 / V3.2,
             GLM-4.7-Flash) also q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj (Miles' MLA targets;
             DeepSeek-V3.2's indexer never)
    mlp      gate_proj, up_proj, down_proj; on an MoE model also the packed routed experts
             (mlp.experts.gate_up_proj / down_proj, PEFT's target_parameters); routers never
    unembed  lm_head
    default  attn + mlp (also what `all-linear` means; `all-linear` must stand alone)

Anything else in `--target-modules` is an explicit target: an HF leaf name (`q_proj`), a scoped HF
path (`model.layers.0.self_attn.q_proj`, matched as a path suffix) or a glob (`*.layers.1.*_proj`).
Duplicates go, then `--exclude-modules` removes modules; an explicit target that an exclusion also
names is an error (Miles'), while groups and defaults may be narrowed by exclusions.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
from pathlib import Path

import torch
from torch import nn

from miles_platform.errors import ConfigError
from miles_platform.rollout.lora_serving import (  # noqa: F401
    EXPERT_PARAMS,
    expert_factors,
    expert_layout,
    peft_module,
    read_adapter_dir,  # noqa: F401 (re-exported)
)
from miles_platform.rollout.lora_serving import PREFIX as PEFT_PREFIX

GROUPS = {
    # the MLA leaves name no module of a GQA model (and the V3.2 indexer's wq_b / wk / weights_proj none)
    "attn": (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
    ),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "unembed": ("lm_head",),
}
DEFAULT_GROUPS = ("attn", "mlp")
ADAPTER_NAME = "default"  # PEFT's adapter name inside the trainer
BASE_FILE = "base_checkpoint.json"  # next to the adapter: which base it applies to, by content hash


def _split(value: str | None) -> list[str]:
    return [t.strip() for t in (value or "").split(",") if t.strip()]


def _matches(name: str, target: str) -> bool:
    if any(c in target for c in "*?["):
        return fnmatch.fnmatchcase(name, target) or fnmatch.fnmatchcase(name.rsplit(".", 1)[-1], target)
    return name == target or name.endswith("." + target)


def linear_module_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def expert_param_names(model: nn.Module) -> list[str]:
    """The packed routed-expert weights of an MoE model (`...mlp.experts.gate_up_proj` [E, 2I, H],
    `...down_proj` [E, H, I]): what PEFT adapts through `target_parameters`, one LoRA per expert."""
    return [n for n, p in model.named_parameters()
            if n.rsplit(".", 1)[-1] in EXPERT_PARAMS and n.rsplit(".", 2)[-2] == "experts" and p.ndim == 3]  # fmt: skip


def _param_matches(name: str, pat: str) -> bool:
    return _matches(name, pat) or _matches(name.rsplit(".", 1)[0], pat)


def resolve_target_modules(
    model: nn.Module, target_modules: str | None, exclude_modules: str | None
) -> list[str]:
    """The full names of what gets an adapter, sorted: `model`'s linear modules and, on an MoE model, its
    packed expert weights (`...mlp.experts.gate_up_proj` / `down_proj`: Miles' `mlp` group includes the
    routed experts). Errors name the flag and value."""
    experts = expert_param_names(model)
    candidates = [(n, False) for n in linear_module_names(model)] + [(n, True) for n in experts]
    wanted = _split(target_modules) or ["all-linear"]
    if "all-linear" in wanted and len(wanted) > 1:
        raise ConfigError(f"--target-modules {target_modules!r}: all-linear must be used alone")
    patterns: list[tuple[str, bool]] = []  # (pattern, explicit)
    packed = _packed_pairs(wanted, experts)
    for t in wanted:
        if t == "all-linear":
            patterns += [(leaf, False) for g in DEFAULT_GROUPS for leaf in GROUPS[g]]
        elif t in GROUPS:
            patterns += [(leaf, False) for leaf in GROUPS[t]]
        else:
            patterns.append((t, True))
        if t in ("all-linear", "mlp"):
            patterns += [(p, False) for p in EXPERT_PARAMS]
    _refuse_moe_targets(model, patterns)
    match = lambda n, pat, param: _param_matches(n, pat) if param else _matches(n, pat)  # noqa: E731
    picked: dict[str, bool] = {}
    patterns += [(p, False) for p in packed]
    replaced = {p.removesuffix("gate_up_proj") + leaf for p in packed for leaf in ("gate_proj", "up_proj")}
    for pat, explicit in patterns:
        hits = [n for n, param in candidates if match(n, pat, param)]
        if explicit and not hits and pat not in replaced:
            leaves = sorted({n.rsplit(".", 1)[-1] for n, _ in candidates})
            raise ConfigError(
                f"--target-modules {pat!r} matches no linear module of the model; its linear leaves are "
                f"{leaves} (or use the groups {sorted(GROUPS)} / all-linear)"
            )
        for n in hits:
            picked[n] = picked.get(n, False) or explicit
    excluded = set()
    for pat in _split(exclude_modules):
        hits = [n for n in picked if match(n, pat, n in experts)]
        clash = [n for n in hits if picked[n]]
        if clash:
            raise ConfigError(
                f"--exclude-modules {pat!r} removes {clash[:3]}, which --target-modules names explicitly; "
                "drop one of the two"
            )
        excluded.update(hits)
    out = sorted(set(picked) - excluded)
    if not out:
        raise ConfigError(
            f"--target-modules {target_modules!r} --exclude-modules {exclude_modules!r}: no module is left to adapt"
        )
    _check_expert_layout(model, [n for n in out if n in experts])
    return out


def _packed_pairs(wanted: list[str], experts: list[str]) -> list[str]:
    """Miles': a `gate_proj` and an `up_proj` selector with the same prefix (a leaf name or a scoped path,
    not a glob) also select the packed `gate_up_proj` where the model has packed experts, with a warning;
    one of the two alone does not. Returns those gate_up_proj selectors."""
    import logging

    out = []
    for t in wanted:
        prefix = t.removesuffix("gate_proj")
        if prefix == t or any(c in t for c in "*?[") or (prefix and not prefix.endswith(".")):
            continue
        if prefix + "up_proj" in wanted and any(_param_matches(n, prefix + "gate_up_proj") for n in experts):
            out.append(prefix + "gate_up_proj")
            logging.getLogger(__name__).warning(
                "--target-modules %s + %s: also the packed experts' %s (Miles' reading of the pair)",
                t,
                prefix + "up_proj",
                prefix + "gate_up_proj",
            )
    return out


def _refuse_moe_targets(model: nn.Module, patterns: list[tuple[str, bool]]) -> None:
    """Routers are never targets (Miles' target groups exclude them)."""
    from miles_platform.models.moe import routers

    found = routers(model)
    if not found:
        return
    names = {id(m): n for n, m in model.named_modules()}
    for pat, explicit in patterns:
        if explicit and any(_matches(names[id(r)], pat) for r in found):
            raise ConfigError(
                f"--target-modules {pat!r}: an MoE router; Miles' LoRA never adapts routers (its target groups "
                "exclude them). Adapt attention, dense or expert projections"
            )


def _check_expert_layout(model: nn.Module, params: list[str]) -> None:
    """Expert adapters are built for the packed experts the engine's expert forward computes
    (rollout/lora_serving.expert_layout): Qwen-style (`act(gate) * up`, no biases) and GPT-OSS's (biased,
    interleaved gate / up, clamped); their biases are never targets."""
    if not params:
        return
    modules = dict(model.named_modules())
    for name in params:
        experts = modules[name.rsplit(".", 1)[0]]
        if expert_layout(experts) is None:
            raise ConfigError(
                f"--target-modules: {name}: expert adapters are built for Qwen-style packed experts and GPT-OSS's; "
                f"{type(experts).__name__} is neither. Use --target-modules attn"
            )


def hf_meta_model(hf_config: dict) -> nn.Module:
    """The HF model of a config.json dict on the meta device: its module names, no weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.for_model(**{k: v for k, v in hf_config.items() if k != "transformers_version"})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(conf)


def split_targets(targets: list[str]) -> tuple[list[str], list[str]]:
    """(linear module names, packed expert weight names) of resolved targets."""
    params = [t for t in targets if t.rsplit(".", 1)[-1] in EXPERT_PARAMS and ".experts." in t + "."]
    return [t for t in targets if t not in params], params


def lora_config(cfg, targets: list[str]):
    from peft import LoraConfig

    modules, params = split_targets(targets)
    if params and cfg.lora_dropout:
        raise ConfigError(
            f"--lora-dropout {cfg.lora_dropout} with routed-expert targets: an expert adapter has no dropout "
            "(PEFT's, Miles'); use --lora-dropout 0 or --target-modules attn"
        )
    return LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=modules,
        target_parameters=params or None,
        bias="none",
        task_type="CAUSAL_LM",
    )


def check_adapter_matches(path: str, cfg, targets: list[str]) -> None:
    """--lora-adapter-path: its rank, alpha and targets must be the flags' (Miles asks for them too)."""
    from safetensors import safe_open

    saved = json.loads(Path(path, "adapter_config.json").read_text())
    with safe_open(str(Path(path, "adapter_model.safetensors")), "pt") as f:
        keys = list(f.keys())
    # the modules it adapts, from its tensors (PEFT writes `target_modules` shortened to leaf names
    # when they cover many layers): Miles derives an adapter's targets from its tensor keys too
    adapted = sorted(
        {
            k.removeprefix(PEFT_PREFIX).split(".lora_A.")[0]
            for k in keys
            if ".lora_A." in k and ".experts." not in k + "."
        }  # fmt: skip
        | set(saved.get("target_parameters") or [])
    )
    have = {"rank": saved.get("r"), "alpha": saved.get("lora_alpha"), "targets": adapted}
    want = {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "targets": sorted(targets)}
    bad = [f"{k}: adapter {have[k]!r}, flags {want[k]!r}" for k in want if have[k] != want[k]]
    if saved.get("peft_type", "LORA") != "LORA" or saved.get("use_dora"):
        bad.append(f"type: {saved.get('peft_type')} (dora={saved.get('use_dora')}), need plain LORA")
    if bad:
        raise ConfigError(
            f"--lora-adapter-path {path}: does not match --lora-rank / --lora-alpha / --target-modules ("
            + "; ".join(bad)
            + ")"
        )


def wrap_model(model: nn.Module, cfg) -> nn.Module:
    """The PEFT-wrapped model: fresh adapters (B = 0, so v0 is the base policy) or --lora-adapter-path's;
    every resolved target holds an adapter (checked: PEFT may drop one without a word)."""
    from peft import PeftModel, get_peft_model

    targets = resolve_target_modules(model, cfg.target_modules, cfg.exclude_modules)
    with _exact_targets():
        if cfg.lora_adapter_path:
            check_adapter_matches(cfg.lora_adapter_path, cfg, targets)
            peft_model = PeftModel.from_pretrained(model, cfg.lora_adapter_path, is_trainable=True)
            peft_model.peft_config[ADAPTER_NAME].lora_dropout = cfg.lora_dropout
        else:
            peft_model = get_peft_model(model, lora_config(cfg, targets))
    bad = [n for n, p in peft_model.named_parameters() if p.requires_grad and "lora_" not in n]
    if bad:
        raise RuntimeError(f"LoRA: base parameters left trainable: {bad[:5]}")
    adapted = {
        adapter_key(n).rsplit(".lora_", 1)[0] for n, _ in peft_model.named_parameters() if "lora_" in n
    }
    experts = split_targets(targets)[1]
    missing = [t for t in targets if peft_module(t, experts) not in adapted]
    if missing:
        raise RuntimeError(f"LoRA: PEFT built no adapter on {missing[:5]} (of {len(targets)} targets)")
    return peft_model


@contextlib.contextmanager
def _exact_targets():
    """PEFT 0.21 on transformers v5 rewrites the targets of an MoE model whose conversion pattern is
    qwen2_moe's (DeepSeek-V3 / V3.2, GLM-4.5, GLM-4.7-Flash, Qwen3-MoE, Qwen3-Next) as transformers-v4
    names, to load v4 adapters: every `*.gate_proj / up_proj / down_proj` becomes the packed experts'
    parameter, so a dense layer's MLP and a shared expert lose their adapters without a word. Our targets
    are the v5 model's own module and parameter names (`resolve_target_modules`) and our adapter files
    are written with them, so the rewrite is skipped while PEFT builds the model."""
    from peft.utils import transformers_weight_conversion as conversion

    keep = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = keep


def adapter_key(param_name: str) -> str:
    """Trainer parameter name -> PEFT file key (`...q_proj.lora_A.default.weight` -> `...lora_A.weight`)."""
    return param_name.replace(f".{ADAPTER_NAME}.", ".")


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_config_dict(peft_model) -> dict:
    """adapter_config.json as PEFT writes it (`base_model_name_or_path` as given to PEFT), with
    `target_modules` the full names of the adapted modules (PEFT may shorten them to leaf names)."""
    adapted = []
    for n, m in peft_model.named_modules():
        if isinstance(getattr(m, "lora_A", None), nn.ModuleDict) and ADAPTER_NAME in m.lora_A:
            n = n.removeprefix(PEFT_PREFIX)
            if getattr(m, "parameter_name", None):  # an expert weight: `...experts[.base_layer]*` + its name
                n = f"{n.split('.base_layer')[0]}.{m.parameter_name}"
            adapted.append(n)
    return config_dict(peft_model.peft_config[ADAPTER_NAME], adapted)


def config_dict(lora_conf, targets: list[str]) -> dict:
    """A `peft.LoraConfig` as the JSON of adapter_config.json (sets as sorted lists) for the adapted
    modules `targets` (full names): both backends write the same file for the same adapter."""
    conf = lora_conf.to_dict()
    modules, params = split_targets(sorted(targets))
    conf["target_modules"], conf["target_parameters"] = modules, params
    for k, v in list(conf.items()):
        if isinstance(v, set):
            conf[k] = sorted(v)
    if not conf.get("target_parameters"):  # none: PEFT's null
        conf["target_parameters"] = None
    return json.loads(json.dumps(conf, default=str))


def write_adapter_dir(
    out_dir: str, state: dict[str, torch.Tensor], config: dict, base_path: str, base_hash: str
) -> str:
    """A PEFT adapter dir (adapter_model.safetensors + adapter_config.json, loadable by
    `peft.PeftModel.from_pretrained`) plus base_checkpoint.json naming the frozen base by content hash.
    Written under a temp name and renamed: a reader never sees half an adapter."""
    import shutil
    import uuid

    from safetensors.torch import save_file

    from miles_platform.store.atomic import fsync_tree, replace_dir

    dest = Path(out_dir)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        conf = {**config, "base_model_name_or_path": os.path.abspath(base_path)}
        (tmp / "adapter_config.json").write_text(json.dumps(conf, indent=1, sort_keys=True))
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "adapter_model.safetensors"),
                  metadata={"format": "pt"})  # fmt: skip
        (tmp / BASE_FILE).write_text(
            json.dumps({"path": os.path.abspath(base_path), "content_hash": base_hash})
        )
        fsync_tree(tmp)
        replace_dir(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return os.fspath(dest)


def adapter_writer(state: dict[str, torch.Tensor], conf: dict, base: str, rank: int, copy: bool):
    """A checkpoint's adapter half (both backends' `snapshot_model`): `iter_N/adapter/`, the PEFT dir,
    written by rank 0 from copies the training steps do not touch (`copy`, --async-save)."""
    from miles_platform.models.checkpoint import content_hash

    own = (lambda v: v.detach().clone().contiguous()) if copy else (lambda v: v.contiguous())
    state = {k: own(v) for k, v in state.items()} if rank == 0 else {}

    def write_adapter(ckpt_dir: str) -> None:
        if rank == 0:
            write_adapter_dir(os.path.join(ckpt_dir, "adapter"), state, conf, base, content_hash(base))

    return write_adapter


def read_checkpoint_adapter(ckpt_dir: str, base: str) -> dict[str, torch.Tensor]:
    """The adapter tensors of a LoRA checkpoint `iter_N/`, after checking it was trained on `base`."""
    adapter = os.path.join(ckpt_dir, "adapter")
    if not os.path.isdir(adapter):
        raise ValueError(
            f"{ckpt_dir}: no adapter/ (saved by a full fine-tuning run?); resume with --lora-rank 0"
        )
    check_base(adapter, base)
    return read_adapter_dir(adapter)[0]


def check_base(adapter_dir: str, base_path: str) -> None:
    """An adapter applies to the base it was trained on: refuse another one (content hash)."""
    from miles_platform.models.checkpoint import content_hash

    f = Path(adapter_dir, BASE_FILE)
    if not f.is_file():
        return
    want = json.loads(f.read_text())["content_hash"]
    have = content_hash(base_path)
    if have != want:
        raise ValueError(
            f"{adapter_dir}: adapter trained on base {want}, but --hf-checkpoint {base_path} has content "
            f"hash {have}; resume with the base it was trained on"
        )


def merged_state_dict(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], config: dict) -> dict:
    """W + scale * B @ A for every adapted module, under HF names (the merged HF export)."""
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / (r**0.5) if config.get("use_rslora") else alpha / r
    out = dict(base)
    for param, (a, b) in expert_factors(
        adapter, config
    ).items():  # packed experts: W[e] + scale * B[e] @ A[e]
        w, delta = out[param], torch.bmm(b.float(), a.float())
        # GPT-OSS's experts (the biased layout, rollout/lora_serving.expert_layout) hold [E, in, out]
        delta = delta.transpose(1, 2) if f"{param}_bias" in out else delta
        out[param] = (w.float() + scale * delta).to(w.dtype)
    for key, a in adapter.items():
        if ".lora_A." not in key or ".experts." in key:
            continue
        module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
        b = adapter[key.replace(".lora_A.", ".lora_B.")]
        name = f"{module}.weight"
        if name not in out:
            if module == "lm_head" and "model.embed_tokens.weight" in out:
                name = "lm_head.weight"  # tied: the merged head is a weight of its own
                out[name] = out["model.embed_tokens.weight"]
            else:
                raise KeyError(f"adapter tensor {key}: base has no {name}")
        w = out[name]
        out[name] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out


def export_merged_hf_dir(base_dir: str, adapter_dir: str, out_dir: str) -> str:
    """The merged HF dir on demand: base + adapter as one ordinary HF checkpoint."""
    from miles_platform.models.checkpoint import read_safetensors_dir
    from miles_platform.training.export import export_hf_dir

    check_base(adapter_dir, base_dir)
    adapter, config = read_adapter_dir(adapter_dir)
    from miles_platform.models.checkpoint_layout import fuse_checkpoint_experts

    # the module's names (an MoE's per-expert tensors fused, as the adapter's expert weights name them)
    merged = merged_state_dict(fuse_checkpoint_experts(read_safetensors_dir(base_dir)), adapter, config)
    untie = "lm_head.weight" in merged and any(".lm_head.lora_" in k for k in adapter)
    # a merged head differs from the embedding: the export is no longer tied
    return export_hf_dir(merged, base_dir, out_dir, {"tie_word_embeddings": False} if untie else None)
