#!/usr/bin/env python3
"""Times attnserve's core and PyTorch on the same shapes, side by side.

Both run in this one process, on the same buffers, with the same number of
OpenMP threads, warmed up and alternating call by call; the table reports
the median of each and their ratio. Run with Debian's interpreter:

    /usr/bin/python3 benchmarks/vs_pytorch.py [--build build] [--threads 2]

PyTorch's GEMMs go through the system BLAS: install libopenblas0-openmp
(scripts/bench.sh does). ATTNSERVE_CPU_ISA=avx2 (or sse4) caps both sides
at that instruction set, to compare as on a CPU without AVX-512. OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE, which some
machines set and which halve OpenBLAS's speed, are removed from this process
before OpenBLAS loads.
"""
import argparse
import ctypes
import os
import statistics
import sys
import time

_SLOW_BLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
# ATTNSERVE_CPU_ISA=avx2 or sse4 caps attnserve (its row kernels and
# oneDNN) and PyTorch alike, as on a CPU without AVX-512: OpenBLAS takes
# that instruction set's kernels, and PyTorch's oneDNN is turned off (see
# main), so that its bfloat16 matmul takes the path it takes there.
_CAPPED_ISA = os.environ.get("ATTNSERVE_CPU_ISA", "")
_CAPPED_BLAS = {"avx2": "Haswell", "sse4": "Nehalem"}.get(_CAPPED_ISA)
_WANTED_BLAS = {"OPENBLAS_CORETYPE": _CAPPED_BLAS} if _CAPPED_BLAS else {}
if {v: os.environ[v] for v in _SLOW_BLAS_VARS if v in os.environ} != \
        _WANTED_BLAS:
    env = {k: v for k, v in os.environ.items() if k not in _SLOW_BLAS_VARS}
    env.update(_WANTED_BLAS)
    os.execve(sys.executable, [sys.executable] + sys.argv, env)

import torch  # noqa: E402  (after the environment is settled)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_core(build_dir):
    lib = ctypes.CDLL(os.path.join(build_dir, "lib", "libattnserve_bench_capi.so"))
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.attnserve_sdpa.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, i, i]
    lib.attnserve_mha_create.argtypes = [p, p, p, p, i64, i, i]
    lib.attnserve_mha_create.restype = p
    lib.attnserve_mha_run.argtypes = [p, p, p, i64, i64, i64, i]
    lib.attnserve_mha_free.argtypes = [p]
    lib.attnserve_layer_norm.argtypes = [p, p, p, p, i64, i64, ctypes.c_float]
    lib.attnserve_row_kernels.restype = ctypes.c_char_p
    if lib.attnserve_apply_cpu_isa() != 0:
        sys.exit(2)
    lib.attnserve_matmul.argtypes = [p, p, p, i64, i64, i64]
    return lib


def ptr(t):
    return ctypes.c_void_p(t.data_ptr())


def check(rc):
    if rc != 0:
        raise RuntimeError("attnserve call failed")


def time_pair(ours, theirs, budget_s):
    """Warms both up, then alternates single calls; returns median seconds."""
    for _ in range(2):
        ours()
        theirs()
    t0 = time.perf_counter()
    ours()
    theirs()
    per_pair = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(200, max(5, budget_s / per_pair)))
    a, b = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        ours()
        t1 = time.perf_counter()
        theirs()
        t2 = time.perf_counter()
        a.append(t1 - t0)
        b.append(t2 - t1)
    return statistics.median(a), statistics.median(b)


def sdpa_case(lib, b, h, lq, lk, d, causal=False, bf16=False):
    dtype = torch.bfloat16 if bf16 else torch.float32
    q, k, v = (torch.randn(b, h, n, d).to(dtype) for n in (lq, lk, lk))
    out = torch.empty(b, h, lq, d, dtype=dtype)
    scale = d ** -0.5
    mask = None
    if causal:
        mask = torch.full((lq, lk), float("-inf")).triu(1)

    def ours():
        check(lib.attnserve_sdpa(ptr(q), ptr(k), ptr(v), ptr(out), b, h, lq, lk,
                                 d, int(causal), int(bf16)))

    def theirs():
        s = torch.matmul(q, k.transpose(-2, -1)) * scale
        if mask is not None:
            s = s + mask
        return torch.matmul(torch.softmax(s, dim=-1), v)

    name = f"SDPA{' causal' if causal else ''}{' bf16' if bf16 else ''} " \
           f"B{b} H{h} Lq{lq} Lk{lk} d{d}"
    flops = 4.0 * b * h * lq * lk * d
    return name, ours, theirs, flops, lambda: (out.float() - theirs().float()).abs().max().item()


