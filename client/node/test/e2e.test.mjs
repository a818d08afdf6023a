// End-to-end: a stock gRPC client in another language does what the Python SDK does.
// Needs a running server: HOOKWIRE_TARGET=127.0.0.1:PORT node --test test/
import { test } from "node:test";
import assert from "node:assert/strict";
import { call, connect, decodeFloat32, float32Tensor, openSession } from "../hookwire.mjs";

const target = process.env.HOOKWIRE_TARGET ?? "127.0.0.1:50051";

test("lists models, hooks a module, runs Infer, and decodes the captured tensor", async () => {
  const { models, hooks, close } = connect(target);
  try {
    const listing = await call(models, "ListModels", {});
    assert.ok(listing.models.some((m) => m.name === "mlp"), "the demo mlp is hosted");

    const info = await call(models, "GetModel", { name: "mlp" });
    assert.deepEqual(info.modules.map((m) => m.path).slice(0, 2), ["", "fc1"]);

    const session = await openSession(hooks);
    const hook = await call(hooks, "RegisterHook", {
      session_id: session.sessionId,
      spec: { model: "mlp", module: "", posthook: { capture: ["PART_OUTPUT"] } },
    });
    assert.deepEqual(hook.modules, [""]);

    const x = Array.from({ length: 16 }, (_, i) => Math.sin(i));
    const reply = await call(models, "Infer", {
      model: "mlp", session_id: session.sessionId, args: [{ tensor: float32Tensor(x, [2, 8]) }],
    });
    const output = decodeFloat32(reply.output.tensor);
    assert.deepEqual(output.shape, [2, 4]);

    const { value: event } = await session.events.next();
    assert.equal(event.hook_id, hook.hook_id);
    assert.equal(event.request_id, reply.request_id);
    assert.equal(event.phase, "PHASE_FORWARD");
    assert.equal(Number(event.seq), 1);
    const captured = decodeFloat32(event.output.tensor);
    assert.deepEqual(captured.shape, output.shape);
    assert.deepEqual(Array.from(captured.values), Array.from(output.values), "the hook saw exactly the output");

    const removed = await call(hooks, "DeregisterHook", { hook_id: hook.hook_id });
    assert.equal(removed.removed, true);
    session.stream.cancel();
  } finally {
    close();
  }
});

test("large captured tensors arrive in chunks that fit 4 MiB messages", async () => {
  const { models, hooks, close } = connect(target);
  try {
    const session = await openSession(hooks);
    await call(hooks, "RegisterHook", {
      session_id: session.sessionId,
      spec: { model: "scale", module: "", posthook: { capture: ["PART_OUTPUT"] } },
    });
    const n = 1_500_000; // 6 MB of float32: chunked both ways
    const x = new Float32Array(n).map((_, i) => i % 1000);
    await new Promise((resolve, reject) => {
      const bidi = models.InferStream();
      bidi.on("data", () => {});
      bidi.on("error", reject);
      bidi.on("end", resolve);
      const bytes = Buffer.from(x.buffer);
      bidi.write({ request: { model: "scale", session_id: session.sessionId,
        args: [{ tensor: { dtype: "DTYPE_FLOAT32", shape: [n], chunk_id: 1 } }] } });
      for (let off = 0; off < bytes.length; off += 1 << 20) {
        bidi.write({ chunk: { chunk_id: 1, offset: off, data: bytes.subarray(off, off + (1 << 20)) } });
      }
      bidi.end();
    });
    const { value: event } = await session.events.next();
    const captured = decodeFloat32(event.output.tensor);
    assert.equal(captured.values.length, n);
    for (const i of [0, 1, 999, 1000, n - 1]) assert.equal(captured.values[i], (i % 1000) * 2);
    session.stream.cancel();
  } finally {
    close();
  }
});
