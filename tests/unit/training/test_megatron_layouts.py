"""Megatron model parallelism on CPU (gloo): one GRPO step at TP2, TP2 + SP, PP2, interleaved PP2 and
uneven PP2 on 2 ranks equals the 1-rank step from the same HF checkpoint: the loss, its parts and
the grad norm within 1e-5, and the updated weights exported to HF within 1e-5 (fp32).

The step is SGD with lr 1, so an updated weight's difference is its gradient's difference: every
gradient element is compared. (AdamW's first step is lr * g / (|g| + eps): a gradient element near
eps = 1e-8, which a tiny random model has, turns a 1e-9 rounding difference of the split matmuls
into a ~1e-5 weight difference; that measures Adam, not the layout.)

The step is scored through megatron-core's pipeline schedule with vocab-parallel log-probs,
entropy and KL (no gathered vocabulary); a frozen reference model (--use-kl-loss) runs the same
schedule forward-only. The loss has an entropy term and a rollout temperature, so it is not the
trivial GRPO step-0 value. The checkpoint: 4 layers, 4 heads in 2 query groups, tied embeddings
(pipeline stages keep two copies of the embedding that must stay equal).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import pytest
import torch
from loop_helpers import run_ranks
from safetensors.torch import load_file, save_file

from miles_platform.cluster.ports import free_port

TOL = 1e-5
METRICS = ("train/loss", "train/pg_loss", "train/entropy_loss", "train/kl_loss", "train/grad_norm")

LAYOUTS = {
    "tp2": dict(tensor_model_parallel_size=2),
    "tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    "pp2": dict(pipeline_model_parallel_size=2),
    "pp2_interleaved": dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1),
    "pp2_uneven": dict(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=1),
    "cp2": dict(context_parallel_size=2),
    # megatron-core's DistributedOptimizer (megatron_distopt; Adam only): DP2 shards the optimizer state
    # over the ranks, against the 1-rank AdamW step (ADAM); each rank offloads and onloads first
    # (--offload-train parks its storages in place: training/offload.py)
    "dp2_distopt": dict(
        use_distributed_optimizer=True, optimizer="adam", lr=1e-3, adam_eps=1e-6, offload_train=True
    ),
}
# AdamW's first step moves each weight by ~lr: at lr 1e-3 and eps 1e-6 a 1e-9 rounding difference of a
# gradient moves an update by <= lr * 1e-9 / eps = 1e-6 (the docstring's eps effect, bounded below TOL)
ADAM = dict(optimizer="adam", lr=1e-3, adam_eps=1e-6)


def run_config(ckpt: str, **kw):
    from miles_platform.config import RunConfig

    base = dict(hf_checkpoint=ckpt, train_backend="megatron", rollout_batch_size=2, n_samples_per_prompt=2,
                global_batch_size=4, micro_batch_size=1, optimizer="sgd", lr=1.0, num_rollout=1, entropy_coef=0.5,
                use_kl_loss=True, kl_loss_coef=0.05, rollout_temperature=0.8)  # fmt: skip
    return RunConfig(**{**base, **kw}).validate()


def _worker(rank: int, world: int, port: int, ckpt: str, out: str, overrides: dict) -> None:
    torch.set_num_threads(1)
    from loop_helpers import random_train_batch

    from miles_platform.training import megatron_shims
    from miles_platform.training.actor import TrainerActor
    from miles_platform.training.train_samples import TrainSamplesTarget

    path = Path(out, f"rank{rank}")
    try:
        cfg = run_config(
            ckpt, actor_num_gpus_per_node=world, storage_root=f"{out}/root", run_name="l", **overrides
        )
        actor = TrainerActor(cfg, rank, world, f"tcp://127.0.0.1:{port}")
        if cfg.offload_train:  # what a colocated rank does around each rollout
            actor.offload()
            actor.onload()
        batch = random_train_batch(0)
        if cfg.use_rollout_routing_replay:
            batch.routed_experts = random_routes(batch, ckpt)
        metrics = actor.train(0, batch, TrainSamplesTarget(version=1))
        weights = actor.get_hf_weights()
        if weights:
            save_file({k: v.contiguous() for k, v in weights.items()}, f"{path}.safetensors")
        Path(f"{path}.json").write_text(json.dumps(metrics))
    except Exception:
        Path(f"{path}.error").write_text(traceback.format_exc())
    finally:
        megatron_shims.destroy_process_group()


def random_routes(batch, ckpt: str) -> list:
    """R3 routes as an engine returns them: per sample [tokens - 1][MoE layers][top_k] distinct experts."""
    from miles_platform.models.checkpoint import validate_hf_dir
    from miles_platform.models.families import routed_experts
    from miles_platform.models.moe import routed_shape

    experts = routed_experts(validate_hf_dir(ckpt, need_tokenizer=False))
    layers, k = routed_shape(ckpt)  # GLM-4.5's first layer is dense: it routes nothing
    g = torch.Generator().manual_seed(7)
    return [
        torch.rand(len(t) - 1, layers, experts, generator=g).argsort(-1)[..., :k].tolist()
        for t in batch.tokens
    ]


def train_one_step(ckpt: str, out: Path, world: int, **overrides) -> tuple[list[dict], dict]:
    """Metrics of every rank and rank 0's exported HF weights after one step."""
    run_ranks(_worker, (world, free_port(), ckpt, str(out), overrides), world, out)
    metrics = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    return metrics, load_file(out / "rank0.safetensors"), str(out)


