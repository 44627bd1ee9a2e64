"""Everything checkable before any engine or actor starts (Ray included): a user's mistake costs
one second, and nothing is written under the storage root until it passes."""

from __future__ import annotations

import os

from miles_platform.config import ConfigError, RunConfig
from miles_platform.store.paths import StoragePaths


def validate_before_start(cfg: RunConfig) -> None:
    """Config, checkpoint, secret, transport x engine, rewards, custom paths, trackers, data."""
    cfg.validate()
    if not cfg.hf_checkpoint:
        raise ConfigError("--hf-checkpoint is required (HF dir with config, weights and tokenizer)")
    check_object_store(cfg)
    if not cfg.load_debug_rollout_data and cfg.loss_type != "sft_loss" and not cfg.debug_train_only:
        from miles_platform.rollout import rm_hub

        rm_hub.validate_reward_config(cfg)  # config only: before the tokenizer loads (seconds)
    from miles_platform.models.checkpoint import validate_hf_dir

    hf = validate_hf_dir(cfg.hf_checkpoint)
    from miles_platform.models.architecture import check_model_args

    check_model_args(cfg.model_args_given(), hf, os.path.join(cfg.hf_checkpoint, "config.json"))
    _check_moe(cfg, hf)
    if cfg.uses_lora and not cfg.debug_rollout_only:
        _check_lora_targets(cfg, hf)
    from miles_platform.config.vision import check_vision_checkpoint

    check_vision_checkpoint(cfg, hf)
    if cfg.megatron_layout_flags() and not cfg.debug_rollout_only:
        from miles_platform.training.megatron_parallel import Layout, check_model_fits

        check_model_fits(Layout.from_cfg(cfg), hf)
    _check_vocab(cfg, hf)
    cfg.resolve_api_key()  # secure by default: no run is open to other local processes
    from miles_platform.cluster.cpu_pinning import plan, trainer_threads

    threads = trainer_threads()  # $MILES_TRAIN_THREADS, read here so a bad value fails before Ray
    plan(cfg, int(threads))  # --pin-trainer-cpus: honoured on this machine, or refused here
    from miles_platform.weights.transports import check_engine_kind

    check_engine_kind(cfg)
    from miles_platform.training.qat import check_int4_qat
    from miles_platform.weights.rollout_quant import rollout_quant

    rollout_quant(cfg.hf_checkpoint)  # a quantized one: a variant updates can be re-quantized to
    check_int4_qat(cfg)  # OPEN_TRAINING_INT4_FAKE_QAT_FLAG: an int4 rollout checkpoint, fsdp
    _check_fault_targets(cfg)
    _check_sglang_args_have_an_engine(cfg)
    if cfg.embedded_engines_only:
        from miles_platform.rollout.engine_fleet import (
            EMBEDDED_SGLANG_ARGS,
            embedded_chat_parsers,
            embedded_max_running_requests,
            embedded_mem_fraction_static,
        )

        other = sorted(k for k in cfg.sglang_args if k.replace("_", "-") not in EMBEDDED_SGLANG_ARGS)
        if other:
            raise ConfigError(
                f"--sglang-{other[0]} (and {len(other) - 1} more) would be ignored: the embedded engine takes "
                f"only {', '.join('--sglang-' + a for a in EMBEDDED_SGLANG_ARGS)}; use --rollout-engine "
                "sglang for the others"
            )
        embedded_max_running_requests(cfg)
        embedded_mem_fraction_static(cfg)
        embedded_chat_parsers(cfg)
    for flag, d in (("--storage-root", cfg.storage_root), ("--save", cfg.save)):
        check_writable_dir(flag, d)
    from miles_platform.trackers import validate_trackers

    validate_trackers(cfg, StoragePaths(cfg.storage_root))
    check_hooks(cfg)
    if cfg.load_debug_rollout_data:
        return
    if not cfg.prompt_data and cfg.uses_global_dataset:
        raise ConfigError(
            "--prompt-data is required (JSONL or Parquet of prompts), or a --data-source-path class, or "
            "--disable-rollout-global-dataset with a --rollout-function-path that brings its data"
        )
    from miles_platform.rollout import generate_hub

    generate_hub.validate_config(cfg)
    from miles_platform.rollout import filter_hub

    filter_hub.load_dynamic_filter(cfg)
    filter_hub.load_rollout_sample_filter(cfg)
    filter_hub.load_buffer_filter(cfg)
    from miles_platform.rollout.data_buffer import load_buffer_class

    load_buffer_class(cfg)  # --custom-async-data-buffer-path: a DataBuffer subclass
    from miles_platform.plugins import load_function

    if cfg.custom_loss_function_path:
        load_function(cfg.custom_loss_function_path, "--custom-loss-function-path")
    if cfg.custom_tis_function_path:
        load_function(cfg.custom_tis_function_path, "--custom-tis-function-path", 1)  # fn(args, *, ...)
    if cfg.custom_update_weight_post_write_path:
        load_function(cfg.custom_update_weight_post_write_path, "--custom-update-weight-post-write-path", 3)


