"""The megatron backend's train step under model parallelism: megatron-core's pipeline schedule over
the micro-batches, results from the last pipeline stage, and the global gradient norm.

`run_micro_batches` hands every micro-batch to `get_forward_backward_func()` (no pipelining, 1F1B,
or interleaved 1F1B with virtual stages): on each stage the forward step runs the model chunk on
the micro-batch (the first stage embeds the tokens, the others take the previous stage's
activations), and on the last stage the loss function scores the vocab-parallel logits
(`megatron_logprobs`) and asks the actor for the micro-batch's weighted loss. The schedule divides
a 2-tuple loss by the number of micro-batches and multiplies it by the context-parallel size;
the actor's loss is already weighted for the global batch, so the loss function hands back
`loss * n`. Under CP every rank of the group computes the whole loss from gathered scores but
back-propagates through its own positions only (megatron_cp); DDP averages gradients over data x
context parallel ranks, and the CP factor turns that average over the CP group into the sum of the
ranks' parts. Gradients accumulate in megatron DDP's main_grad buffers; `finish_grad_sync`
finalizes them after the schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from miles_platform.training.backend import ScoreRequest, Scores


def causal_mask(width: int, device) -> torch.Tensor:
    """[1, 1, T, T] True above the diagonal (masked); megatron's default one is built on "cuda"."""
    return torch.triu(torch.ones(width, width, dtype=torch.bool, device=device), diagonal=1)[None, None]


def pad_to(ids: torch.Tensor, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] token ids right-padded to [rows, width] (token 0) and positions 0..width-1. The mask
    is causal, so padding after a row's tokens, or extra rows, changes none of the real outputs;
    every score is read from the first B rows and T positions."""
    ids = torch.nn.functional.pad(ids, (0, width - ids.shape[1], 0, rows - ids.shape[0]))
    pos = torch.arange(width, device=ids.device).unsqueeze(0).expand(rows, -1).contiguous()
    return ids, pos


def forward_chunk(model, req: ScoreRequest, seq_multiple: int = 1, shape: tuple[int, int] | None = None):
    """One model chunk's forward of a request (inside its context): logits [B', T', V / TP] on the
    last stage, activations for the next stage elsewhere. The width is padded to a multiple of
    `seq_multiple` (sequence parallel splits it over TP) or to `shape` (pipeline stages exchange
    activations of one shape)."""
    rows, width = shape or req.input_ids.shape
    ids, pos = req.input_ids, req.position_ids
    width += -width % seq_multiple
    if (rows, width) != tuple(ids.shape):
        ids, pos = pad_to(ids, rows, width)
    from megatron.core import parallel_state as ps

    if ps.get_context_parallel_world_size() > 1:  # this rank's zigzag chunks; the attention masks by position
        from miles_platform.training.megatron_cp import local_tokens

        ids, pos = local_tokens(ids, pos)
        with req.context():
            return model(ids, pos, None)
    with req.context():
        return model(ids, pos, causal_mask(width, ids.device))


def run_micro_batches(
    models: list[torch.nn.Module],
    reqs: list[ScoreRequest],
    scores_of: Callable[[torch.Tensor, ScoreRequest], Scores],
    consume: Callable[[int, Scores], torch.Tensor | None],
    forward_only: bool,
    seq_multiple: int = 1,
) -> None:
    """megatron's schedule over `reqs` (see the module docstring); `models`: this rank's chunks."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    n = len(reqs)
    rows = max(r.input_ids.shape[0] for r in reqs)
    width = max(r.input_ids.shape[1] for r in reqs)
    width += -width % seq_multiple
    # pipeline stages exchanging fixed [width, rows, hidden] activations: one shape for all
    fixed = ps.get_pipeline_model_parallel_world_size() > 1 and not models[0].config.variable_seq_lengths
    shape = (rows, width) if fixed else None

    def forward_step(data_iterator, model):
        k = next(data_iterator)
        req = reqs[k]
        output = forward_chunk(model, req, seq_multiple, shape)

        def loss_func(out: torch.Tensor):
            loss = consume(k, scores_of(out, req))
            if loss is None:  # forward only: the schedule still divides a tensor
                loss = torch.zeros((), device=out.device)
            return loss * n, {}

        return output, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(range(n)) for _ in models] if len(models) > 1 else iter(range(n)),
        model=models if len(models) > 1 else models[0],
        num_microbatches=n,
        seq_length=width,
        micro_batch_size=rows,
        forward_only=forward_only,
    )


def from_last_stage(obj: Any) -> Any:
    """`obj` of the last pipeline stage, broadcast to every stage of this rank's pipeline."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    box = [obj if ps.is_pipeline_last_stage() else None]
    dist.broadcast_object_list(
        box, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
    )
    return box[0]


def global_grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """L2 norm of the whole model's gradient (fp32) over TP, PP and EP: each tensor-parallel shard
    counts on its rank, a replicated parameter on TP rank 0 only, a pipeline-shared one (the tied
    output layer of the last stage) not at all, as megatron's `get_grad_norm_fp32`; expert
    parameters (`allreduce = False`) are summed over the expert model-parallel group instead."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    dense, expert = torch.zeros((), dtype=torch.float32), torch.zeros((), dtype=torch.float32)
    for p in params:
        if p.grad is None or getattr(p, "shared", False) or not param_is_not_tensor_parallel_duplicate(p):
            continue
        sq = p.grad.detach().float().pow(2).sum().cpu()
        if getattr(p, "allreduce", True):
            dense = dense + sq
        else:
            expert = expert + sq
    for total, group in ((dense, ps.get_model_parallel_group()),
                         (expert, ps.get_expert_tensor_model_pipeline_parallel_group())):  # fmt: skip
        if group.size() > 1:
            dist.all_reduce(total, group=group)
    return (dense + expert).sqrt()


def clip_by_total_norm(params: list[torch.nn.Parameter], max_norm: float, total: torch.Tensor) -> None:
    """Scale every gradient by max_norm / (total + 1e-6) when that is below 1 (torch's formula)."""
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(coef)
