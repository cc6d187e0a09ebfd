"""The runner of pooling models (embeddings, scores): a prompt's forward, pooled.

A pooling request has no decode loop: its prompt runs in one step (the scheduler never
cuts it: the encoder's attention is bidirectional), and the rows of that step become one
vector, as sentence-transformers pools them: the mean of the rows, the first ([CLS]) or
the last token's (decoder-based embedders), normalized where the folder says so. A
cross-encoder's classifier maps its first row to logits, and a single-label score is their
sigmoid (`CrossEncoder.predict`). The result goes back as float32 bytes on the request
(`Request.pooled`); the output processor sends it as the request's one output.
"""

from __future__ import annotations

import numpy as np
import torch

from services.gpu_worker.attention import AttnRows
from services.gpu_worker.runners.base import ModelRunner
from services.gpu_worker.step_types import StepPlan
from shared.specs.base import PoolingRunnerSpec


class PoolingRunner(ModelRunner):
    SPEC = PoolingRunnerSpec

    def _layer_caches(self) -> list[torch.Tensor]:
        return list(self.caches[self.spec.label(self.spec.label_name).pool])

    def attention_shape(self) -> tuple[int, float | None]:
        return self.spec.heads, None

    def make_request(self, tensors: dict[str, np.ndarray]) -> tuple[list[int], dict]:
        prompt, _ = super().make_request(tensors)
        types = tensors.get("token_type_ids")
        if types is not None and types.size != len(prompt):
            raise ValueError(f"token_type_ids has {types.size} entries for {len(prompt)} input ids")
        return prompt, {} if types is None else {"token_type_ids": [int(t) for t in types.reshape(-1)]}

    def execute(self, plan: StepPlan) -> list[list[int]]:
        """One forward over every entry's whole prompt; each entry's pooled result on its
        request. No token is sampled."""
        label = self.spec.label_name
        rows: list[AttnRows] = []
        ids: list[int] = []
        types: list[int] = []
        positions: list[int] = []
        for e in plan.entries:
            r, n = e.request, e.rows
            if r.num_computed != 0 or n != len(r.prompt):
                raise RuntimeError(f"pooling request {r.request_id} was scheduled in part ({n} of {len(r.prompt)} "
                                   f"rows from {r.num_computed}): its prompt runs whole")
            rows.append(AttnRows(e.pages[label], 0, 0, n, False))
            ids.extend(r.prompt)
            types.extend(r.inputs.get("token_type_ids") or [0] * n)
            positions.extend(range(n))
        meta = self.builder.build(rows, self.page_sizes[label], None, causal=not self.spec.bidirectional)
        t = len(ids)
        flat = torch.from_numpy(np.array(ids + positions + types, dtype=np.int64)).to(self.device)
        with torch.inference_mode():
            hidden = self.model(flat[:t], flat[t : 2 * t], flat[2 * t :], self.layer_caches,
                                [meta] * len(self.layer_caches))
            pooled = self._pool(hidden, [e.rows for e in plan.entries]).float().cpu()
        for e, vec in zip(plan.entries, pooled):
            e.request.pooled = vec.numpy().astype("<f4").tobytes()
        return [[] for _ in plan.entries]

    def _pool(self, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """[B, width]: each request's rows pooled (then scored, or normalized)."""
        starts = np.cumsum([0, *lengths[:-1]]).tolist()
        mode = self.spec.pooling
        if mode == "mean":
            out = torch.stack([hidden[s : s + n].mean(0) for s, n in zip(starts, lengths)])
        else:
            at = starts if mode == "cls" else [s + n - 1 for s, n in zip(starts, lengths)]
            out = hidden[torch.tensor(at, device=hidden.device)]
        if self.spec.task == "score":
            logits = self.model.score(out).float()
            return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, -1)
        if self.spec.normalize:
            out = torch.nn.functional.normalize(out.float(), p=2, dim=-1)
        return out