def check_hooks(cfg: RunConfig) -> None:
    """Every customization hook given (config/hooks.py) and the --eval-function-path imports and takes
    Miles' arguments."""
    from miles_platform.config.hooks import HOOKS
    from miles_platform.plugins import load_hook

    for name in HOOKS:
        load_hook(cfg, name)
    if cfg.eval_function_path:
        from miles_platform.plugins import EVAL_FLAG, load_rollout_function

        fn = load_rollout_function(cfg.eval_function_path, EVAL_FLAG)
        if not fn.takes_evaluation and not isinstance(fn.obj, type):
            raise ConfigError(
                f"{EVAL_FLAG} {cfg.eval_function_path!r}: takes no `evaluation` argument; Miles calls it as "
                "generate_rollout(args, rollout_id, data_source, evaluation=True)"
            )


def check_object_store(cfg: RunConfig) -> None:
    """What an object-store --storage-root / --save / --load / --update-weight-disk-dir supports
    (store/remote.py, docs/data_and_store.md); the rest is refused here with its flag named."""
    from miles_platform.store.remote import is_remote

    for flag, value in (
        ("--hf-checkpoint", cfg.hf_checkpoint),
        ("--update-weight-local-checkpoint-dir", cfg.update_weight_local_checkpoint_dir),
        ("--save-debug-rollout-data", cfg.save_debug_rollout_data),
        ("--load-debug-rollout-data", cfg.load_debug_rollout_data),
    ):
        if is_remote(value):
            raise ConfigError(f"{flag} {value}: must be a local path (object stores serve --storage-root, "
                              "--save, --load and --update-weight-disk-dir)")  # fmt: skip
    root = cfg.storage_root
    if not is_remote(root):
        return
    if cfg.uses_lora:
        raise ConfigError(
            f"--lora-rank {cfg.lora_rank} with --storage-root {root}: LoRA adapter versions are written "
            "and served from a local dir; use a local --storage-root for LoRA runs"
        )
    if cfg.save_hf:
        raise ConfigError(
            f"--save-hf {cfg.save_hf} with --storage-root {root}: the copy of an object-store export is not "
            f"built; every version is already an HF dir under {root}/runs/<run>/hf/"
        )
    external = not cfg.embedded_engines_only
    if external and cfg.update_weight_transfer_mode in ("disk", "disk-delta"):
        raise ConfigError(
            f"--update-weight-transfer-mode {cfg.update_weight_transfer_mode} with --storage-root {root}: "
            "SGLang engines load HF exports from a local path and those are on the object store; use "
            "--rollout-engine embedded (downloads them) or --update-weight-transfer-mode broadcast"
        )


def _check_lora_targets(cfg: RunConfig, hf_config: dict) -> None:
    """--target-modules / --exclude-modules resolved against the checkpoint's modules (a meta-device
    model: no weights), on megatron each mapped to its layer: the trainer's refusals, before Ray."""
    from miles_platform.training.lora import hf_meta_model, lora_config, resolve_target_modules, split_targets

    targets = resolve_target_modules(hf_meta_model(hf_config), cfg.target_modules, cfg.exclude_modules)
    lora_config(cfg, targets)  # (an expert adapter has no dropout)
    if cfg.train_backend == "megatron":
        from miles_platform.training.megatron_lora import check_lora_model, megatron_target

        check_lora_model(hf_config)
        for t in targets:
            megatron_target(t, mla=bool(hf_config.get("kv_lora_rank")))
        experts = split_targets(targets)[1]
        if experts and max(cfg.tensor_model_parallel_size, cfg.expert_tensor_parallel_size or 1) > 1:
            raise ConfigError(
                f"--target-modules: {experts[0]}: expert adapters on megatron are built at tensor parallel 1; "
                "use --tensor-model-parallel-size 1, --target-modules attn, or --train-backend fsdp"
            )