@pytest.fixture(scope="module")
def layout_checkpoint(tiny_hf_checkpoint, tmp_path_factory):
    from miles_platform.models.tiny import save_layout_checkpoint

    return save_layout_checkpoint(tiny_hf_checkpoint, tmp_path_factory.mktemp("layouts") / "l4")


@pytest.fixture(scope="module")
def single_rank(layout_checkpoint, tmp_path_factory):
    return train_one_step(layout_checkpoint, tmp_path_factory.mktemp("tp1") / "out", 1)


@pytest.fixture(scope="module")
def single_rank_adam(layout_checkpoint, tmp_path_factory):
    return train_one_step(layout_checkpoint, tmp_path_factory.mktemp("tp1_adam") / "out", 1, **ADAM)


def sample_rows(out: Path) -> list[dict]:
    """The train_samples rows the step's ranks wrote (`out`: the run's dir of rank outputs)."""
    from miles_platform.store.paths import StoragePaths
    from miles_platform.store.tables import read_rows

    return sorted(read_rows(StoragePaths(str(out / "root")), "train_samples", "l"), key=lambda r: r["index"])


def assert_same_step(reference, got) -> None:
    (ref_metrics,), ref_weights, _ = reference
    metrics, weights, _ = got
    assert abs(ref_metrics["train/entropy_loss"]) > 1e-3  # a loss with a value, not GRPO's step-0 ~0
    for m in metrics:  # every rank reports the step (pipeline stages: the last stage's numbers)
        for key in METRICS:
            # relative above 1: fp32 sums in another order (GPT-OSS's sharp weights: grad norm 9.37, 1.8e-5 apart
            # with every gradient element equal within 2e-7)
            bound = TOL * max(1.0, abs(ref_metrics[key]))
            assert abs(m[key] - ref_metrics[key]) <= bound, f"{key}: {m[key]} vs 1 rank {ref_metrics[key]}"
    assert sorted(weights) == sorted(ref_weights)
    for k, v in ref_weights.items():
        diff = (weights[k] - v).abs().max().item()
        assert diff <= TOL, f"{k}: differs from the 1-rank step by {diff:.3g}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_step_equals_single_rank(layout, layout_checkpoint, request, tmp_path):
    adam = LAYOUTS[layout].get("optimizer") == "adam"
    single_rank = request.getfixturevalue("single_rank_adam" if adam else "single_rank")
    got = train_one_step(layout_checkpoint, tmp_path / layout, 2, **LAYOUTS[layout])
    assert_same_step(single_rank, got)
    # one train_samples row per sample: one rank of the model-parallel pair writes (the last
    # stage at TP and CP rank 0), with the 1-rank step's values: under CP the log-probs gathered
    # from both ranks' halves of each sample
    ref, rows = sample_rows(Path(single_rank[2])), sample_rows(tmp_path / layout)
    dp2 = layout.startswith("dp2")
    writers = {0, 1} if dp2 else {1 if layout.startswith("pp") else 0}
    # the HF export is kept by the first rank of each replica (TP x PP x CP) only: under CP2 rank 1
    # holds the same weights and keeps none
    assert (tmp_path / layout / "rank1.safetensors").exists() == dp2
    assert [r["index"] for r in rows] == [0, 1, 2, 3] and {r["rank"] for r in rows} == writers
    for a, b in zip(ref, rows, strict=True):
        for key in ("log_probs", "ratio", "ref_kl", "advantage"):
            assert b[key] == pytest.approx(a[key], abs=TOL), key
    init = load_file(Path(layout_checkpoint) / "model.safetensors")
    moved = [k for k in init if not torch.equal(init[k], got[1][k])]
    assert len(moved) == len(init)  # the step moved every tensor: agreement is not the trivial kind


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (dict(tensor_model_parallel_size=2, actor_num_gpus_per_node=2), "use --train-backend megatron"),
        (
            dict(train_backend="megatron", tensor_model_parallel_size=2, actor_num_gpus_per_node=3),
            "multiple of it",
        ),
        (
            dict(train_backend="megatron", num_layers_per_virtual_pipeline_stage=1),
            "needs --pipeline-model-parallel",
        ),
        (
            dict(
                train_backend="megatron",
                tensor_model_parallel_size=2,
                actor_num_gpus_per_node=2,
                expert_tensor_parallel_size=1,
            ),
            "only with --sequence-parallel",
        ),  # fmt: skip
        (dict(context_parallel_size=2, actor_num_gpus_per_node=2), "use --train-backend megatron"),
        (
            dict(
                train_backend="megatron",
                context_parallel_size=2,
                tensor_model_parallel_size=2,
                actor_num_gpus_per_node=2,
            ),
            "x --context-parallel-size 2 = 4 ranks per model",
        ),
    ],
)
def test_layout_flags_are_refused_before_anything_starts(tiny_hf_checkpoint, flags, match):
    from miles_platform.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match=match):
        RunConfig(hf_checkpoint=tiny_hf_checkpoint, rollout_batch_size=2, **flags).validate()


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (
            dict(tensor_model_parallel_size=2),
            "2 attention heads in 1 query groups",
        ),  # the default tiny: 1 group
        (dict(pipeline_model_parallel_size=4), "2 layers do not divide"),
        (dict(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=3), "do not split"),
    ],
)
def test_layouts_the_model_cannot_split_are_refused_in_preflight(tiny_hf_checkpoint, flags, match):
    from miles_platform.config import ConfigError, RunConfig
    from miles_platform.models.checkpoint import validate_hf_dir
    from miles_platform.training.megatron_parallel import Layout, check_model_fits

    world = flags.get("tensor_model_parallel_size", 1) * flags.get("pipeline_model_parallel_size", 1)
    cfg = RunConfig(hf_checkpoint=tiny_hf_checkpoint, rollout_batch_size=2, train_backend="megatron",
                    actor_num_gpus_per_node=world, **flags).validate()  # fmt: skip
    with pytest.raises(ConfigError, match=match):
        check_model_fits(Layout.from_cfg(cfg), validate_hf_dir(tiny_hf_checkpoint))


