"""Everything megatron-core needs to run on a CPU-only machine, in one place.

megatron-core 0.16 assumes CUDA in a few spots that the local layer spec and torch_dist
checkpointing otherwise do not need. Each shim below is a no-op when CUDA is available:

- `GlobalMemoryBuffer.get_tensor` allocates on `torch.cuda.current_device()`: allocate on CPU.
- the RNG tracker is normally seeded by `model_parallel_cuda_manual_seed` (CUDA RNG): create it
  with `initialize_rng_tracker(inference_rng_tracker=True)`, which forks no CUDA state.
- `FileSystemWriterAsync.preload_tensors` defaults to pinned, non-blocking D2H copies followed
  by `torch.cuda.synchronize()`: force `non_blocking=False`.
- the sliding-window attention mask (GPT-OSS) is built on "cuda": build it on the rank's device.
- GatedDeltaNet (Qwen3.5) needs flash-linear-attention's CUDA kernels: megatron_gdn.install_cpu_fla
  gives it their torch equivalents.
- megatron's `jit_fuser` is `torch.compile`: on a CPU, inductor compiles C++ for each decorated
  function in each process (the gated attention's output gate alone ~2.9 s of a 3.5 s Qwen3.5 step,
  once per rank), to fuse a few elementwise ops; `_eager_jit_fuser` runs them as written.
- `torch.cuda.current_device()` is called for RoPE frequencies, attention buffers and the
  failure flag that `dist_checkpointing.save` all-reduces: on a machine without CUDA (where the
  call could only raise) it answers the rank's device (`set_shim_device`; "cpu" unless a test runs
  the backend on its fake device, tests/device_check.py), and the buffers are allocated there.

Without transformer-engine (any machine, CUDA or not), `moe/moe_utils.py` leaves the names it
imports from TE undefined (its `except ImportError` only sets HAVE_TE = False), and the MoE
router's `router_gating_linear` reads `te_general_gemm`: `apply_no_te_shims` defines them as None,
which selects the torch paths. MLA (DeepSeek-V3) imports TE's `TELinear`, which without TE is a
MagicMock instance (megatron subclasses a mocked `te`), and tests `isinstance(linear_proj, TELinear)`
under its own HAVE_TE: `apply_no_te_shims` turns that HAVE_TE off.

Process groups: `init_process_group` (gloo; world size 1 meets in a HashStore, more ranks at a
TCPStore that listens on 127.0.0.1 only, `cluster.ports.tcp_store`) and `destroy_process_group` wrap torch.distributed and megatron's parallel_state together.
dist_checkpointing.save forks writer processes, so entry points that save need an
`if __name__ == "__main__"` guard.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

from miles_platform.cluster.ports import gloo_on_loopback, tcp_store

_APPLIED = False
_DEVICE = "cpu"  # what the shimmed torch.cuda.current_device() answers (no CUDA only)


def set_shim_device(device) -> None:
    """The device megatron's CUDA-assuming spots allocate on when CUDA is absent (the rank's)."""
    global _DEVICE
    _DEVICE = str(device)


def cuda_available() -> bool:
    return torch.cuda.is_available()


# what megatron/core/transformer/moe/moe_utils.py imports from transformer_engine
_TE_MOE_NAMES = (
    "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute", "fused_permute_with_probs",
    "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function",
    "fused_unpermute", "te_general_gemm",
)  # fmt: skip


def apply_no_te_shims() -> None:
    """Define moe_utils' TE names as None when TE did not import (see the module docstring)."""
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    # Without TE, megatron's extensions/transformer_engine.py subclasses a MagicMock, so MLA imports
    # `TELinear` as a mock instance and sets its HAVE_TE; `isinstance(linear_proj, TELinear)` in
    # MLA's constructor then raises TypeError (measured): MLA's TE branches are off without TE.
    if not isinstance(multi_latent_attention.TELinear, type | None):
        multi_latent_attention.HAVE_TE = False
    from miles_platform.training.megatron_mla import install_duplicated_linear

    install_duplicated_linear()  # MLA's down projections whole on every TP rank, as TE's spec (megatron_mla)
    if moe_utils.HAVE_TE:
        return
    for name in _TE_MOE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def _eager_jit_fuser() -> None:
    """Every function megatron-core compiled with its `jit_fuser` (`torch.compile`) runs eagerly: the
    ones already defined (methods such as `SelfAttention._apply_output_gate`, `Router._apply_expert_bias`,
    `GatedDeltaNet._apply_gated_norm`; module functions and their from-imports) get their original back,
    and `megatron.core.jit.jit_fuser` is megatron's own no-op for modules imported later and for the
    functions experts build per instance (`disable_jit_fuser`). CPU only: on CUDA the fusion is the point."""
    import sys
    import types

    from megatron.core import jit

    def compiled(value) -> bool:  # torch.compile's wrapper function (not a mock answering every name)
        if not isinstance(value, types.FunctionType) or "_torchdynamo_orig_callable" not in vars(value):
            return False
        return (getattr(value._torchdynamo_orig_callable, "__module__", None) or "").startswith("megatron.")

    jit.disable_jit_fuser()
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.") or not isinstance(module, types.ModuleType):
            continue
        if "jit_fuser" in vars(module):
            module.jit_fuser = jit.noop_decorator
        for attr, value in list(vars(module).items()):
            if compiled(value):
                setattr(module, attr, value._torchdynamo_orig_callable)
            elif isinstance(value, type) and value.__module__ == name:
                for key, member in list(vars(value).items()):
                    if compiled(member):
                        setattr(value, key, member._torchdynamo_orig_callable)