def _check_moe(cfg: RunConfig, hf_config: dict) -> None:
    """MoE on megatron: EP=1, what the bridge maps (docs/moe.md); R3 and --moe-* flags need an MoE model."""
    from miles_platform.models.families import is_moe_config

    moe = is_moe_config(hf_config)
    if cfg.train_backend == "megatron" and not cfg.debug_rollout_only:
        _check_megatron_family(cfg, hf_config)
    if cfg.train_backend == "megatron" and not cfg.debug_rollout_only and (moe or _hf_family(hf_config)):
        _check_bridge_refusals(cfg, hf_config)
    if cfg.moe_flags() and not moe:
        raise ConfigError(
            f"{', '.join(cfg.moe_flags())}: --hf-checkpoint {cfg.hf_checkpoint} is "
            f"{hf_config.get('architectures')} (dense): it has no experts or routers"
        )
    if cfg.use_rollout_routing_replay and not moe:
        raise ConfigError(
            f"--use-rollout-routing-replay: --hf-checkpoint {cfg.hf_checkpoint} is "
            f"{hf_config.get('architectures')} (dense): there are no expert routes to replay"
        )


def _check_fault_targets(cfg: RunConfig) -> None:
    """--ci-fault-hooks requests this run's processes can fire: trainer_weight_update_before_send
    only where a rank sends weights (the broadcast transport, full weights), an engine target
    (`"target": {"engine": N}`) only on the run's own embedded engines, at an index it has."""
    from miles_platform.cluster.ray_cluster import rollout_num_devices
    from miles_platform.fault_hooks import parse_fault_hooks

    reqs = parse_fault_hooks(cfg.ci_fault_hooks)
    sends = [r for r in reqs if r.hook_name == "trainer_weight_update_before_send"]
    if sends and (cfg.update_weight_transfer_mode != "broadcast" or cfg.uses_lora):
        raise ConfigError(
            f"--ci-fault-hooks {sends[0].request_id}: trainer_weight_update_before_send fires in the rank "
            "that sends the weights, which only --update-weight-transfer-mode broadcast has (full weights, "
            f"not LoRA); this run's transport is {cfg.update_weight_transfer_mode!r}"
        )
    engines = [r for r in reqs if r.engine is not None]
    if not engines:
        return
    if not cfg.embedded_engines_only or cfg.debug_train_only:
        raise ConfigError(f"--ci-fault-hooks {engines[0].request_id}: an engine target acts on the run's "
                          "embedded engine processes; this run has none (SGLang, external engines or "
                          "--debug-train-only)")  # fmt: skip
    n = rollout_num_devices(cfg) // cfg.rollout_num_gpus_per_engine
    bad = [r for r in engines if r.engine >= n]
    if bad:
        raise ConfigError(f"--ci-fault-hooks {bad[0].request_id}: engine {bad[0].engine}, but the run has {n} "
                          f"engine(s) (0..{n - 1})")  # fmt: skip


def _check_megatron_family(cfg: RunConfig, hf_config: dict) -> None:
    """A family without a megatron bridge (models/families.py `Family.megatron`), refused by name."""
    from miles_platform.models.families import family_of

    fam = family_of(hf_config)
    if fam is not None and fam.megatron:
        raise ConfigError(
            f"--train-backend megatron: --hf-checkpoint {cfg.hf_checkpoint} is {fam.architecture} "
            f"({fam.name}): {fam.megatron}"
        )


def _hf_family(hf_config: dict) -> bool:
    """An HF-only family (models/families.py HF_FAMILIES) with a megatron bridge, e.g. Qwen3.5."""
    from miles_platform.models.families import HF_FAMILIES, family_of

    fam = family_of(hf_config)
    return fam is not None and fam.name in HF_FAMILIES


def _check_bridge_refusals(cfg: RunConfig, hf_config: dict) -> None:
    """The bridge's own refusals (e.g. dense layers between the sparse ones, Qwen3.5's attention_bias),
    before Ray."""
    from miles_platform.errors import CheckpointError
    from miles_platform.models.bridge import get_bridge

    try:
        get_bridge(hf_config).transformer_config(hf_config)
    except CheckpointError as e:
        raise ConfigError(f"--hf-checkpoint {cfg.hf_checkpoint} with --train-backend megatron: {e}") from e


