"""--data-source-path: the user's data source class, as Miles loads it (`cls(args)`, Miles'
`DataSource` contract: `get_samples(num_samples) -> list[list[Sample]]` of prompt groups,
`add_samples(groups)`, `save(rollout_id)`, `load(rollout_id=None)`, optionally `.dataset`), behind
the interface the rollout manager, the async worker and the checkpoints use (RolloutDataSource's).

A group hands out one prompt: the group's first Sample gives its prompt, label and metadata (every
Sample of the group must share the prompt), and the run generates --n-samples-per-prompt responses
to it. Prompts taken and not trained at a checkpoint go to `add_samples` after a resume's `load`, as
groups of fresh Samples, so none is lost.
"""

from __future__ import annotations

import dataclasses
import inspect
from argparse import Namespace
from typing import Any

from miles_platform.data.dataset import PromptRecord
from miles_platform.data.sample import Sample
from miles_platform.errors import ConfigError

FLAG = "--data-source-path"


class CustomDataSource:
    def __init__(self, cfg: Any):
        from miles_platform.plugins import load_object

        cls, path = load_object(cfg.data_source_path, FLAG), cfg.data_source_path
        if not inspect.isclass(cls) or not callable(getattr(cls, "get_samples", None)):
            raise ConfigError(
                f"{FLAG} {path!r}: must be a class with get_samples(num_samples) -> list[list[Sample]] "
                "(Miles' DataSource: add_samples, save(rollout_id), load(rollout_id=None) too)"
            )
        self.path, self.n = path, cfg.n_samples_per_prompt
        self.args = Namespace(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
        self.inner = cls(self.args)
        self.records: list[PromptRecord] = []  # the run's data hash: this build loads no dataset itself
        self.saving_rollout_id: int | None = None  # set by the run before each checkpoint's state_dict

    def __len__(self) -> int:
        """The prompts of the source's `.dataset` (Miles reads it for --num-rollout); 0 without one."""
        dataset = getattr(self.inner, "dataset", None)
        return len(dataset) if dataset is not None else 0

    def get_samples(self, num_prompts: int) -> list[PromptRecord]:
        groups = self.inner.get_samples(num_prompts)
        if not isinstance(groups, list) or len(groups) != num_prompts:
            raise ConfigError(
                f"{FLAG} {self.path!r}: get_samples({num_prompts}) returned "
                f"{len(groups) if isinstance(groups, list) else type(groups).__name__} groups, not {num_prompts}"
            )
        return [self._record(g, k) for k, g in enumerate(groups)]

    def _record(self, group: Any, k: int) -> PromptRecord:
        if not (isinstance(group, list) and group and all(isinstance(s, Sample) for s in group)):
            raise ConfigError(f"{FLAG} {self.path!r}: group {k} of get_samples is not a list of Samples")
        s = group[0]
        if any(x.prompt != s.prompt for x in group):
            raise ConfigError(f"{FLAG} {self.path!r}: group {k} mixes prompts; a group answers one prompt")
        meta = dict(s.metadata or {})
        pid = meta.pop("prompt_id", None)
        return PromptRecord(
            id=str(pid if pid is not None else s.index), prompt=s.prompt, label=s.label, metadata=meta
        )

    def put_back(self, records: list[PromptRecord]) -> None:
        """Prompts to serve again: to the source's add_samples, as groups of fresh Samples."""
        if not records:
            return
        if not callable(getattr(self.inner, "add_samples", None)):
            raise ConfigError(
                f"{FLAG} {self.path!r}: has no add_samples(groups) to take back unfinished prompts"
            )
        self.inner.add_samples(
            [
                [
                    Sample(prompt=r.prompt, label=r.label, metadata={**r.metadata, "prompt_id": r.id})
                    for _ in range(self.n)
                ]
                for r in records
            ]
        )

    def state_dict(self, unfinished: list[PromptRecord] = ()) -> dict[str, Any]:
        """At a checkpoint: the source's own save(rollout_id); the checkpoint keeps the rollout id and the
        prompts taken and not trained."""
        if callable(getattr(self.inner, "save", None)):
            self.inner.save(self.saving_rollout_id)
        return {
            "custom_rollout_id": self.saving_rollout_id,
            "pending": [dataclasses.asdict(r) for r in unfinished],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if callable(getattr(self.inner, "load", None)):
            self.inner.load(state.get("custom_rollout_id"))
        self.put_back([PromptRecord(**r) for r in state.get("pending", [])])
