// A minimal hookwire client for Node.js, built from proto/ alone: no generated code.
// It shows what any language needs: load the contract, encode/decode Tensor bytes,
// open a session, register a hook, run Infer, read events (including chunked tensors).
import path from "node:path";
import { fileURLToPath } from "node:url";
import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

const here = path.dirname(fileURLToPath(import.meta.url));
export const PROTO_ROOT = path.resolve(here, "..", "..", "proto");

const definition = protoLoader.loadSync(
  ["hookwire/v1/model_service.proto", "hookwire/v1/hook_service.proto"],
  { includeDirs: [PROTO_ROOT], keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true },
);
const v1 = grpc.loadPackageDefinition(definition).hookwire.v1;

/** Clients of both services on one channel. Streams chunk tensors to fit 4 MiB messages. */
export function connect(target) {
  const options = { "grpc.max_receive_message_length": 64 * 1024 * 1024, "grpc.max_send_message_length": 64 * 1024 * 1024 };
  const models = new v1.ModelService(target, grpc.credentials.createInsecure(), options);
  const hooks = new v1.HookService(target, grpc.credentials.createInsecure(), options);
  return { models, hooks, close: () => { models.close(); hooks.close(); } };
}

/** Milliseconds a call may take unless told otherwise: a client must never wait forever. */
export const DEFAULT_TIMEOUT_MS = 30_000;

/** A grpc-js deadline `ms` milliseconds from now. */
export function deadlineIn(ms) {
  return new Date(Date.now() + ms);
}

/** Promise wrapper for a unary call, with a deadline (`timeoutMs`, default 30 s): DEADLINE_EXCEEDED after it. */
export function call(client, method, request, { timeoutMs = DEFAULT_TIMEOUT_MS } = {}) {
  return new Promise((resolve, reject) =>
    client[method](request, { deadline: deadlineIn(timeoutMs) }, (err, reply) => (err ? reject(err) : resolve(reply))));
}

/** `promise`, or a rejection naming `what` after `ms` milliseconds (the timer never keeps the process alive). */
export function within(promise, ms, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: nothing after ${ms} ms`)), ms);
    timer.unref();
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

/** A float32 Tensor message: raw little-endian bytes, C order. */
export function float32Tensor(values, shape) {
  const array = Float32Array.from(values);
  return { dtype: "DTYPE_FLOAT32", shape, data: Buffer.from(array.buffer, array.byteOffset, array.byteLength) };
}

/** Decodes a float32 Tensor message (copying: a Buffer's offset need not be 4-aligned). */
export function decodeFloat32(tensor) {
  if (tensor.dtype !== "DTYPE_FLOAT32") throw new Error(`expected DTYPE_FLOAT32, got ${tensor.dtype}`);
  const bytes = Buffer.from(tensor.data);
  const count = tensor.shape.reduce((a, b) => a * Number(b), 1);
  if (bytes.length !== count * 4) throw new Error(`${bytes.length} bytes for ${count} float32 values`);
  return { shape: tensor.shape.map(Number), values: new Float32Array(bytes.buffer, bytes.byteOffset, count) };
}

/** Every Tensor with a chunk_id inside a message (its bytes follow as TensorChunks). */
export function chunkedTensors(value, out = []) {
  if (value && typeof value === "object") {
    if ("chunk_id" in value && "dtype" in value && value.chunk_id) out.push(value);
    for (const item of Object.values(value)) if (item && typeof item === "object") chunkedTensors(item, out);
  }
  return out;
}

/**
 * Opens a session. Resolves with { sessionId, events, next, stream }: `events` is an async
 * iterator of InterceptEvents, with chunked tensors reassembled into their `data`;
 * `next(ms)` is the next event, or a rejection after `ms` milliseconds. Rejects when the
 * server does not open it within `openTimeoutMs` (the stream is cancelled then);
 * `deadlineMs` ends the whole stream (DEADLINE_EXCEEDED) after that long. Cancel
 * `stream` when done: an open session keeps the process alive.
 */
export function openSession(hooks, { openTimeoutMs = DEFAULT_TIMEOUT_MS, deadlineMs } = {}) {
  const stream = hooks.OpenSession({}, deadlineMs === undefined ? {} : { deadline: deadlineIn(deadlineMs) });
  const queue = [];
  let wake = null;
  let ended = null;
  let pending = null; // { event, tensors: Map<id, {tensor, buffer, filled}> }
  const push = (event) => { queue.push(event); if (wake) { wake(); wake = null; } };
  const opened = new Promise((resolve, reject) => {
    stream.on("data", (msg) => {
      if (msg.kind === "opened") {
        const events = iterate();
        const next = async (ms = DEFAULT_TIMEOUT_MS) => {
          const { value, done } = await within(events.next(), ms, "waiting for an event");
          if (done) throw ended ?? new Error("session stream ended");
          return value;
        };
        resolve({ sessionId: msg.opened.session_id, events, next, stream });
      } else if (msg.kind === "event") {
        const chunked = chunkedTensors(msg.event);
        if (chunked.length === 0) return push(msg.event);
        pending = { event: msg.event, tensors: new Map() };
        for (const t of chunked) {
          const size = t.shape.reduce((a, b) => a * Number(b), 1) * itemsize(t.dtype);
          pending.tensors.set(t.chunk_id, { tensor: t, buffer: Buffer.alloc(size), filled: 0 });
        }
      } else if (msg.kind === "chunk") {
        const slot = pending.tensors.get(msg.chunk.chunk_id);
        msg.chunk.data.copy(slot.buffer, Number(msg.chunk.offset));
        slot.filled += msg.chunk.data.length;
        if ([...pending.tensors.values()].every((s) => s.filled === s.buffer.length)) {
          for (const s of pending.tensors.values()) { s.tensor.data = s.buffer; s.tensor.chunk_id = 0; }
          push(pending.event);
          pending = null;
        }
      } else if (msg.kind === "batch") {
        for (const event of msg.batch.events) push(event);
      }
    });
    stream.on("error", (err) => { ended = err; reject(err); if (wake) wake(); });
    stream.on("end", () => { ended = ended || new Error("session stream ended"); if (wake) wake(); });
  });
  return within(opened, openTimeoutMs, "opening a session").catch((err) => { stream.cancel(); throw err; });

  async function* iterate() {
    while (true) {
      if (queue.length) { yield queue.shift(); continue; }
      if (ended) return;
      await new Promise((r) => { wake = r; });
    }
  }
}

const ITEMSIZE = { DTYPE_FLOAT64: 8, DTYPE_INT64: 8, DTYPE_FLOAT32: 4, DTYPE_INT32: 4, DTYPE_FLOAT16: 2, DTYPE_BFLOAT16: 2,
  DTYPE_INT16: 2, DTYPE_INT8: 1, DTYPE_UINT8: 1, DTYPE_BOOL: 1 };
export function itemsize(dtype) { return ITEMSIZE[dtype]; }
