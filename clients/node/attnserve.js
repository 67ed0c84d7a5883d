'use strict';
// attnserve client helpers for Node.js: the proto is loaded at run time with
// @grpc/proto-loader, calls return promises, and tensors convert between
// typed arrays and the wire Tensor (little-endian bytes in raw_data).

const os = require('node:os');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

// Typed arrays use the host's byte order; the wire is little-endian.
if (os.endianness() !== 'LE') {
  throw new Error('attnserve.js supports little-endian hosts only');
}

const PROTO_DIR = process.env.ATTNSERVE_PROTO_DIR ||
  path.resolve(__dirname, '..', '..', 'proto');

/** The attnserve.v1 package (messages and AttentionService). */
function loadApi(protoDir = PROTO_DIR) {
  const definition = protoLoader.loadSync('attnserve/v1/attention.proto', {
    includeDirs: [protoDir],
    keepCase: true, // raw_data, num_heads, ... as in the proto
    longs: Number, // shapes are int64
    enums: String, // 'DATA_TYPE_FLOAT32'
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).attnserve.v1;
}

const METHODS = {
  attend: 'Attend',
  multiHeadAttend: 'MultiHeadAttend',
  layerNorm: 'LayerNorm',
  rmsNorm: 'RmsNorm',
  listModels: 'ListModels',
  getModelMetadata: 'GetModelMetadata',
  createSession: 'CreateSession',
  sessionStep: 'SessionStep',
  deleteSession: 'DeleteSession',
};

/**
 * A client for `target` ("host:port") whose methods (attend,
 * multiHeadAttend, layerNorm, rmsNorm, listModels, getModelMetadata, and the
 * decode sessions' createSession, sessionStep, deleteSession) take a request
 * object and optional { deadlineSeconds, metadata } and return a promise of
 * the response; exportSession(sessionId, options) and importSession(data,
 * { sessionId, chunkBytes, ...options }) move a session between servers.
 * `raw` is the underlying grpc-js client; close() closes it.
 */
function connect(target, { credentials, protoDir } = {}) {
  const api = loadApi(protoDir);
  const raw = new api.AttentionService(
    target, credentials || grpc.credentials.createInsecure(), {
      // grpc-js caps received messages at 4 MiB; the server has its own cap.
      'grpc.max_receive_message_length': -1,
      'grpc.max_send_message_length': -1,
      // grpc-js has no BDP probing and opens with HTTP/2's 64 KiB receive
      // window: a large output would then wait a round trip per 64 KiB
      // (64 MB/s at 1 ms). 64 MiB lets it flow (loopback: 52 vs 56 ms
      // for Attend B8 H8 L512).
      'grpc-node.flow_control_window': 64 * 1024 * 1024,
    });
  const client = { raw, close: () => raw.close() };
  for (const [name, rpc] of Object.entries(METHODS)) {
    client[name] = (request, { deadlineSeconds, metadata } = {}) => {
      const options = {};
      if (deadlineSeconds) {
        options.deadline = new Date(Date.now() + deadlineSeconds * 1000);
      }
      return new Promise((resolve, reject) => {
        raw[rpc](request, metadata || new grpc.Metadata(), options,
          (error, response) => (error ? reject(error) : resolve(response)));
      });
    };
  }
  client.exportSession = (sessionId, options) =>
    exportSession(raw, sessionId, options);
  client.importSession = (data, options) => importSession(raw, data, options);
  return client;
}

// A broken stream (UNAVAILABLE) is resumed this many times, as the C++
// client does.
const TRANSFER_RETRIES = 2;

function callOptions({ deadlineSeconds } = {}) {
  return deadlineSeconds ?
    { deadline: new Date(Date.now() + deadlineSeconds * 1000) } : {};
}

// One export stream from the bytes `state` has (state.chunks, at
// state.version), which it adds to.
function exportStream(raw, sessionId, state, options) {
  return new Promise((resolve, reject) => {
    let at = state.chunks.reduce((n, chunk) => n + chunk.length, 0);
    let size = 0;
    const call = raw.ExportSession(
      { session_id: sessionId, offset: at, version: state.version },
      options.metadata || new grpc.Metadata(), callOptions(options));
    call.on('data', (chunk) => {
      if (chunk.offset !== at) {
        call.cancel();
        reject(new Error(`export: a chunk at offset ${chunk.offset} after ` +
          `${at} bytes`));
        return;
      }
      state.chunks.push(chunk.data);
      state.version = chunk.version;
      at += chunk.data.length;
      size = chunk.size;
    });
    call.on('error', reject);
    call.on('end', () => {
      if (at === size) return resolve();
      const error = new Error(
        `export: the stream ended after ${at} of ${size} bytes`);
      error.code = grpc.status.UNAVAILABLE;
      reject(error);
    });
  });
}

/**
 * The file of session `sessionId` (the --session_dir format) as a Buffer,
 * which importSession opens on any server. A stream that breaks
 * (UNAVAILABLE) is resumed from the bytes it has, at the same session
 * version; a session stepped meanwhile ends the export with ABORTED.
 */
async function exportSession(raw, sessionId, options = {}) {
  const state = { chunks: [], version: 0 };
  for (let attempt = 0; ; attempt++) {
    try {
      await exportStream(raw, sessionId, state, options);
      return Buffer.concat(state.chunks);
    } catch (error) {
      if (error.code !== grpc.status.UNAVAILABLE ||
          attempt === TRANSFER_RETRIES) {
        throw error;
      }
    }
  }
}

// One import stream: `data` from `offset` (none left: a question, how far
// the import of `sessionId` got). Each chunk waits for the one before to
// drain, and sending stops once the server has answered.
function importStream(raw, sessionId, data, offset, chunkBytes, options) {
  return new Promise((resolve, reject) => {
    let answered = false;
    const call = raw.ImportSession(options.metadata || new grpc.Metadata(),
      callOptions(options), (error, response) => {
        answered = true;
        if (error) reject(error); else resolve(response);
      });
    call.on('error', () => {}); // the callback has it
    const send = async () => {
      if (offset >= data.length) call.write({ session_id: sessionId, offset });
      for (let at = offset; at < data.length && !answered; at += chunkBytes) {
        const more = call.write({
          session_id: at === offset ? sessionId : '', offset: at,
          data: data.subarray(at, at + chunkBytes),
        });
        if (!more && !answered) {
          await new Promise((drained) => {
            call.once('drain', drained);
            call.once('close', drained);
            call.once('status', drained); // answered: nothing more to send
          });
        }
      }
      call.end();
    };
    send().catch(reject);
  });
}

/**
 * Opens the session of file `data` (a Buffer exportSession gave) under the
 * id in the file, in chunks of `chunkBytes`; resolves to the
 * ImportSessionResponse. With `sessionId` (the exported session's), an
 * import this or an earlier call left under way goes on from the bytes the
 * server has taken, and a stream that breaks is resumed.
 */
async function importSession(raw, data,
  { sessionId = '', chunkBytes = 1 << 20, ...options } = {}) {
  chunkBytes = Math.max(1, Math.floor(chunkBytes));
  for (let attempt = 0; ; attempt++) {
    let resumed = '';
    let offset = 0;
    if (sessionId) {
      try {
        const progress = await importStream(raw, sessionId, Buffer.alloc(0),
          0, chunkBytes, options);
        [resumed, offset] = [sessionId, progress.received];
      } catch (error) {
        if (error.code === grpc.status.UNAVAILABLE &&
            attempt < TRANSFER_RETRIES) {
          // The stream that broke may hold the import until the server
          // sees it end: ask again shortly.
          await new Promise((wait) => setTimeout(wait, 100 * (attempt + 1)));
          continue;
        }
        if (error.code !== grpc.status.NOT_FOUND) throw error;
      }
    }
    let failure;
    try {
      const response = await importStream(raw, resumed, data, offset,
        chunkBytes, options);
      if (response.received === response.size) return response;
      failure = new Error(`import: the server took ${response.received} of ` +
        `the file's ${response.size} bytes`);
      failure.code = grpc.status.UNAVAILABLE;
    } catch (error) {
      failure = error;
    }
    if (failure.code !== grpc.status.UNAVAILABLE || !sessionId ||
        attempt === TRANSFER_RETRIES) {
      throw failure;
    }
  }
}

function elementCount(shape) {
  return shape.reduce((n, d) => n * d, 1);
}

/**
 * A wire Tensor from a typed array (or plain array) and its shape:
 * Float32Array (or numbers) as FLOAT32, Uint8Array as `dtype` BOOL or UINT8.
 */
function toTensor(data, shape, dtype) {
  if (!ArrayBuffer.isView(data)) data = Float32Array.from(data);
  if (data.length !== elementCount(shape)) {
    throw new Error(`toTensor: ${data.length} values for shape [${shape}]`);
  }
  if (data instanceof Float32Array) {
    dtype = dtype || 'DATA_TYPE_FLOAT32';
  } else if (data instanceof Uint8Array) {
    dtype = dtype || 'DATA_TYPE_BOOL';
  } else {
    throw new Error('toTensor: expected a Float32Array or a Uint8Array');
  }
  return {
    dtype,
    shape: Array.from(shape),
    raw_data: Buffer.from(data.buffer, data.byteOffset, data.byteLength),
  };
}

function halfToFloat(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const exponent = (h >> 10) & 0x1f;
  const fraction = h & 0x3ff;
  if (exponent === 0) return sign * 2 ** -14 * (fraction / 1024);
  if (exponent === 31) return fraction ? NaN : sign * Infinity;
  return sign * 2 ** (exponent - 15) * (1 + fraction / 1024);
}

/**
 * { shape, dtype, data } of a wire Tensor: data is a Float32Array for the
 * float dtypes (BFLOAT16 and FLOAT16 widened) and a Uint8Array for BOOL and
 * UINT8.
 */
function fromTensor(tensor) {
  const shape = tensor.shape.map(Number);
  const { dtype } = tensor;
  const bytes = tensor.raw_data || Buffer.alloc(0);
  if (bytes.length === 0 && tensor.float_data && tensor.float_data.length) {
    return { shape, dtype, data: Float32Array.from(tensor.float_data) };
  }
  // Copy: typed arrays need aligned offsets, and the response's buffer is
  // shared with grpc-js.
  const copy = new Uint8Array(bytes).buffer;
  let data;
  switch (dtype) {
    case 'DATA_TYPE_FLOAT32':
      data = new Float32Array(copy);
      break;
    case 'DATA_TYPE_BFLOAT16': {
      // bfloat16 is the upper half of a float32.
      const bits = new Uint16Array(copy);
      const wide = new Uint32Array(bits.length);
      for (let i = 0; i < bits.length; i++) wide[i] = bits[i] << 16;
      data = new Float32Array(wide.buffer);
      break;
    }
    case 'DATA_TYPE_FLOAT16':
      data = Float32Array.from(new Uint16Array(copy), halfToFloat);
      break;
    case 'DATA_TYPE_BOOL':
    case 'DATA_TYPE_UINT8':
      data = new Uint8Array(copy);
      break;
    default:
      throw new Error(`fromTensor: unknown dtype ${dtype}`);
  }
  if (data.length !== elementCount(shape)) {
    throw new Error(`fromTensor: ${data.length} values for shape [${shape}]`);
  }
  return { shape, dtype, data };
}

module.exports = { connect, loadApi, toTensor, fromTensor, grpc, PROTO_DIR };