@pytest.fixture(scope="module")
def moe_checkpoint(tiny_hf_checkpoint, tmp_path_factory):
    from test_moe_megatron import save_moe_checkpoint

    return save_moe_checkpoint(tiny_hf_checkpoint, tmp_path_factory.mktemp("ep") / "moe")


MOE = dict(use_rollout_routing_replay=True, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
# TP layouts take micro-batches of 2 samples (a router's logits are [T / TP, B, E] under SP: B > 1
# tells a slice of the sequence from a slice of the flat tokens); EP2 is data parallel 2, whose
# ranks take every other sample, so its micro-batches of 1 make the aux loss's token groups the
# 1-rank run's
EXPERT_LAYOUTS = {
    "ep2": dict(expert_model_parallel_size=2, micro_batch_size=1),
    # token budget 14: rank 0's samples (5 + 7 tokens) pack into one micro-batch, rank 1's (7 + 9) into
    # two; the expert ranks must run as many, so rank 0 splits its into two (the 1-rank run's)
    "ep2_dynamic": dict(
        expert_model_parallel_size=2, use_dynamic_batch_size=True, max_tokens_per_gpu=14, micro_batch_size=1
    ),
    "tp2_sp": dict(
        tensor_model_parallel_size=2, sequence_parallel=True, micro_batch_size=2
    ),  # expert TP = TP
    "tp2_sp_etp1": dict(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_tensor_parallel_size=1,
        micro_batch_size=2,
    ),
    "tp2_sp_ep2_etp1": dict(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
        micro_batch_size=2,
    ),
}


def bridge_checkpoint(family: str, tok_dir: str, path: Path) -> str:
    """The tiny GLM-4.5 (test_glm4_moe_bridge.py: q/k/v biases, q/k norm, partial rotary, a dense first
    layer, shared expert, expert bias), routed_scaling_factor 2.5; the tiny Qwen3.5 (test_qwen3_5_bridge.py:
    a gated-DeltaNet and a gated attention layer); or the tiny GPT-OSS (test_gpt_oss_bridge.py: sinks, an
    8-token window, biased clamped experts, every bias drawn); the tiny Qwen3.5-MoE (its experts and gated
    shared expert behind both layer kinds); the tiny MiniMax-M2 (test_minimax_m2_bridge.py: whole-projection
    q/k norms, a partial rotary, sigmoid-routed experts with the score-correction bias)."""
    from miles_platform.models.checkpoint import load_tokenizer, save_hf_checkpoint

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    tok = load_tokenizer(tok_dir)
    if family == "glm4_moe":
        from test_glm4_moe_bridge import glm_config, sharp_model

        model = sharp_model(glm_config(len(tok), routed_scaling_factor=2.5))
    elif family.startswith("qwen3_5"):
        from test_qwen3_5_bridge import q35_config, sharp_q35

        model = sharp_q35(q35_config(len(tok), family))
    elif family == "minimax_m2":
        from test_minimax_m2_bridge import minimax_config
        from test_minimax_m2_bridge import sharp_model as sharp_minimax

        model = sharp_minimax(minimax_config(len(tok)))
    elif family in ("deepseek_v3", "deepseek_v3_halves"):  # halves: HF's half-split rope rows (permuted)
        from test_deepseek_v3_bridge import deepseek_config
        from test_deepseek_v3_bridge import sharp_model as sharp_deepseek

        model = sharp_deepseek(deepseek_config(len(tok), rope_interleave=family == "deepseek_v3"))
    elif family == "deepseek_v32":
        from test_deepseek_v32_bridge import sharp_v32, v32_config

        model = sharp_v32(v32_config(len(tok)))
    else:
        from test_gpt_oss_bridge import gpt_oss_config, sharp_gpt_oss

        model = sharp_gpt_oss(gpt_oss_config(len(tok)))
    save_hf_checkpoint(model, tok, path)
    return str(path)


@pytest.fixture(scope="module")
def bridge_single_rank(tiny_hf_checkpoint, tmp_path_factory):
    """family -> (its checkpoint, its 1-rank step), each made once."""
    runs = {}

    def run(family: str):
        if family not in runs:
            work = tmp_path_factory.mktemp(family)
            ckpt = bridge_checkpoint(family, tiny_hf_checkpoint, work / "hf")
            runs[family] = ckpt, train_one_step(ckpt, work / "out", 1, micro_batch_size=2, **MOE)
        return runs[family]

    return run


@pytest.mark.parametrize(
    "family,layout",
    [
        ("glm4_moe", "tp2_sp"),
        ("glm4_moe", "tp2_sp_ep2_etp1"),
        ("gpt_oss", "tp2_sp_etp1"),
        ("gpt_oss", "tp2_sp_ep2_etp1"),
        ("minimax_m2", "tp2_sp"),
        ("deepseek_v32", "tp2_sp"),
        ("deepseek_v32", "tp2_sp_ep2_etp1"),
        # ~22 s: the GatedDeltaNet split (test_qwen3_5_layout_step_equals_single_rank) and MoE layouts
        # (the rows above) checked apart in `make test`; together in `make test-extended`
        pytest.param("qwen3_5_moe", "tp2_sp", marks=[pytest.mark.slow, pytest.mark.extended]),
    ],
)
def test_bridge_layout_step_equals_single_rank(family, layout, bridge_single_rank, tmp_path):
    """GLM-4.5 (models/bridge/glm4_moe.py) at TP2 + SP with its experts split by TP, and at TP2 + SP + EP2
    with expert TP 1; GPT-OSS (gpt_oss.py) at TP2 + SP and TP2 + SP + EP2, both with expert TP 1
    (megatron builds biased experts at 1 only); MiniMax-M2 (minimax_m2.py) at TP2 + SP, each rank its heads'
    slice of the whole-projection q/k norms with the sums of squares all-reduced; R3 and the load-balancing /
    z losses: the step of the 1-rank run (the q/k/v biases, shared experts, score-correction bias, sinks,
    o_proj's / the routers' / the experts' biases split, replicated or reduced as megatron's layout has them);
    DeepSeek-V3.2 (deepseek_v32.py) at TP2 + SP (and + EP2 at expert TP 1): MLA split as DeepSeek-V3's, the
    frozen DSA indexer whole on each rank over the gathered sequence, each rank's heads attending to the keys it
    picked."""
    ckpt, single = bridge_single_rank(family)
    got = train_one_step(ckpt, tmp_path / layout, 2, **EXPERT_LAYOUTS[layout], **MOE)
    assert_same_step(single, got)
    assert got[0][0]["train/moe_route_flip_frac"] > 0  # the routes replayed are not the model's own


@pytest.fixture(scope="module")
def qwen3_5_single_rank(tiny_hf_checkpoint, tmp_path_factory):
    work = tmp_path_factory.mktemp("qwen3_5")
    ckpt = bridge_checkpoint("qwen3_5", tiny_hf_checkpoint, work / "hf")
    return ckpt, train_one_step(ckpt, work / "one", 1)


@pytest.mark.slow
# PP2 places whole layers on stages as for every family (test_layout_step_equals_single_rank[pp2]): extended
@pytest.mark.parametrize("layout", ["tp2_sp", pytest.param("pp2", marks=pytest.mark.extended)])
def test_qwen3_5_layout_step_equals_single_rank(layout, qwen3_5_single_rank, tmp_path):
    """Qwen3.5 (models/bridge/qwen3_5.py) at TP2 + SP: each rank holds its key / value heads' slice of every
    part of the DeltaNet's in_proj [q; k; v; z; b; a] and conv1d, of dt_bias / A_log, and whole query groups of
    the gated linear_qkv; the DeltaNet's output norm's partial gradients summed over TP. At PP2: the DeltaNet
    on stage 0, the gated attention on stage 1. Each: the 1-rank step."""
    ckpt, single = qwen3_5_single_rank
    assert_same_step(single, train_one_step(ckpt, tmp_path / layout, 2, **LAYOUTS[layout]))


@pytest.fixture(scope="module")
def deepseek_single_rank(tiny_hf_checkpoint, tmp_path_factory):
    """The tiny DeepSeek-V3 and its 1-rank step per micro-batch size."""
    work = tmp_path_factory.mktemp("deepseek")
    ckpt, runs = bridge_checkpoint("deepseek_v3", tiny_hf_checkpoint, work / "hf"), {}

    def run(micro_batch_size: int):
        if micro_batch_size not in runs:
            runs[micro_batch_size] = train_one_step(
                ckpt, work / f"one_mbs{micro_batch_size}", 1, micro_batch_size=micro_batch_size, **MOE
            )
        return runs[micro_batch_size]

    return ckpt, run


@pytest.mark.parametrize("layout", ["ep2", "tp2_sp"])
def test_mla_split_over_ranks_steps_as_one_rank(layout, deepseek_single_rank, tmp_path):
    """DeepSeek-V3 (models/bridge/deepseek_v3.py: MLA, a dense first layer, sigmoid group-limited routing,
    a shared expert, the score-correction bias) at EP2, attention replicated (micro-batches of 1: EP2 is
    data parallel 2), and at TP2 + SP: each rank holds whole heads of the q / kv up projections and of
    linear_proj, and its slice of the latent down projections' rows (the local spec gathers their output
    before the q / kv latent norms, which then see the sequence slice under SP); the experts split by
    expert TP 2. R3 and the load-balancing / z losses included: the 1-rank step."""
    ckpt, single = deepseek_single_rank
    flags = EXPERT_LAYOUTS[layout]
    got = train_one_step(ckpt, tmp_path / layout, 2, **flags, **MOE)
    assert_same_step(single(flags["micro_batch_size"]), got)
    assert got[0][0]["train/moe_route_flip_frac"] > 0  # the routes replayed are not the model's own


@pytest.fixture(scope="module")
def moe_single_rank(moe_checkpoint, tmp_path_factory):
    """The 1-rank step per micro-batch size."""
    runs = {}

    def run(micro_batch_size: int):
        if micro_batch_size not in runs:
            out = tmp_path_factory.mktemp(f"ep1_mbs{micro_batch_size}") / "out"
            runs[micro_batch_size] = train_one_step(
                moe_checkpoint, out, 1, micro_batch_size=micro_batch_size, **MOE
            )
        return runs[micro_batch_size]

    return run


@pytest.mark.parametrize("layout", list(EXPERT_LAYOUTS))
def test_expert_layout_step_with_routing_replay_equals_single_rank(
    layout, moe_checkpoint, moe_single_rank, tmp_path
):
    """EP2 (each rank holds 2 of the 4 experts; data parallel 2 for the rest), TP2 + SP with the
    experts unsplit (expert TP 1: each rank runs all experts on its slice of the sequence, expert data
    parallel 2) and TP2 + SP with EP2 at expert TP 1, with R3 and the load-balancing / z losses: the
    step of the 1-rank run."""
    got = train_one_step(moe_checkpoint, tmp_path / layout, 2, **EXPERT_LAYOUTS[layout], **MOE)
    assert_same_step(moe_single_rank(EXPERT_LAYOUTS[layout]["micro_batch_size"]), got)
    assert got[0][0]["train/moe_route_flip_frac"] > 0  # the routes replayed are not the model's own
    rows = sample_rows(tmp_path / layout)
    tp = EXPERT_LAYOUTS[layout].get("tensor_model_parallel_size", 1)
    # data parallel 2: each rank writes its own samples' rows; TP 2: TP rank 0 writes them all
    assert [r["index"] for r in rows] == [0, 1, 2, 3] and {r["rank"] for r in rows} == (
        {0} if tp > 1 else {0, 1}
    )


# the head / query-group / layer / expert counts of the models the docs' command lines name
DOC_MODELS = {
    "/models/Qwen3-4B": dict(num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=36),
    "/models/Qwen3-30B-A3B": dict(num_attention_heads=32, num_key_value_heads=4, num_hidden_layers=48,
                                  num_experts=128, moe_intermediate_size=768),
}  # fmt: skip


def doc_command_lines(doc: str = "docs/megatron.md") -> list[list[str]]:
    """The argv of each `miles-platform train` line of the doc's Miles-style block (`$((...))` evaluated,
    the trailing `...` dropped)."""
    import re
    import shlex

    text = (Path(__file__).resolve().parents[3] / doc).read_text()
    block = text.split("### A Miles-style command line", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = re.sub(r"\\\n\s*", " ", block).splitlines()
    lines = [re.sub(r"\$\(\((.*?)\)\)", lambda m: str(eval(m.group(1))), c) for c in lines]  # noqa: S307
    return [
        [a for a in shlex.split(c)[2:] if a != "..."] for c in lines if c.startswith("miles-platform train")
    ]


def test_the_docs_miles_style_command_lines_validate(layout_checkpoint, tmp_path):
    """docs/megatron.md's TP2 / PP2 / CP2 / EP8 lines parse and validate as `miles-platform train` does
    before Ray starts: the flags, and the layout against the named model's shapes; the CPU line
    (`DIR`) through the whole preflight on a 4-layer checkpoint with 4 heads in 2 query groups."""
    from miles_platform.config.cli import parse_run_config
    from miles_platform.data.tasks import write_task_datasets
    from miles_platform.preflight import validate_before_start
    from miles_platform.training.megatron_parallel import Layout, check_model_fits

    task = write_task_datasets(tmp_path / "task", seed=0)
    argvs = doc_command_lines()
    assert len(argvs) == 4 and all("--tensor-model-parallel-size" in a for a in argvs)
    rest = ["--prompt-data", task["train"], "--rm-type", "math", "--label-key", "label",
            "--rollout-batch-size", "16", "--storage-root", str(tmp_path / "root")]  # fmt: skip
    for argv in argvs:
        ckpt = argv[argv.index("--hf-checkpoint") + 1]
        cfg = parse_run_config([layout_checkpoint if a == "DIR" else a for a in argv] + rest)
        if ckpt == "DIR":
            validate_before_start(cfg)
        else:
            check_model_fits(Layout.from_cfg(cfg), DOC_MODELS[ckpt])
        assert cfg.data_parallel_size() == (1 if ckpt == "DIR" else 2)
