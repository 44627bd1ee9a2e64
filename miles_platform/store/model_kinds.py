"""What a policy version's weights dir holds, per model kind: the file that says the kind, the
tensor census `hf_export_sanity` (store/run_health.py) compares with the run's base, and, for an
adapter, whether it fits that base.

| kind | marker | holds | compared with |
| --- | --- | --- | --- |
| `hf_llm` | config.json | `*.safetensors` (models/checkpoint.py export) | the base checkpoint |
| `diffusers_pipeline` | model_index.json | a dir per component model_index.json names; a weight component its config.json + `*.safetensors` (diffusion/model.py) | the base pipeline |
| `peft_adapter` | adapter_config.json | adapter_model.safetensors: lora_A (r, in) / lora_B (out, r) pairs (training/lora.py) | the run's first adapter; each pair fits a linear module of the base |

A census is {tensor name: shape} (headers only, nothing loaded), so one comparison (key set,
parameter count) serves every kind; a pipeline's tensors are named `<component>/<tensor>`.
A dir of none of these kinds is reported as such by the check, never as a broken export.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Census = dict[str, tuple[int, ...]]
LORA_PREFIX = "base_model.model."  # PEFT's key prefix (rollout/lora_serving.py)


class ExportError(Exception):
    """A weights dir that cannot be what its kind holds: the message says which file."""


def parameters(census: Census) -> int:
    return sum(math.prod(shape) for shape in census.values())


def _safetensors(files: list[Path]) -> Census:
    from safetensors import safe_open

    out: Census = {}
    try:
        for f in files:
            with safe_open(str(f), framework="np") as st:
                for k in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                    out[k] = tuple(st.get_slice(k).get_shape())
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt file
        raise ExportError(f"unreadable safetensors: {str(e).splitlines()[0]}") from None
    return out


def _json(f: Path) -> dict:
    if not f.is_file():
        raise ExportError(f"{f.name} missing")
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{f.name} unreadable: {e}") from None


def hf_llm_census(d: Path) -> Census:
    if not (d / "config.json").is_file():
        raise ExportError("config.json missing")
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ExportError("no *.safetensors")
    return _safetensors(files)


def pipeline_census(d: Path) -> Census:
    index = _json(d / "model_index.json")
    # diffusers' model_index.json: component -> [library, class]; [null, null] for an absent one
    components = sorted(k for k, v in index.items() if not k.startswith("_") and isinstance(v, list) and v[0])
    if not components:
        raise ExportError("model_index.json names no component")
    out: Census = {}
    for c in components:
        if not (d / c).is_dir():
            raise ExportError(f"{c}/ missing (model_index.json names it)")
        files = sorted((d / c).glob("*.safetensors"))
        if files and not (d / c / "config.json").is_file():
            raise ExportError(f"{c}/config.json missing")
        out |= {f"{c}/{k}": shape for k, shape in _safetensors(files).items()}
    if not out:
        raise ExportError("no component has *.safetensors")
    return out


def adapter_census(d: Path) -> Census:
    config = _json(d / "adapter_config.json")
    if not (d / "adapter_model.safetensors").is_file():
        raise ExportError("adapter_model.safetensors missing (a PEFT adapter dir has both)")
    if str(config.get("peft_type", "LORA")).upper() != "LORA" or not isinstance(config.get("r"), int):
        raise ExportError(
            f"adapter_config.json: peft_type {config.get('peft_type')!r}, r {config.get('r')!r}"
        )
    census = _safetensors([d / "adapter_model.safetensors"])
    odd = sorted(k for k in census if not (k.endswith(".lora_A.weight") or k.endswith(".lora_B.weight")))
    if odd or not census:
        raise ExportError(f"tensors that are not LoRA factors: {odd[:3]}" if odd else "no LoRA tensors")
    return census


def _base_weight(base: Census, module: str) -> tuple[int, ...] | None:
    name = module.removeprefix(LORA_PREFIX)
    if name == "lm_head" and "lm_head.weight" not in base:
        name = "model.embed_tokens"  # a tied base: the adapted head has the embedding's shape
    return base.get(f"{name}.weight")


def adapter_misfits(d: Path, census: Census, base: Census | None, base_name: str) -> list[str]:
    """Each lora_A / lora_B pair has rank r (adapter_config.json) and the (out, in) of the base's
    module (the pair's own dims when no base is readable here)."""
    r = json.loads((d / "adapter_config.json").read_text())["r"]
    problems = [f"{k} has no lora_A" for k in sorted(census) if k.endswith(".lora_B.weight")
                and k.replace(".lora_B.", ".lora_A.") not in census]  # fmt: skip
    for key in sorted(k for k in census if k.endswith(".lora_A.weight")):
        module = key.removesuffix(".lora_A.weight")
        a, b = census[key], census.get(f"{module}.lora_B.weight")
        if b is None:
            problems.append(f"{key} has no lora_B")
            continue
        weight = (b[0], a[-1]) if base is None else _base_weight(base, module)
        if weight is None:
            problems.append(f"{module}: {base_name} has no such module to adapt")
        elif a != (r, weight[1]) or b != (weight[0], r):
            problems.append(
                f"{module}: lora_A {a} / lora_B {b}, expected {(r, weight[1])} / {(weight[0], r)} for {base_name}"
            )
    return problems


@dataclass(frozen=True)
class ModelKind:
    name: str
    marker: str  # the file that says a dir is of this kind
    label: str  # how a problem names the dir
    noun: str  # how the reference names one of them: "the first <noun> <run>.v000001"
    census: Callable[[Path], Census]
    base_kind: str  # the kind of the base checkpoint a version of this kind is checked against
    base_is_reference: bool  # the version's key set and parameter count are the base's
    misfits: Callable[[Path, Census, Census | None, str], list[str]] | None = None


KINDS = {
    k.name: k
    for k in (
        ModelKind("diffusers_pipeline", "model_index.json", "diffusers pipeline", "pipeline", pipeline_census,
                  "diffusers_pipeline", True),
        ModelKind("peft_adapter", "adapter_config.json", "PEFT adapter", "adapter", adapter_census, "hf_llm",
                  False, adapter_misfits),
        ModelKind("hf_llm", "config.json", "HF export", "export", hf_llm_census, "hf_llm", True),
    )
}  # fmt: skip
MARKERS = (
    "config.json (HF export), model_index.json (diffusers pipeline) or adapter_config.json (PEFT adapter)"
)


def kind_of(d: str | Path | None) -> ModelKind | None:
    """The kind whose marker file `d` has (a pipeline's components have config.json: model_index.json
    is looked for first); None for a dir of no known kind, a missing dir or an object-store URI."""
    if not d or "://" in str(d) or not Path(d).is_dir():
        return None
    return next((k for k in KINDS.values() if (Path(d) / k.marker).is_file()), None)
