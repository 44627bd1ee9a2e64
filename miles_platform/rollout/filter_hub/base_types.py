"""Filter results and group iteration shared by every filter."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from miles_platform.data.sample import Sample


@dataclass
class DynamicFilterOutput:
    keep: bool
    reason: str | None = None  # why a group was dropped: the metric `rollout/dynamic_filter/drop_<reason>`


FilterOutput = DynamicFilterOutput


def iter_samples(group: list[Sample | list[Sample]]) -> Iterator[Sample]:
    for item in group:
        if isinstance(item, list):
            yield from item
        else:
            yield item
