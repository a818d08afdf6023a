"""The hook runtime: what fires a hook on a call's rows, where the model's tensors are.

In the front's own process (the torch engine, vLLM in-process) hooks fire in their
records (hooks.hook_record), on the model's modules. In vLLM's worker processes the
model is elsewhere: the front plans each step's firings (which hook on which call's
rows, call indices, whether a capture is wanted), ships the plan and the hooks' specs
as bytes (``plan``), and the worker's ``step.StepRunner`` runs them on its own tensors,
on its device: rules edit the value before the module goes on, captures are reduced
there and come back once per step and rank, in one message. Its interface:

- ``plan.pack`` / ``plan.unpack``: a step's plan as bytes (the format is documented there);
- ``step.StepRunner(device, captures=...)``: ``configure(header, blobs, input_ids)`` at
  the step's start, ``fire(path, phase, parts)`` at each tapped module phase (the parts
  as the rules left them, or None), ``results()`` at its end (what to send the front);
- ``hooks.captured.prepare`` (below it): a capture's values selected, cast or summarized,
  on either side;
- ``views``: how hooks see a vLLM module's output, by name (both sides).

Its modules import neither grpc, the servicers nor the front's model registry themselves
(tests/unit/test_architecture.py; what they import below, hooks/ and the SDK's wire
package, loads the SDK package, which imports grpc, as any server module does).
"""