def apply_cpu_shims() -> bool:
    """Patch megatron-core for CPU. Idempotent; returns True when shims are active (no CUDA)."""
    global _APPLIED
    apply_no_te_shims()
    if cuda_available():
        return False
    if _APPLIED:
        return True
    from megatron.core import utils as mcore_utils
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        numel = 1
        for d in tensor_shape:
            numel *= int(d)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < numel or buf.device != torch.device(_DEVICE):
            buf = self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype, device=_DEVICE)
        return buf[:numel].view(*tensor_shape)

    mcore_utils.GlobalMemoryBuffer.get_tensor = get_tensor
    torch.cuda.current_device = _cpu_device
    torch.cuda.synchronize = _no_sync  # pipeline p2p guards batch_isend_irecv with it
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _CudaMeansCpu(torch)  # total_num_tokens = torch.zeros(..., device="cuda")
    from megatron.core.tensor_parallel import random as mcore_random

    # activation recompute saves and restores the CUDA generator around each checkpointed layer
    # (the CPU generator separately): without CUDA there is none to save
    mcore_random._get_cuda_rng_state = _no_cuda_rng_state
    mcore_random._set_cuda_rng_state = _set_no_cuda_rng_state
    _alltoall_dispatcher_on_cpu()
    _rope_cp_slice_on_cpu()
    _sliding_window_mask_on_cpu()
    from miles_platform.training.megatron_gdn import install_cpu_fla

    install_cpu_fla()  # Qwen3.5's GatedDeltaNet: fla's two functions in torch (megatron_gdn.py)
    _eager_jit_fuser()

    original_preload = filesystem_async.FileSystemWriterAsync.preload_tensors

    def preload_tensors(write_buckets, non_blocking=True):
        return original_preload(write_buckets, non_blocking=False)

    filesystem_async.FileSystemWriterAsync.preload_tensors = staticmethod(preload_tensors)
    # The writer's results queue lives in a multiprocessing Manager started with "spawn": a fresh
    # interpreter that re-imports the parent's __main__ (torch, dagster, ...), ~7 s before the first
    # torch_dist save of a process. A forked Manager serves the same queue in ~0.1 s (the writer
    # processes themselves are forked already); CPU only, where no CUDA context can be forked.
    # The Manager's server watches this process: a rank killed -9 (a fault hook, the OOM killer)
    # left it serving forever, ~370 MB with torch, orphaned (one per killed megatron rank)
    if filesystem_async._results_queue is None:
        from multiprocessing.managers import SyncManager

        manager = SyncManager(ctx=torch.multiprocessing.get_context("fork"))
        manager.start(_exit_with_parent, (os.getpid(),))
        filesystem_async._results_queue = manager.Queue()
    _APPLIED = True
    return True