def mha_case(lib, b, l, e, heads, bf16=False):
    mha = torch.nn.MultiheadAttention(e, heads, batch_first=True).eval()
    x = torch.randn(b, l, e)
    xs = x.to(torch.bfloat16) if bf16 else x
    out = torch.empty(b, l, e, dtype=xs.dtype)
    w = [t.detach().contiguous() for t in (mha.in_proj_weight, mha.in_proj_bias,
                                            mha.out_proj.weight, mha.out_proj.bias)]
    # Both sides hold their weights across calls: the module its parameters,
    # attnserve a layer prepared once, as a served model is.
    layer = lib.attnserve_mha_create(*[ptr(t) for t in w], e, heads, int(bf16))
    if not layer:
        raise RuntimeError("attnserve_mha_create failed")

    def ours():
        check(lib.attnserve_mha_run(layer, ptr(xs), ptr(out), b, l, e, int(bf16)))

    def theirs():
        with torch.inference_mode():
            return mha(x, x, x, need_weights=False)[0]

    name = f"MHA{' bf16' if bf16 else ''} B{b} L{l} E{e} H{heads}"
    flops = 2.0 * b * l * e * e * 4 + 4.0 * b * l * l * e
    return name, ours, theirs, flops, lambda: (out.float() - theirs()).abs().max().item()


def layer_norm_case(lib, rows, cols):
    x, g, bias = torch.randn(rows, cols), torch.randn(cols), torch.randn(cols)
    out = torch.empty(rows, cols)

    def ours():
        check(lib.attnserve_layer_norm(ptr(x), ptr(g), ptr(bias), ptr(out), rows,
                                       cols, 1e-5))

    def theirs():
        return torch.nn.functional.layer_norm(x, (cols,), g, bias, 1e-5)

    return (f"LayerNorm [{rows}, {cols}]", ours, theirs, 0.0,
            lambda: (out - theirs()).abs().max().item())


def gemm_rate(lib, n=2048):
    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    check(lib.attnserve_matmul(ptr(a), ptr(b), ptr(c), n, n, n))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        check(lib.attnserve_matmul(ptr(a), ptr(b), ptr(c), n, n, n))
        times.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 / statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--budget", type=float, default=3.0,
                        help="seconds of timing per case")
    parser.add_argument("--quick", action="store_true",
                        help="small shapes only, one rep each (a smoke test)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if _CAPPED_BLAS:
        torch.backends.mkldnn.enabled = False
    lib = load_core(args.build)
    if args.quick:
        cases = [sdpa_case(lib, 1, 2, 64, 64, 32), mha_case(lib, 1, 16, 64, 4),
                 layer_norm_case(lib, 8, 64)]
        args.budget = 0.0
    else:
        cases = [
            sdpa_case(lib, 8, 8, 512, 512, 64),
            sdpa_case(lib, 1, 8, 4096, 4096, 64),
            sdpa_case(lib, 1, 8, 2048, 2048, 64),
            sdpa_case(lib, 1, 8, 2048, 2048, 64, causal=True),
            sdpa_case(lib, 1, 8, 1, 4096, 64),
            sdpa_case(lib, 8, 8, 512, 512, 64, bf16=True),
            mha_case(lib, 8, 512, 512, 8),
            mha_case(lib, 32, 128, 768, 12),
            mha_case(lib, 1, 16, 512, 8),
            mha_case(lib, 8, 512, 512, 8, bf16=True),
            layer_norm_case(lib, 32 * 128, 768),
        ]
    peak = gemm_rate(lib)
    print(f"threads {args.threads}; torch {torch.__version__}; "
          f"attnserve row kernels {lib.attnserve_row_kernels().decode()}, "
          f"2048^3 GEMM {peak / 1e9:.1f} GFLOP/s")
    header = f"{'case':<42} {'attnserve ms':>12} {'PyTorch ms':>11} " \
             f"{'speedup':>8} {'% GEMM':>7} {'max|diff|':>10}"
    print(header)
    print("-" * len(header))
    failed = False
    for name, ours, theirs, flops, diff in cases:
        a, b = time_pair(ours, theirs, args.budget)
        d = diff()
        failed |= not d < 0.1
        share = f"{100 * flops / a / peak:6.1f}%" if flops else "      -"
        print(f"{name:<42} {a * 1e3:12.3f} {b * 1e3:11.3f} {b / a:7.2f}x "
              f"{share} {d:10.2e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
