"""The README's quickstart with the synchronous client (hookwire.connect_sync): the same
calls, blocking, for scripts and notebooks. Start a server first (`make serve`), then
`python docs/examples/quickstart_sync.py`."""

import torch

import hookwire

with hookwire.connect_sync("127.0.0.1:50051") as client:
    model = client.model("tiny-transformer")
    print([m.path for m in model.info().modules])

    ids = torch.randint(0, 64, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.bool)
    out = model(ids, attention_mask=mask)  # {"last_hidden_state", "logits"}

    # A session hook: fires for this client's calls, removed on exit.
    with model.hook("encoder.layers.*", posthook=hookwire.capture("output"), train_update=False) as hook:
        model(ids, attention_mask=mask)
        for event in hook.events():
            print(event.module, event.call_index, event.output.shape)
            if event.module == "encoder.layers.1":
                break

    # Request-scoped hooks and a backward pass: events come back in the result.
    result = model.infer(
        ids, attention_mask=mask,
        hooks=[hookwire.HookSpec("encoder.layers.*", backward_hook=hookwire.capture("grad_input", "grad_output"))],
        backward=hookwire.Backward("logits"),
    )
    print([(e.module, e.phase) for e in result.events])
