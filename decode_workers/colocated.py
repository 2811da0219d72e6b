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
        self._check_open()
        stream = self.loop.open(request_id, lambda: self.engine.add_request(request_id, list(prompt_ids), params))
        try:
            for out in stream.iterate(step_timeout_s):
                yield TokenOutput.of(out)
        finally:
            self.loop.abort(request_id)
