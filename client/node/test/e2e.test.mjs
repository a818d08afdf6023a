// End-to-end: a stock gRPC client in another language does what the Python SDK does.
// Needs a running server with the demo models, e.g. `make serve` (or `hookwire serve`),
// then: HOOKWIRE_TARGET=127.0.0.1:50051 node --test test/   (the default target).
// It only uses the demo `mlp`. Every call has a deadline, every wait a time limit and
// each test a timeout, and streams are cancelled in `finally`: without a server, or
// with a wrong one, it fails within seconds instead of hanging.
import { test } from "node:test";
import assert from "node:assert/strict";
import { call, connect, decodeFloat32, deadlineIn, float32Tensor, openSession, within } from "../hookwire.mjs";

const target = process.env.HOOKWIRE_TARGET ?? "127.0.0.1:50051";
const CALL_MS = 30_000; // per call: generous on a loaded machine, a hang guard only
const TEST_MS = 120_000; // per test

/** ListModels first, with a short deadline, so that a missing server or model is said plainly. */
async function requireMlp(models) {
  let listing;
  try {
    listing = await call(models, "ListModels", {}, { timeoutMs: 10_000 });
  } catch (err) {
    throw new Error(`no hookwire server answers at ${target} (set HOOKWIRE_TARGET; start one with make serve): ${err.message}`);
  }
  assert.ok(listing.models.some((m) => m.name === "mlp"),
    `the server at ${target} does not host the demo model mlp (hookwire serve hosts it by default)`);
}

test("lists models, hooks a module, runs Infer, and decodes the captured tensor", { timeout: TEST_MS }, async () => {
  const { models, hooks, close } = connect(target);
  let session;
  try {
    await requireMlp(models);
    const info = await call(models, "GetModel", { name: "mlp" });
    assert.deepEqual(info.modules.map((m) => m.path).slice(0, 2), ["", "fc1"]);

    session = await openSession(hooks);
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

    const event = await session.next(CALL_MS);
    assert.equal(event.hook_id, hook.hook_id);
    assert.equal(event.request_id, reply.request_id);
    assert.equal(event.phase, "PHASE_FORWARD");
    assert.equal(Number(event.seq), 1);
    const captured = decodeFloat32(event.output.tensor);
    assert.deepEqual(captured.shape, output.shape);
    assert.deepEqual(Array.from(captured.values), Array.from(output.values), "the hook saw exactly the output");

    const removed = await call(hooks, "DeregisterHook", { hook_id: hook.hook_id });
    assert.equal(removed.removed, true);
  } finally {
    session?.stream.cancel();
    close();
  }
});

test("large tensors travel in chunks that fit 4 MiB messages", { timeout: TEST_MS }, async () => {
  const { models, hooks, close } = connect(target);
  let session;
  let bidi;
  try {
    await requireMlp(models);
    session = await openSession(hooks);
    // The mlp's input, captured as it enters: 6 MB of float32, chunked both ways.
    await call(hooks, "RegisterHook", {
      session_id: session.sessionId,
      spec: { model: "mlp", module: "", posthook: { capture: ["PART_ARGS", "PART_OUTPUT"] } },
    });
    const rows = 187_500;
    const n = rows * 8;
    const x = new Float32Array(n).map((_, i) => i % 1000);
    bidi = models.InferStream({ deadline: deadlineIn(CALL_MS) });
    const done = new Promise((resolve, reject) => {
      bidi.on("data", () => {});
      bidi.on("error", reject);
      bidi.on("end", resolve);
    });
    const bytes = Buffer.from(x.buffer);
    bidi.write({ request: { model: "mlp", session_id: session.sessionId,
      args: [{ tensor: { dtype: "DTYPE_FLOAT32", shape: [rows, 8], chunk_id: 1 } }] } });
    for (let off = 0; off < bytes.length; off += 1 << 20) {
      bidi.write({ chunk: { chunk_id: 1, offset: off, data: bytes.subarray(off, off + (1 << 20)) } });
    }
    bidi.end();
    await within(done, CALL_MS, "InferStream");
    const event = await session.next(CALL_MS);
    const captured = decodeFloat32(event.args[0].tensor);
    assert.deepEqual(captured.shape, [rows, 8]);
    for (const i of [0, 1, 999, 1000, n - 1]) assert.equal(captured.values[i], i % 1000);
    assert.deepEqual(decodeFloat32(event.output.tensor).shape, [rows, 4]);
  } finally {
    bidi?.cancel();
    session?.stream.cancel();
    close();
  }
});
