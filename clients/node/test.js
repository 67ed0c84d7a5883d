'use strict';
// Tests of the Node client against a live attnserve, with small float64
// reference implementations in JS. Environment: ATTNSERVE_BIN (the server
// binary) and ATTNSERVE_MODEL_REPOSITORY (a repository holding `demo`);
// both default to the build folder next to this checkout's sources.

const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { spawn, execFile } = require('node:child_process');
const fs = require('node:fs');
const path = require('node:path');
const { connect, toTensor, fromTensor, grpc } = require('./attnserve');

const BUILD = path.resolve(__dirname, '..', '..', 'build');
const SERVER_BIN = process.env.ATTNSERVE_BIN ||
  path.join(BUILD, 'bin', 'attnserve');
const MODELS = process.env.ATTNSERVE_MODEL_REPOSITORY ||
  path.join(BUILD, 'models');

let server;
let target;
let client;

function startServer() {
  return new Promise((resolve, reject) => {
    const child = spawn(SERVER_BIN, [
      '--host=127.0.0.1', '--port=0', '--metrics_port=-1', '--http_port=-1',
      `--model_repository=${MODELS}`,
    ], { stdio: ['ignore', 'pipe', 'pipe'] });
    // Drained so that the access log never blocks the server.
    let stdout = '';
    let stderr = '';
    child.stderr.on('data', (chunk) => {
      stderr = (stderr + chunk).slice(-4096);
    });
    child.stdout.on('data', (chunk) => {
      stdout += chunk;
      const match = /attnserve listening on (\S+)/.exec(stdout);
      if (match) resolve({ child, address: match[1] });
    });
    child.on('error', reject);
    child.on('exit', (code) => {
      reject(new Error(`attnserve exited (${code}) at start: ${stderr}`));
    });
    setTimeout(() => reject(new Error('attnserve did not start')), 30000)
      .unref();
  });
}

before(async () => {
  ({ child: server, address: target } = await startServer());
  // Whatever happens to the tests, the server goes with this process.
  process.on('exit', () => server.kill('SIGKILL'));
  client = connect(target);
});

after(async () => {
  client.close();
  const exited = new Promise((resolve) => server.once('exit', resolve));
  server.kill('SIGTERM');
  await exited;
});

// --- Deterministic inputs and comparison --------------------------------

