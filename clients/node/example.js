'use strict';
// Calls attnserve's LayerNorm, Attend and MultiHeadAttend once each.
// Usage: node example.js [--target=127.0.0.1:50051] [--model=demo]

const { connect, toTensor, fromTensor } = require('./attnserve');

function flag(name, fallback) {
  const prefix = `--${name}=`;
  const arg = process.argv.find((a) => a.startsWith(prefix));
  return arg ? arg.slice(prefix.length) : fallback;
}

function dims(shape) {
  return `[${shape.join(', ')}]`;
}

// Deterministic values in [-1, 1).
function values(n, seed) {
  return Float32Array.from({ length: n }, (_, i) => Math.sin(seed + i * 1.7));
}

async function main() {
  const client = connect(flag('target', '127.0.0.1:50051'));
  const model = flag('model', 'demo');
  try {
    // LayerNorm over the last dim of [2, 8], checked against plain JS.
    const x = values(16, 1);
    const norm = fromTensor((await client.layerNorm({
      input: toTensor(x, [2, 8]), eps: 1e-5,
    })).output);
    let diff = 0;
    for (let row = 0; row < 2; row++) {
      const xs = x.subarray(row * 8, row * 8 + 8);
      const mean = xs.reduce((a, b) => a + b) / 8;
      const variance = xs.reduce((a, b) => a + (b - mean) ** 2, 0) / 8;
      xs.forEach((v, i) => {
        const expected = (v - mean) / Math.sqrt(variance + 1e-5);
        diff = Math.max(diff, Math.abs(norm.data[row * 8 + i] - expected));
      });
    }
    console.log(`LayerNorm: output ${dims(norm.shape)}, ` +
      `max |diff| vs JS ${diff.toExponential(1)}`);

    // Causal attention: 2 heads, 4 queries and keys of dim 8.
    const shape = [2, 4, 8];
    const attended = await client.attend({
      query: toTensor(values(64, 2), shape),
      key: toTensor(values(64, 3), shape),
      value: toTensor(values(64, 4), shape),
      causal: true,
      return_weights: true,
    });
    const weights = fromTensor(attended.weights);
    const lastRow = Array.from(weights.data.subarray(12, 16),
      (w) => Number(w.toFixed(2)));
    console.log(`Attend: output ${dims(fromTensor(attended.output).shape)}, ` +
      `last query's weights ${dims(lastRow)}`);

    // Multi-head attention with the server's model, batch 1, 6 tokens;
    // the last 2 are padding (key_padding_mask: 1 keeps a key).
    const meta = await client.getModelMetadata({ name: model });
    const width = Number(meta.query_dim);
    const keep = Uint8Array.from([1, 1, 1, 1, 0, 0]);
    const reply = await client.multiHeadAttend({
      model,
      query: toTensor(values(6 * width, 5), [1, 6, width]),
      key_padding_mask: toTensor(keep, [1, 6]),
    });
    const output = fromTensor(reply.output);
    console.log(`MultiHeadAttend (${model}, ${meta.num_heads} heads): ` +
      `output ${dims(output.shape)}, first values ` +
      dims(Array.from(output.data.subarray(0, 3), (v) => v.toFixed(4))));
  } finally {
    client.close();
  }
}

main().catch((error) => {
  console.error(error.message);
  process.exitCode = 1;
});