def _exit_with_parent(parent: int, poll_s: float = 0.5) -> None:
    """In a forked helper process: exit once `parent` is gone (this process is re-parented). A
    thread polling the parent pid, not PR_SET_PDEATHSIG, which fires when the *thread* that forked
    exits (a rank may build its trainer off the main thread)."""
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def init_rng(seed: int) -> None:
    """Seed torch and megatron's model-parallel RNG tracker (CPU: no CUDA RNG states)."""
    torch.manual_seed(seed)
    if cuda_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
        return
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _cpu_device() -> str:
    return _DEVICE


def _no_sync(device=None) -> None:
    return None


def _alltoall_dispatcher_on_cpu() -> None:
    """megatron's alltoall MoE token dispatcher (expert parallelism with tokens per rank that differ)
    copies its split sizes to the host on a side CUDA stream it creates at construction; on a CPU
    they are host tensors already: no stream, and the splits become the numpy arrays it expects."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as A2A

    A2A.cuda_dtoh_stream = "cpu"  # not None: the constructor would create a torch.cuda.Stream

    def dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                v = getattr(self, name, None)
                if torch.is_tensor(v):
                    setattr(self, name, v.numpy())
        return tokens_per_expert

    A2A._maybe_dtoh_and_synchronize = dtoh_and_synchronize


def _rope_cp_slice_on_cpu() -> None:
    """RoPE under context parallelism slices its position table for the CP rank with an index built
    in pinned memory and moved by `.cuda()`: build it where the table is."""
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    def pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        cp, rank = cp_group.size(), cp_group.rank()
        idx = torch.tensor([rank, 2 * cp - rank - 1], device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[seq_dim + 1 :])
        pos_emb = pos_emb.index_select(seq_dim, idx)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])

    rope_utils.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank


def _sliding_window_mask_on_cpu() -> None:
    """The local attention's sliding-window layers (GPT-OSS) build their [sq, skv] mask on "cuda"
    (`get_sliding_window_causal_mask`, imported into fused_softmax): build the same mask on the rank's
    device."""
    from megatron.core.fusions import fused_softmax

    def sliding_window_causal_mask(sq, skv, window_size):
        m = torch.ones(sq, skv, dtype=torch.bool, device=_DEVICE)
        kept = torch.tril(
            torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1]
        )
        return ~kept

    fused_softmax.get_sliding_window_causal_mask = sliding_window_causal_mask


def _no_cuda_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(new_state, device: int = -1, graph_safe: bool = False) -> None:
    return None


_FACTORIES = frozenset({"zeros", "ones", "empty", "full", "tensor", "arange"})


class _CudaMeansCpu:
    """`torch` as one megatron module sees it on a machine without CUDA: a factory asked for
    device "cuda" allocates on the CPU. Everything else is torch itself."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name not in _FACTORIES:
            return attr

        def on_cpu(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return attr(*args, **kwargs)

        return on_cpu


@contextlib.contextmanager
def tensor_cuda_is_cpu():
    """Around model construction without CUDA: `Tensor.cuda()` (megatron moves the tied embedding
    copy of the last pipeline stage there before all-reducing it) returns the tensor itself."""
    if cuda_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def init_process_group(
    rank: int = 0,
    world_size: int = 1,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    master_port: int | None = None,
    seed: int = 1234,
    device: torch.device | str | None = None,
    layout=None,
    num_layers: int | None = None,
) -> None:
    """torch.distributed (gloo on CPU, nccl on GPU) + megatron parallel_state, if not already up.
    `device`: the rank's (default: `cuda:<rank % GPUs>` with CUDA, else the CPU). `layout`
    (megatron_parallel.Layout) wins over the two sizes; `num_layers` sizes virtual stages."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from miles_platform.cluster.devices import group_backend

    if device is None:
        device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda_available() else "cpu"
    device = torch.device(device)
    set_shim_device(device)
    apply_cpu_shims()
    if not dist.is_initialized():
        if master_port is None and world_size != 1:
            raise ValueError("init_process_group: world_size > 1 needs an agreed master_port")
        backend = group_backend(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if world_size == 1:  # nobody to meet: no rendezvous server, no gloo pairs
            store = dist.HashStore()
        else:
            gloo_on_loopback("127.0.0.1")  # gloo itself on CPU; megatron's gloo subgroups on GPU too
            store = tcp_store("127.0.0.1", master_port, world_size, rank == 0, timeout_s=1800.0)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    if not parallel_state.model_parallel_is_initialized():
        if layout is None:
            parallel_state.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size)
        else:
            parallel_state.initialize_model_parallel(**layout.init_kwargs(num_layers))
    init_rng(seed)


def init_single_process_group(tensor_model_parallel_size: int = 1, seed: int = 1234) -> None:
    """World size 1: no rendezvous server, no port."""
    init_process_group(0, 1, tensor_model_parallel_size, seed=seed)


def destroy_process_group() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


_FORWARD_TAG, _BACKWARD_TAG = 1, 2


def tag_pipeline_shape_exchange() -> None:
    """Pipeline stages over gloo: exchange micro-batch shapes with one tag per direction.

    megatron's `_communicate_shapes` always batches its sends and receives, posting a send to the
    previous stage before a send to the next one. gloo matches a pair's messages by tag in posting
    order, so with two stages (next rank = previous rank) the gradient's shape arrives in the
    activation's receive and the interleaved schedule deadlocks or mismatches. Tagging the
    activation direction and the gradient direction apart makes the order irrelevant."""
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    if getattr(p2p.P2PCommunicator._communicate_shapes, "_tagged", False):
        return
    import torch.distributed as dist

    def communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        dev = torch.cuda.current_device() if cuda_available() else "cpu"
        ops, got_prev, got_next = [], None, None

        def op(kind, t, peer, tag):
            ops.append(dist.P2POp(kind, t, peer, self.pp_group, tag))

        if tensor_send_prev is not None:
            op(
                dist.isend,
                torch.tensor(tensor_send_prev.size(), dtype=torch.int64, device=dev),
                self.prev_rank,
                _BACKWARD_TAG,
            )
        if recv_prev:
            got_prev = torch.empty((3,), dtype=torch.int64, device=dev)
            op(dist.irecv, got_prev, self.prev_rank, _FORWARD_TAG)
        if tensor_send_next is not None:
            op(
                dist.isend,
                torch.tensor(tensor_send_next.size(), dtype=torch.int64, device=dev),
                self.next_rank,
                _FORWARD_TAG,
            )
        if recv_next:
            got_next = torch.empty((3,), dtype=torch.int64, device=dev)
            op(dist.irecv, got_next, self.next_rank, _BACKWARD_TAG)
        for req in dist.batch_isend_irecv(ops) if ops else []:
            req.wait()
        return (
            got_prev.tolist() if got_prev is not None else [0, 0, 0],
            got_next.tolist() if got_next is not None else [0, 0, 0],
        )

    communicate_shapes._tagged = True
    p2p.P2PCommunicator._communicate_shapes = communicate_shapes


_OPTIMIZER_SHIMMED = False


def apply_optimizer_cpu_shims() -> bool:
    """megatron-core's DistributedOptimizer (--use-distributed-optimizer) on a machine without CUDA.
    Idempotent; returns True when the CPU shims are active. Measured with megatron-core 0.16 on CPU
    (and, on any device without apex / TE, the checkpoint fix `_step_kept_on_load`):

    - `DistributedOptimizer.__init__` files each parameter by `param.type()`, comparing it with
      'torch.cuda.FloatTensor' / 'torch.cuda.HalfTensor' / 'torch.cuda.BFloat16Tensor', and raises
      TypeError "Wrapped parameters must be one of torch.cuda.FloatTensor, ..." for anything else (a CPU
      tensor answers 'torch.FloatTensor'); `clip_grad_by_total_norm_fp32` asserts the same of each
      gradient. What they check is the dtype: within those two calls only, a CPU tensor's bare `type()`
      answers its CUDA name (`_cuda_type_names`).
    - optimizer.py, clip_grads.py, distrib_optimizer.py and the local (no apex / TE) multi-tensor
      kernels of utils.py allocate their overflow flags, norms and scales with device="cuda": they
      allocate on the CPU (`_CudaMeansCpu`, as the pipeline schedule's token count); so do the
      --fp16 grad scalers of grad_scaler.py, whose DynamicGradScaler.load_state_dict moves the
      saved scale with `.cuda(torch.cuda.current_device())`: it is loaded onto the scaler's device."""
    global _OPTIMIZER_SHIMMED
    if _OPTIMIZER_SHIMMED:
        return not cuda_available()
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer, grad_scaler, optimizer

    _step_kept_on_load(distrib_optimizer)
    _hybrid_optimizer_loads_fp32_params(distrib_optimizer)
    _te_version_without_te()
    _OPTIMIZER_SHIMMED = True
    if cuda_available():
        return False

    for module in (optimizer, clip_grads, distrib_optimizer, mcore_utils, grad_scaler):
        module.torch = _CudaMeansCpu(torch)
    grad_scaler.DynamicGradScaler.load_state_dict = _scaler_load_on_its_device
    _hybrid_optimizer_on_the_host()
    cls = distrib_optimizer.DistributedOptimizer
    cls.__init__ = _with_cuda_type_names(cls.__init__)
    clip = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = optimizer.clip_grad_by_total_norm_fp32 = clip
    return True


def _te_version_without_te() -> None:
    """Any device without transformer-engine: megatron-core 0.16's OptimizerConfig with
    --use-precision-aware-optimizer asks `is_te_min_version("2.1.0")` (to turn store_param_remainders
    off below TE 2.1), which compares TE's version, None without TE: TypeError "'>=' not supported
    between instances of 'NoneType' and 'Version'" (measured). No TE is below every version."""
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import optimizer_config

    if mcore_utils.get_te_version() is not None:
        return
    optimizer_config.is_te_min_version = lambda version, check_equality=True: False


class _HostStream:
    """A CUDA stream / event where there is none: the host runs every copy in order, so waiting on
    one, recording one, synchronizing one is done already."""

    def wait_stream(self, other) -> None:
        pass

    def record_event(self) -> _HostStream:
        return self

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _HostCuda:
    """`torch.cuda` as megatron's hybrid_optimizer.py sees it without CUDA: its streams (`current_stream`,
    `Stream`, `stream(...)`) are the host's order of execution."""

    @staticmethod
    def current_stream(device=None) -> _HostStream:
        return _HostStream()

    Stream = _HostStream

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()


class _HostTorch(_CudaMeansCpu):
    """hybrid_optimizer.py's `torch`: `torch.cuda` is `_HostCuda`, and its host buffers are not
    pinned (pinning needs an accelerator: RuntimeError 'no pinned memory allocator')."""

    cuda = _HostCuda

    def __getattr__(self, name):
        attr = super().__getattr__(name)
        if name != "empty":
            return attr

        def unpinned(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return attr(*args, **kwargs)

        return unpinned


def _hybrid_optimizer_on_the_host() -> None:
    """--optimizer-cpu-offload without CUDA: megatron-core's HybridDeviceOptimizer offloads the
    parameters that are `is_cuda` (its `_get_sub_optimizer_param_groups`: a pinned host copy of
    each, up to --optimizer-offload-fraction of them) and steps the copies with torch's AdamW, moving
    gradients and parameters over CUDA streams (`torch.cuda.current_stream()`: AssertionError 'Torch
    not compiled with CUDA enabled', measured). Here the trainer's device is the host itself: while
    it sorts the parameters, its own parameters count as the device's (`is_cuda`), every copy it makes
    of them as the host's, and pinning is the plain copy, so each parameter gets its own host copy, stepped with
    its state by the host optimizer, as on a GPU (without it the host optimizer gets the parameters
    themselves, and its step looks each up as a host copy: KeyError in `_set_sub_optimizer_grads`,
    measured); the streams are `_HostStream`s. Under --use-precision-aware-optimizer it makes an fp32
    copy (`.float()`) of each bf16 host copy, a host copy too (marking the copies instead sent these
    to a device optimizer no gradient reaches: an empty state and no step, measured)."""
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    hybrid_optimizer.torch = _HostTorch(torch)
    cls = hybrid_optimizer.HybridDeviceOptimizer
    real = cls._get_sub_optimizer_param_groups

    def pinned(t, *args, **kwargs):  # `.cpu().pin_memory()` of a clone: the host copy itself
        return t

    def sort_params(self, offload_fraction):
        device = {id(p) for g in self.param_groups for p in g["params"]}
        on_device = property(lambda t: id(t) in device)
        with _tensor_attrs(is_cuda=on_device, pin_memory=pinned):
            return real(self, offload_fraction)

    cls._get_sub_optimizer_param_groups = sort_params


def _hybrid_optimizer_loads_fp32_params(distrib_optimizer) -> None:
    """Any device: --optimizer-cpu-offload without --use-precision-aware-optimizer hands megatron-core
    0.16's HybridDeviceOptimizer the distributed optimizer's fp32 main shards, and loading a checkpoint
    failed twice (measured): its post-load hook looks up an fp32 copy of every parameter, which it
    makes of reduced-precision ones only (KeyError in `_update_fp32_params_by_new_state`: an fp32
    parameter is its own copy, skipped here), and the distributed optimizer copies each saved tensor
    into every key of the parameter's state, which holds the host copy as "master_param", not saved
    (KeyError 'master_param': left out of the copy; megatron_distopt.ActorOptimizer.load_sharded then
    refreshes the host copies from the loaded shards)."""
    hdo = distrib_optimizer.HybridDeviceOptimizer

    def update_fp32_params(self):
        if not self.param_update_in_fp32:
            return
        for param, v in self.state.items():
            fp32_param = self.param_to_fp32_param.get(param)
            if fp32_param is not None:
                fp32_param.data.copy_(v["master_param"])

    hdo._update_fp32_params_by_new_state = update_fp32_params
    cls = distrib_optimizer.DistributedOptimizer
    real = cls._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if not isinstance(self.optimizer, hdo) or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return real(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        host = state.pop("master_param", None) if "master_param" not in tensors else None
        try:
            return real(self, model_param, tensors)
        finally:
            if host is not None:
                state["master_param"] = host

    cls._set_main_param_and_optimizer_states = set_states


@contextlib.contextmanager
def _tensor_attrs(**attrs):
    """torch.Tensor's `attrs` replaced for the duration (inherited ones removed again after)."""
    own = {k: torch.Tensor.__dict__[k] for k in attrs if k in torch.Tensor.__dict__}
    for k, v in attrs.items():
        setattr(torch.Tensor, k, v)
    try:
        yield
    finally:
        for k in attrs:
            if k in own:
                setattr(torch.Tensor, k, own[k])
            else:
                delattr(torch.Tensor, k)


def _scaler_load_on_its_device(self, state_dict) -> None:
    self._scale = state_dict["scale"].to(self._scale.device)
    self._growth_tracker = state_dict["growth_tracker"]
    self._hysteresis_tracker = state_dict["hysteresis_tracker"]


def _step_kept_on_load(distrib_optimizer) -> None:
    """Without apex / TE (any device) megatron-core 0.16's DistributedOptimizer steps torch's Adam,
    whose per-parameter state has a "step"; loading its 'fully_reshardable' checkpoint sets that step
    from the saved param groups, then copies every state key from the saved per-parameter tensors,
    which have none: KeyError 'step' (measured). Copy the keys that were saved; the step stays as set,
    one tensor per parameter (the load sets one shared tensor, which torch's Adam, incrementing it in
    place per parameter, would advance N times a step: a resumed step off by ~lr, measured). With
    --use-precision-aware-optimizer (offloaded) the load replaces the host optimizer's state tensors
    and leaves the shared step: each parameter's step is made its own after (measured without: the
    resumed step off by 6e-4, one step count advanced by every parameter's host optimizer)."""
    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    cls = distrib_optimizer.DistributedOptimizer
    real = cls._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:  # the state's own keys, replaced
            try:
                return real(self, model_param, tensors)
            finally:
                if "step" in state and "step" not in tensors:
                    state["step"] = state["step"].clone()
        if "step" in tensors or "step" not in state:
            return real(self, model_param, tensors)
        step = state.pop("step")
        try:
            return real(self, model_param, tensors)
        finally:  # its own tensor: torch's Adam increments it in place, and the load gave all one
            state["step"] = step.clone()

    cls._set_main_param_and_optimizer_states = set_states


def _with_cuda_type_names(fn):
    import functools

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def _cuda_type_names():
    """`Tensor.type()` (no arguments) of a CPU tensor answers 'torch.cuda.<X>Tensor' (see
    apply_optimizer_cpu_shims); any other call of it is torch's."""
    real = torch.Tensor.type

    def type_(self, *args, **kwargs):
        name = real(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or not name.startswith("torch.") or ".cuda." in name:
            return name
        return "torch.cuda." + name[len("torch.") :]

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = real
