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
 * the response. `raw` is the underlying grpc-js client; close() closes it.
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
  return client;
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