def check_batch_fits(cfg: RunConfig, dataset_rows: int) -> None:
    """A rollout takes --rollout-batch-size (or --over-sampling-batch-size) distinct prompts: more than
    the data has would repeat prompts within one batch (Miles' data source hands out fewer)."""
    flag, want = max(
        ("--rollout-batch-size", cfg.rollout_batch_size or 0),
        ("--over-sampling-batch-size", cfg.over_sampling_batch_size or 0),
        key=lambda fw: fw[1],
    )
    if want > dataset_rows:
        raise ConfigError(
            f"{flag} {want} is more than the {dataset_rows} prompt(s) of --prompt-data "
            f"{cfg.prompt_data}: lower it or add prompts"
        )


def fill_defaults(cfg: RunConfig, paths: StoragePaths, dataset_rows: int) -> None:
    """--save defaults to the run's checkpoint dir; --num-rollout to --num-epoch passes over the data."""
    if cfg.save is None:
        cfg.save = paths.checkpoints(cfg.run_name)
    if cfg.num_rollout is None:
        epochs = cfg.num_epoch or 1
        cfg.num_rollout = max(1, epochs * dataset_rows // cfg.rollout_batch_size)
    world = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
    dp = cfg.data_parallel_size()
    if cfg.global_batch_size % dp:
        over = (
            f"{world} trainer ranks"
            if dp == world
            else f"{dp} data-parallel ranks ({world} trainer ranks / TP x PP x CP)"
        )
        raise ConfigError(f"--global-batch-size {cfg.global_batch_size} must divide over {over}")


def check_writable_dir(flag: str, path: str | None) -> None:
    """A local dir the run will write: an existing dir this user can write, or one it can create
    (its nearest existing parent is a writable dir). Checked before anything is written, so an
    unwritable or mistyped root fails here with the flag named, not in a traceback mid-start."""
    if not path or "://" in str(path):
        return  # object stores: check_object_store
    import tempfile

    p = os.path.abspath(path)
    probe_in = p
    while not os.path.exists(probe_in):
        probe_in = os.path.dirname(probe_in)
    if not os.path.isdir(probe_in):
        raise ConfigError(f"{flag} {path}: {probe_in} exists and is not a directory")
    try:  # an empty dir made and removed at once: os.access says yes to root even on /proc
        os.rmdir(tempfile.mkdtemp(prefix=".miles-probe-", dir=probe_in))
    except OSError as e:
        what = "write there" if probe_in == p else f"create it (in {probe_in})"
        raise ConfigError(f"{flag} {path}: this user cannot {what}: {e.strerror}") from None


def _check_vocab(cfg: RunConfig, hf: dict) -> None:
    """The tokenizer's ids must fit the model's embedding: a tokenizer larger than `vocab_size`
    (another model's tokenizer beside the weights) made ids the model has no row for, and the run
    died mid-rollout. A smaller tokenizer is normal (padded embeddings)."""
    from miles_platform.models.checkpoint import embedding_rows, load_tokenizer

    rows = embedding_rows(hf)
    if rows is None:
        return
    n = len(load_tokenizer(cfg.hf_checkpoint))
    if n > rows:
        raise ConfigError(
            f"--hf-checkpoint {cfg.hf_checkpoint}: its tokenizer has {n} tokens but the model's vocab_size is "
            f"{rows}: ids >= {rows} have no embedding row. Put the model's own tokenizer beside its weights"
        )


def _check_sglang_args_have_an_engine(cfg: RunConfig) -> None:
    """`--sglang-*` flags go to engines the run starts: refused where it starts none (attached
    engines run with the flags they were started with; --debug-train-only and
    --load-debug-rollout-data start no engine)."""
    if not cfg.sglang_args:
        return
    flag = "--sglang-" + sorted(cfg.sglang_args)[0].replace("_", "-")
    why = None
    if cfg.rollout_external_engine_addrs:
        why = ("the engines of --rollout-external-engine-addrs are attached, not started: they run with "
               "the flags they were started with (set it there)")  # fmt: skip
    elif cfg.debug_train_only or cfg.load_debug_rollout_data:
        why = "--debug-train-only / --load-debug-rollout-data start no rollout engine"
    if why:
        raise ConfigError(f"{flag} (of {len(cfg.sglang_args)} --sglang-* flag(s)) would be ignored: {why}")
