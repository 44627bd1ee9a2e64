"""RolloutDataSource: hands out prompts rollout by rollout, epoch after epoch, resumable exactly.

With --rollout-shuffle each epoch is a fresh permutation seeded by `rollout_seed + epoch`, so
the order depends only on (seed, epoch) and a resumed run replays nothing and skips nothing.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from miles_platform.data.dataset import PromptRecord, load_prompt_dataset


class RolloutDataSource:
    def __init__(self, records: list[PromptRecord], rollout_shuffle: bool = False, rollout_seed: int = 42):
        if not records:
            raise ValueError("RolloutDataSource needs at least one prompt record")
        self.records = list(records)
        self.rollout_shuffle = rollout_shuffle
        self.rollout_seed = rollout_seed
        self.epoch = 0
        self.offset = 0  # position within the current epoch's order
        self._order = self._epoch_order(0)
        # prompts handed out but never trained (an unfinished or buffered group at a checkpoint,
        # a group retried by --async-unused-samples-handler retry): served again first
        self.pending: list[PromptRecord] = []

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any | None = None) -> RolloutDataSource:
        """Build from a RunConfig: --prompt-data and its keys, --rollout-shuffle, --rollout-seed."""
        records = load_prompt_dataset(
            cfg.prompt_data,
            input_key=cfg.input_key,
            label_key=cfg.label_key,
            metadata_key=cfg.metadata_key,
            apply_chat_template=cfg.apply_chat_template,
            chat_template_kwargs=cfg.chat_template_kwargs(),
            tokenizer=tokenizer,
            multimodal_keys=cfg.image_keys() if hasattr(cfg, "image_keys") else None,
            # agentic: Sample.prompt stays messages; SFT: the conversation to train on
            keep_messages=bool(
                getattr(cfg, "use_session_server", None) or getattr(cfg, "uses_sft_rollout", False)
            ),
        )
        return cls(records, rollout_shuffle=cfg.rollout_shuffle, rollout_seed=cfg.rollout_seed)

    def __len__(self) -> int:
        return len(self.records)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.rollout_shuffle:
            random.Random(self.rollout_seed + epoch).shuffle(order)
        return order

    def get_samples(self, num_prompts: int) -> list[PromptRecord]:
        """The next `num_prompts` prompts, crossing into the next epoch when this one runs out."""
        out: list[PromptRecord] = self.pending[:num_prompts]
        del self.pending[:num_prompts]
        while len(out) < num_prompts:
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._epoch_order(self.epoch)
            take = min(num_prompts - len(out), len(self._order) - self.offset)
            out += [self.records[i] for i in self._order[self.offset : self.offset + take]]
            self.offset += take
        return out

    def put_back(self, records: list[PromptRecord]) -> None:
        """Serve these prompts again, before the epoch order continues."""
        self.pending.extend(records)

    def state_dict(self, unfinished: list[PromptRecord] = ()) -> dict[str, Any]:
        """JSON-serializable position, saved with each checkpoint. `unfinished`: prompts taken but
        not trained yet (in flight or buffered); a resume serves them first, so no prompt is lost."""
        state: dict[str, Any] = {"epoch": self.epoch, "offset": self.offset}
        pending = [*self.pending, *unfinished]
        if pending:
            state["pending"] = [dataclasses.asdict(r) for r in pending]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if not 0 <= offset <= len(self.records):
            raise ValueError(
                f"data-source offset {offset} outside the dataset of {len(self.records)} prompts"
            )
        self.epoch, self.offset = epoch, offset
        self._order = self._epoch_order(epoch)
        self.pending = [PromptRecord(**r) for r in state.get("pending", [])]
