"""ColocatedWorker: one engine doing prefill and decode (a plain continuous-batching server).

For small deployments, for conditional disaggregation, and as the baseline P/D is measured against.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from engine.messages import TokenOutput
from engine.sampling_params import SamplingParams
from engine.worker_base import WorkerBase


class ColocatedWorker(WorkerBase):
    role = "colocated"

    def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, step_timeout_s: float = 60.0
    ) -> Iterator[TokenOutput]:
        yield from self._run_whole(request_id, prompt_ids, params, step_timeout_s)