function rng(seed) {
  // mulberry32: small, seeded, good enough for test data.
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function randn(random, n, scale = 1) {
  return Float32Array.from({ length: n }, () => {
    // Box-Muller.
    const u = 1 - random();
    const r = Math.sqrt(-2 * Math.log(u));
    return scale * r * Math.cos(2 * Math.PI * random());
  });
}

// The README's float32 contract: |got - expected| <= 1e-4 + 1e-4 |expected|.
function assertClose(got, expected, tol = 1e-4) {
  assert.equal(got.length, expected.length, 'lengths');
  for (let i = 0; i < got.length; i++) {
    const bound = tol + tol * Math.abs(expected[i]);
    if (!(Math.abs(got[i] - expected[i]) <= bound)) {
      assert.fail(`element ${i}: got ${got[i]}, expected ${expected[i]}`);
    }
  }
}

// --- References (float64) -----------------------------------------------

function layerNormRef(x, width, { gamma, beta, eps = 1e-5 } = {}) {
  const out = new Float64Array(x.length);
  for (let row = 0; row < x.length / width; row++) {
    const xs = x.subarray(row * width, (row + 1) * width);
    const mean = xs.reduce((a, b) => a + b, 0) / width;
    const variance = xs.reduce((a, b) => a + (b - mean) ** 2, 0) / width;
    const inv = 1 / Math.sqrt(variance + eps);
    for (let i = 0; i < width; i++) {
      let y = (xs[i] - mean) * inv;
      if (gamma) y *= gamma[i];
      if (beta) y += beta[i];
      out[row * width + i] = y;
    }
  }
  return out;
}

/**
 * Attention over `batch` independent (Lq, dk) x (Lk, dk) x (Lk, dv)
 * problems; `keep(b, i, j)` says whether query i may see key j.
 */
function attendRef(q, k, v, { batch, lq, lk, dk, dv, scale, keep }) {
  scale = scale === undefined ? 1 / Math.sqrt(dk) : scale;
  const out = new Float64Array(batch * lq * dv);
  const weights = new Float64Array(batch * lq * lk);
  for (let b = 0; b < batch; b++) {
    for (let i = 0; i < lq; i++) {
      const logits = new Float64Array(lk).fill(-Infinity);
      let max = -Infinity;
      for (let j = 0; j < lk; j++) {
        if (keep && !keep(b, i, j)) continue;
        let dot = 0;
        for (let d = 0; d < dk; d++) {
          dot += q[(b * lq + i) * dk + d] * k[(b * lk + j) * dk + d];
        }
        logits[j] = dot * scale;
        max = Math.max(max, logits[j]);
      }
      if (max === -Infinity) continue; // no key left: zeros
      const p = logits.map((l) => Math.exp(l - max));
      const sum = p.reduce((a, c) => a + c, 0);
      for (let j = 0; j < lk; j++) {
        const w = p[j] / sum;
        weights[(b * lq + i) * lk + j] = w;
        for (let d = 0; d < dv; d++) {
          out[(b * lq + i) * dv + d] += w * v[(b * lk + j) * dv + d];
        }
      }
    }
  }
  return { out, weights };
}

// y = x W^T + b, nn.Linear's layout: W [outDim, inDim].
function linear(x, rows, inDim, w, b, outDim) {
  const y = new Float64Array(rows * outDim);
  for (let r = 0; r < rows; r++) {
    for (let o = 0; o < outDim; o++) {
      let s = b ? b[o] : 0;
      for (let i = 0; i < inDim; i++) s += x[r * inDim + i] * w[o * inDim + i];
      y[r * outDim + o] = s;
    }
  }
  return y;
}

// [B, L, H*d] -> [B*H, L, d]
function splitHeads(x, B, L, H, d) {
  const y = new Float64Array(x.length);
  for (let b = 0; b < B; b++) {
    for (let l = 0; l < L; l++) {
      for (let h = 0; h < H; h++) {
        for (let i = 0; i < d; i++) {
          y[((b * H + h) * L + l) * d + i] = x[(b * L + l) * H * d + h * d + i];
        }
      }
    }
  }
  return y;
}

/**
 * Multi-head attention; `w` holds Float32Arrays qW [H*dk, Eq], kW, vW,
 * optional qB, kB, vB, oW [Eo, H*dv], oB. Returns { out [B, Lq, Eo],
 * weights [B, H, Lq, Lk] }.
 */
function mhaRef(query, key, value, w, { B, lq, lk, eq, ek, ev, H, dk, dv, eo,
  keepKey }) {
  const project = (x, rows, inDim, weight, bias, d, L) =>
    splitHeads(linear(x, rows, inDim, weight, bias, H * d), B, L, H, d);
  const q = project(query, B * lq, eq, w.qW, w.qB, dk, lq);
  const k = project(key, B * lk, ek, w.kW, w.kB, dk, lk);
  const v = project(value, B * lk, ev, w.vW, w.vB, dv, lk);
  const keep = keepKey && ((bh, i, j) => keepKey(Math.floor(bh / H), j));
  const heads = attendRef(q, k, v, { batch: B * H, lq, lk, dk, dv, keep });
  // [B*H, Lq, dv] -> [B, Lq, H*dv]
  const concat = new Float64Array(B * lq * H * dv);
  for (let b = 0; b < B; b++) {
    for (let h = 0; h < H; h++) {
      for (let i = 0; i < lq; i++) {
        for (let d = 0; d < dv; d++) {
          concat[(b * lq + i) * H * dv + h * dv + d] =
            heads.out[((b * H + h) * lq + i) * dv + d];
        }
      }
    }
  }
  const out = linear(concat, B * lq, H * dv, w.oW, w.oB, eo);
  return { out, weights: heads.weights };
}

// A safetensors file's F32 tensors: 8 bytes of header length, JSON, data.
function readSafetensors(file) {
  const bytes = fs.readFileSync(file);
  const length = Number(bytes.readBigUInt64LE(0));
  const header = JSON.parse(bytes.subarray(8, 8 + length).toString());
  const tensors = {};
  for (const [name, info] of Object.entries(header)) {
    if (name === '__metadata__') continue;
    assert.equal(info.dtype, 'F32', name);
    const [begin, end] = info.data_offsets;
    const data = bytes.subarray(8 + length + begin, 8 + length + end);
    tensors[name] = new Float32Array(new Uint8Array(data).buffer);
  }
  return tensors;
}

// --- Tests --------------------------------------------------------------

test('LayerNorm matches a JS reference', async () => {
  const random = rng(1);
  const x = randn(random, 3 * 4 * 10);
  const gamma = randn(random, 40);
  const beta = randn(random, 40);
  // Two trailing dims normalized together, with an affine transform.
  let reply = await client.layerNorm({
    input: toTensor(x, [3, 4, 10]),
    gamma: toTensor(gamma, [4, 10]),
    beta: toTensor(beta, [4, 10]),
    eps: 1e-6,
    normalized_ndim: 2,
  });
  let output = fromTensor(reply.output);
  assert.deepEqual(output.shape, [3, 4, 10]);
  assert.equal(output.dtype, 'DATA_TYPE_FLOAT32');
  assertClose(output.data, layerNormRef(x, 40, { gamma, beta, eps: 1e-6 }));

  reply = await client.layerNorm({ input: toTensor(x, [12, 10]) });
  output = fromTensor(reply.output);
  assertClose(output.data, layerNormRef(x, 10));
});

test('RmsNorm matches a JS reference', async () => {
  const random = rng(9);
  const x = randn(random, 3 * 16);
  const gamma = randn(random, 16);
  const reply = await client.rmsNorm({
    input: toTensor(x, [3, 16]),
    gamma: toTensor(gamma, [16]),
    eps: 1e-5,
  });
  const output = fromTensor(reply.output);
  assert.deepEqual(output.shape, [3, 16]);
  const want = new Float64Array(x.length);
  for (let row = 0; row < 3; row++) {
    const xs = x.subarray(row * 16, (row + 1) * 16);
    const inv = 1 / Math.sqrt(xs.reduce((a, b) => a + b * b, 0) / 16 + 1e-5);
    for (let i = 0; i < 16; i++) want[row * 16 + i] = xs[i] * inv * gamma[i];
  }
  assertClose(output.data, want);
});

test('Attend matches a JS reference (batched, causal)', async () => {
  const random = rng(2);
  const [batch, lq, lk, dk, dv] = [6, 4, 5, 8, 6];
  const q = randn(random, batch * lq * dk);
  const k = randn(random, batch * lk * dk);
  const v = randn(random, batch * lk * dv);
  const reply = await client.attend({
    query: toTensor(q, [2, 3, lq, dk]),
    key: toTensor(k, [2, 3, lk, dk]),
    value: toTensor(v, [2, 3, lk, dv]),
    causal: true,
    return_weights: true,
  });
  const expected = attendRef(q, k, v, {
    batch, lq, lk, dk, dv, keep: (b, i, j) => j <= i,
  });
  const output = fromTensor(reply.output);
  assert.deepEqual(output.shape, [2, 3, lq, dv]);
  assertClose(output.data, expected.out);
  assert.deepEqual(fromTensor(reply.weights).shape, [2, 3, lq, lk]);
  assertClose(fromTensor(reply.weights).data, expected.weights);
});

test('a decode session matches attention over its history', async () => {
  // 4 query heads over 2 key/value heads (each serves 2), head dim 8: a
  // 4-token prompt, then one token a step.
  const random = rng(7);
  const [H, Hkv, d] = [4, 2, 8];
  const session = await client.createSession({
    num_heads: H, num_kv_heads: Hkv, head_dim: d, max_length: 16,
  });
  const keys = Array.from({ length: Hkv }, () => []);
  const values = Array.from({ length: Hkv }, () => []);
  let first = 0;
  for (const n of [4, 1, 1]) {
    const q = randn(random, H * n * d);
    const k = randn(random, Hkv * n * d);
    const v = randn(random, Hkv * n * d);
    const reply = await client.sessionStep({
      session_id: session.session_id,
      query: toTensor(q, [H, n, d]),
      key: toTensor(k, [Hkv, n, d]),
      value: toTensor(v, [Hkv, n, d]),
    });
    for (let h = 0; h < Hkv; h++) {
      keys[h].push(...k.subarray(h * n * d, (h + 1) * n * d));
      values[h].push(...v.subarray(h * n * d, (h + 1) * n * d));
    }
    const total = first + n;
    assert.equal(reply.length, total);
    // Key/value head h / (H / Hkv) for query head h, as repeat_interleave.
    const kRep = Float32Array.from(
      Array.from({ length: H }, (_, h) => keys[Math.floor(h / 2)]).flat());
    const vRep = Float32Array.from(
      Array.from({ length: H }, (_, h) => values[Math.floor(h / 2)]).flat());
    const expected = attendRef(q, kRep, vRep, {
      batch: H, lq: n, lk: total, dk: d, dv: d,
      keep: (b, i, j) => j <= first + i,
    });
    const output = fromTensor(reply.output);
    assert.deepEqual(output.shape, [H, n, d]);
    assertClose(output.data, expected.out);
    first = total;
  }
  await client.deleteSession({ session_id: session.session_id });
  await assert.rejects(client.sessionStep({
    session_id: session.session_id,
    query: toTensor(randn(random, H * d), [H, 1, d]),
    key: toTensor(randn(random, Hkv * d), [Hkv, 1, d]),
    value: toTensor(randn(random, Hkv * d), [Hkv, 1, d]),
  }), (error) => {
    assert.equal(error.code, grpc.status.NOT_FOUND);
    assert.equal(error.details,
      `session_id: session "${session.session_id}" was deleted`);
    return true;
  });
});

test('a session moves through exportSession and importSession', async () => {
  // Exported, deleted and imported again (the import cut short once and
  // resumed), the session holds its tokens: its next step attends to all.
  const random = rng(11);
  const [H, Hkv, d, n] = [2, 1, 8, 5];
  const session = await client.createSession({
    num_heads: H, num_kv_heads: Hkv, head_dim: d, max_length: 16,
  });
  const id = session.session_id;
  const k = randn(random, Hkv * n * d);
  const v = randn(random, Hkv * n * d);
  await client.sessionStep({
    session_id: id, query: toTensor(randn(random, H * n * d), [H, n, d]),
    key: toTensor(k, [Hkv, n, d]), value: toTensor(v, [Hkv, n, d]),
  });
  const data = await client.exportSession(id);
  assert.equal(data.subarray(0, 8).toString(), 'ATTNSESS');
  await client.deleteSession({ session_id: id });
  // Half the file in one stream: the import waits under the session's id.
  const half = Math.floor(data.length / 2);
  const partial = await new Promise((resolve, reject) => {
    const call = client.raw.ImportSession((error, response) =>
      (error ? reject(error) : resolve(response)));
    call.write({ offset: 0, data: data.subarray(0, half) });
    call.end();
  });
  assert.deepEqual([partial.received, partial.size], [half, data.length]);
  const imported = await client.importSession(data,
    { sessionId: id, chunkBytes: 64 });
  assert.equal(imported.session_id, id);
  assert.deepEqual(imported.lengths, [n]);
  const q = randn(random, H * d);
  const k1 = randn(random, Hkv * d);
  const v1 = randn(random, Hkv * d);
  const reply = await client.sessionStep({
    session_id: id, query: toTensor(q, [H, 1, d]),
    key: toTensor(k1, [Hkv, 1, d]), value: toTensor(v1, [Hkv, 1, d]),
  });
  const keys = Float32Array.from([...k, ...k1]);
  const values = Float32Array.from([...v, ...v1]);
  const expected = attendRef(q, Float32Array.from([...keys, ...keys]),
    Float32Array.from([...values, ...values]),
    { batch: H, lq: 1, lk: n + 1, dk: d, dv: d, keep: () => true });
  assertClose(fromTensor(reply.output).data, expected.out);
  await assert.rejects(client.importSession(data), (error) => {
    assert.equal(error.code, grpc.status.ALREADY_EXISTS);
    assert.equal(error.details,
      `session "${id}" is open here; delete it before importing it`);
    return true;
  });
  await client.deleteSession({ session_id: id });
});

test('Attend with a broadcast BOOL mask, scale and an empty row', async () => {
  const random = rng(3);
  const [batch, lq, lk, d] = [2, 3, 4, 8];
  const q = randn(random, batch * lq * d);
  const k = randn(random, batch * lk * d);
  const v = randn(random, batch * lk * d);
  // [Lq, Lk], shared by the batch; query 1 keeps no key.
  const mask = Uint8Array.from([1, 0, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0]);
  const reply = await client.attend({
    query: toTensor(q, [batch, lq, d]),
    key: toTensor(k, [batch, lk, d]),
    value: toTensor(v, [batch, lk, d]),
    attn_mask: toTensor(mask, [lq, lk], 'DATA_TYPE_BOOL'),
    scale: 0.25,
    return_weights: true,
  });
  const expected = attendRef(q, k, v, {
    batch, lq, lk, dk: d, dv: d, scale: 0.25,
    keep: (b, i, j) => mask[i * lk + j] !== 0,
  });
  const output = fromTensor(reply.output).data;
  assertClose(output, expected.out);
  assertClose(fromTensor(reply.weights).data, expected.weights);
  assert.ok(output.subarray(d, 2 * d).every((x) => x === 0));
});

test('MultiHeadAttend with inline weights matches a JS reference', async () => {
  const random = rng(4);
  // Cross attention with different widths: dk != dv, Eq != Ek != Ev.
  const dims = { B: 2, lq: 3, lk: 5, eq: 12, ek: 10, ev: 7, H: 3, dk: 4,
    dv: 5, eo: 9 };
  const { B, lq, lk, eq, ek, ev, H, dk, dv, eo } = dims;
  const w = {
    qW: randn(random, H * dk * eq, 0.3), qB: randn(random, H * dk, 0.1),
    kW: randn(random, H * dk * ek, 0.3), kB: randn(random, H * dk, 0.1),
    vW: randn(random, H * dv * ev, 0.3), vB: randn(random, H * dv, 0.1),
    oW: randn(random, eo * H * dv, 0.3), oB: randn(random, eo, 0.1),
  };
  const query = randn(random, B * lq * eq);
  const key = randn(random, B * lk * ek);
  const value = randn(random, B * lk * ev);
  // The second sequence's last two keys are padding.
  const keepKey = (b, j) => !(b === 1 && j >= 3);
  const padding = Uint8Array.from({ length: B * lk },
    (_, n) => (keepKey(Math.floor(n / lk), n % lk) ? 1 : 0));
  const reply = await client.multiHeadAttend({
    weights: {
      num_heads: H,
      q_proj_weight: toTensor(w.qW, [H * dk, eq]),
      k_proj_weight: toTensor(w.kW, [H * dk, ek]),
      v_proj_weight: toTensor(w.vW, [H * dv, ev]),
      q_proj_bias: toTensor(w.qB, [H * dk]),
      k_proj_bias: toTensor(w.kB, [H * dk]),
      v_proj_bias: toTensor(w.vB, [H * dv]),
      out_proj_weight: toTensor(w.oW, [eo, H * dv]),
      out_proj_bias: toTensor(w.oB, [eo]),
    },
    query: toTensor(query, [B, lq, eq]),
    key: toTensor(key, [B, lk, ek]),
    value: toTensor(value, [B, lk, ev]),
    key_padding_mask: toTensor(padding, [B, lk], 'DATA_TYPE_BOOL'),
    return_weights: true,
  });
  const expected = mhaRef(query, key, value, w, { ...dims, keepKey });
  const output = fromTensor(reply.output);
  assert.deepEqual(output.shape, [B, lq, eo]);
  assertClose(output.data, expected.out);
  const weights = fromTensor(reply.weights);
  assert.deepEqual(weights.shape, [B, H, lq, lk]);
  assertClose(weights.data, expected.weights);
});

test('MultiHeadAttend with the demo model', async () => {
  const meta = await client.getModelMetadata({ name: 'demo' });
  const E = Number(meta.query_dim);
  const H = meta.num_heads;
  const L = 4;
  const x = randn(rng(5), L * E);
  const reply = await client.multiHeadAttend({
    model: 'demo', query: toTensor(x, [1, L, E]),
  });
  const output = fromTensor(reply.output);
  assert.deepEqual(output.shape, [1, L, E]);
  assert.ok(output.data.every(Number.isFinite));
  assert.equal(reply.weights, null); // not asked for

  // The same layer in JS, from the model's PyTorch state_dict.
  const t = readSafetensors(path.join(MODELS, 'demo', 'weights.safetensors'));
  const third = (a, i) => a.subarray(i * a.length / 3, (i + 1) * a.length / 3);
  const w = {
    qW: third(t.in_proj_weight, 0), qB: third(t.in_proj_bias, 0),
    kW: third(t.in_proj_weight, 1), kB: third(t.in_proj_bias, 1),
    vW: third(t.in_proj_weight, 2), vB: third(t.in_proj_bias, 2),
    oW: t['out_proj.weight'], oB: t['out_proj.bias'],
  };
  const d = E / H;
  const expected = mhaRef(x, x, x, w, { B: 1, lq: L, lk: L, eq: E, ek: E,
    ev: E, H, dk: d, dv: d, eo: E });
  assertClose(output.data, expected.out);
});

test('a bad shape gets INVALID_ARGUMENT naming the field', async () => {
  const q = new Float32Array(2 * 5 * 16);
  const k = new Float32Array(2 * 5 * 8);
  await assert.rejects(client.attend({
    query: toTensor(q, [2, 5, 16]),
    key: toTensor(k, [2, 5, 8]),
    value: toTensor(k, [2, 5, 8]),
  }), (error) => {
    assert.equal(error.code, grpc.status.INVALID_ARGUMENT);
    assert.match(error.details, /^key: /);
    return true;
  });
  await assert.rejects(client.multiHeadAttend({
    model: 'no_such_model', query: toTensor(q, [2, 5, 16]),
  }), (error) => error.code === grpc.status.NOT_FOUND);
  // The server keeps serving.
  await client.layerNorm({ input: toTensor(q, [10, 16]) });
});

test('example.js runs', async () => {
  const stdout = await new Promise((resolve, reject) => {
    execFile(process.execPath, [path.join(__dirname, 'example.js'),
      `--target=${target}`], { timeout: 30000 }, (error, out, err) => {
      if (error) reject(new Error(`${error.message}\n${err}`));
      else resolve(out);
    });
  });
  assert.match(stdout, /^LayerNorm: output \[2, 8\], max \|diff\| vs JS /m);
  assert.match(stdout, /^Attend: output \[2, 4, 8\]/m);
  assert.match(stdout,
    /^MultiHeadAttend \(demo, 8 heads\): output \[1, 6, 512\]/m);
});
