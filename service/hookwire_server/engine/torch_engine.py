"""The torch engine: today's torch/transformers code behind the engine seam (seam.py).

Any ``nn.Module`` runs here, eagerly, on the model's worker thread: Infer calls
(infer_pass), Generate calls of transformers causal LMs (decoding: started, stepped
and finished in the plans the scheduler puts them in) and harvest batches
(harvest_pass), each through the one pass runner. It refuses no feature: backward hooks,
gradients, MODE_TRAIN and attention probabilities all work.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hookwire.v1 import model_service_pb2

from ..errors import InvalidArgument
from ..models.memory_estimate import Estimator
from ..models.model_registry import ModelHost
from . import batching, decoding, harvest_pass, infer_pass
from .seam import GENERATE, HARVEST, INFER, GenerateCall, Plan


class TorchEngine:
    """Runs one ModelHost's work items (see the module docstring)."""

    name = "torch"
    refused: Mapping[str, str] = {}

    def __init__(self, host: ModelHost) -> None:
        #: The model it runs (a plain attribute: read on every call's way in).
        self.host = host
        self._host = host
        #: Estimates its calls' peak memory before they run (calls/admission.claim_memory).
        self.estimator = Estimator(host.module, bytes_per_input_element=host.memory_bytes_per_input_element)

    def infer_shape(self, request: model_service_pb2.InferRequest) -> batching.Shape | None:
        """How an Infer request may share a pass: calls whose tensors stack along the
        model's batch dimension (token inputs padded to a common length where the model
        has a pad token); see batching.request_key."""
        return batching.request_key(request, self._host.batching)

    def generate_key(self, call: GenerateCall) -> Any:
        """New Generate calls that arrive together share their prompt pass (decoding.prompt_key)."""
        return decoding.prompt_key(self._host)

    def execute(self, plan: Plan) -> list[Any]:
        """Runs ``plan`` on the model's worker thread (see seam.Engine.execute). The
        executors are looked up when a plan runs, not bound once, so that tests can wrap
        them."""
        if plan.kind == INFER:
            return infer_pass.run_infer_batch(self._host, plan.items)
        if plan.kind == GENERATE:
            return decoding.run_calls(self._host, plan.items)
        if plan.kind == HARVEST:
            return harvest_pass.run_harvest_batch(self._host, plan.items)
        raise InvalidArgument(f"the torch engine runs no work of kind {plan.kind!r}")
