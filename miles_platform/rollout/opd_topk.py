"""The Rethinking-OPD top-k reverse KL (arXiv 2604.13016, Miles' `--opd-log-prob-top-k`): pure math.

At each response position a token set S is chosen from the student's top-k ids (from its rollout)
and the teacher's top-k ids (from its scoring request), by `--opd-top-k-strategy`:

    only-student   student top-k            (teacher log-probs queried for those ids)
    only-teacher   teacher top-k            (student log-probs queried for those ids)
    intersection   ids in both
    union          ids in either, duplicates removed (student order first)
    xor            ids in exactly one

and the estimate is  sum_{x in S} w_x (log p_s(x) - log p_t(x)),  with w the softmax over S of the
student log-probs (`student_p`), of the teacher's (`teacher_p`) or uniform (`none`); `xor` keeps
unnormalized weights (exp of the log-prob, or 1 with `none`), as Miles does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

STRATEGIES = ("only-student", "only-teacher", "intersection", "union", "xor")
WEIGHT_MODES = ("student_p", "teacher_p", "none")
NEEDS_STUDENT_TOP = {"only-student", "intersection", "union", "xor"}
NEEDS_TEACHER_TOP = {"only-teacher", "intersection", "union", "xor"}
TEACHER_ON_STUDENT_IDS = {"only-student", "union", "xor"}  # teacher scores student-top ids
STUDENT_ON_TEACHER_IDS = {"only-teacher", "union", "xor"}  # student scores teacher-top ids

LogprobMap = dict[int, float]


def entries_to_map(entries: Iterable[Sequence] | None) -> LogprobMap:
    """SGLang's `[[logprob, token_id, text], ...]` of one position -> {token_id: logprob} (in order)."""
    return {int(e[1]): float(e[0]) for e in entries or () if e is not None}


def selected_token_ids(strategy: str, student_ids: Sequence[int], teacher_ids: Sequence[int]) -> list[int]:
    s, t = set(student_ids), set(teacher_ids)
    if strategy == "only-student":
        return list(student_ids)
    if strategy == "only-teacher":
        return list(teacher_ids)
    if strategy == "intersection":
        return [x for x in student_ids if x in t]
    if strategy == "union":
        return list(dict.fromkeys([*student_ids, *teacher_ids]))
    if strategy == "xor":
        return [x for x in [*student_ids, *teacher_ids] if (x in s) != (x in t)]
    raise ValueError(f"--opd-top-k-strategy {strategy!r}: must be one of {', '.join(STRATEGIES)}")


def _weights(logps: list[float], normalize: bool) -> list[float]:
    if not logps:
        return []
    if not normalize:
        return [math.exp(x) for x in logps]
    top = max(logps)
    ex = [math.exp(x - top) for x in logps]
    total = sum(ex)
    return [v / total for v in ex]


def _lookup(token: int, primary: LogprobMap, fallback: LogprobMap, who: str, pos: int) -> float:
    if token in primary:
        return primary[token]
    if token in fallback:
        return fallback[token]
    raise ValueError(f"top-k OPD: no {who} log-prob for token {token} at response position {pos}")


def position_reverse_kl(
    strategy: str, weight_mode: str, student_top: LogprobMap, teacher_top: LogprobMap,
    teacher_on_student: LogprobMap, student_on_teacher: LogprobMap, pos: int = 0,
) -> float:  # fmt: skip
    """The weighted reverse-KL estimate at one response position."""
    ids = selected_token_ids(strategy, list(student_top), list(teacher_top))
    s_lp = [_lookup(x, student_top, student_on_teacher, "student", pos) for x in ids]
    t_lp = [_lookup(x, teacher_top, teacher_on_student, "teacher", pos) for x in ids]
    if weight_mode == "student_p":
        basis = s_lp
    elif weight_mode == "teacher_p":
        basis = t_lp
    elif weight_mode == "none":
        basis = [0.0] * len(ids)
    else:
        raise ValueError(
            f"--opd-reward-weight-mode {weight_mode!r}: must be one of {', '.join(WEIGHT_MODES)}"
        )
    w = _weights(basis, normalize=strategy != "xor")
    return sum(wi * (s - t) for wi, s, t in zip(w, s_lp, t_lp, strict=True))


def topk_reverse_kl(
    strategy: str, weight_mode: str, student_top: list[LogprobMap], teacher_top: list[LogprobMap],
    teacher_on_student: list[LogprobMap], student_on_teacher: list[LogprobMap],
) -> list[float]:  # fmt: skip
    """One estimate per response position; every list has one map per position ({} when unused)."""
    n = len(student_top)
    for name, maps in (("teacher top", teacher_top), ("teacher-on-student", teacher_on_student),
                       ("student-on-teacher", student_on_teacher)):  # fmt: skip
        if len(maps) != n:
            raise ValueError(f"top-k OPD: {len(maps)} {name} positions for {n} response tokens")
    return [
        position_reverse_kl(strategy, weight_mode, *maps, pos=i)
        for i, maps in enumerate(zip(student_top, teacher_top, teacher_on_student, student_on_teacher))
    ]
