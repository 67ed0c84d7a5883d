#!/usr/bin/python3
"""The Open Inference Protocol's cost next to the native API, one run.

Starts attnserve (build/bin/attnserve, the demo model) and times the same
calls, one in flight, through:
  native     attnserve.v1.AttentionService over gRPC (raw_data tensors)
  v2 grpc    inference.GRPCInferenceService/ModelInfer, raw_input_contents
  v2 binary  POST /v2/models/{model}/infer, Triton's binary tensor extension
  v2 json    POST /v2/models/{model}/infer, tensors as JSON numbers
and prints each path's median milliseconds and its ratio to native. The
client is Python (grpcio, http.client), as a user's script would be; its
own time is in every figure alike.

    benchmarks/open_inference.py [--build build] [--seconds 2]
"""

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
from attnserve.v1 import attention_pb2 as v1  # noqa: E402
from attnserve.v1 import attention_pb2_grpc as v1_grpc  # noqa: E402


def protocol_stubs(workdir):
    """Generates the protocol's Python stubs from proto/ into workdir."""
    plugin = subprocess.check_output(["sh", "-c", "command -v grpc_python_plugin"],
                                     text=True).strip()
    subprocess.check_call(
        ["protoc", f"--proto_path={ROOT}/proto", f"--python_out={workdir}",
         f"--grpc_out={workdir}", f"--plugin=protoc-gen-grpc={plugin}",
         "inference/grpc_service.proto"])
    sys.path.insert(0, workdir)
    from inference import grpc_service_pb2, grpc_service_pb2_grpc
    return grpc_service_pb2, grpc_service_pb2_grpc


def start_server(build):
    proc = subprocess.Popen(
        [os.path.join(build, "bin", "attnserve"), "--host=127.0.0.1",
         "--port=0", "--metrics_port=-1", "--http_port=0",
         "--log_level=warning",
         f"--model_repository={os.path.join(build, 'models')}"],
        stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    match = re.search(r"listening on 127\.0\.0\.1:(\d+) .*http port (\d+)", line)
    if not match:
        proc.kill()
        sys.exit(f"attnserve did not start: {line!r}")
    return proc, int(match.group(1)), int(match.group(2))


def median_ms(call, seconds):
    call()  # warm up: primitives, connections, pools
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 5:
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), len(times)


def wire(array):
    return v1.Tensor(dtype=v1.DATA_TYPE_FLOAT32, shape=array.shape,
                     raw_data=array.tobytes())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="measured seconds per path and case")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="attnserve_oip_bench_")
    pb, pb_grpc = protocol_stubs(workdir)
    proc, port, http_port = start_server(args.build)
    try:
        options = [("grpc.max_receive_message_length", -1),
                   ("grpc.max_send_message_length", -1)]
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
        native = v1_grpc.AttentionServiceStub(channel)
        protocol = pb_grpc.GRPCInferenceServiceStub(channel)
        connection = http.client.HTTPConnection("127.0.0.1", http_port)
        rng = np.random.default_rng(0)

        def tensor(*shape):
            return rng.standard_normal(shape, dtype=np.float32)

        ln = tensor(1, 64)
        small = {n: tensor(1, 8, 128, 64) for n in ("query", "key", "value")}
        large = {n: tensor(8, 8, 512, 64) for n in ("query", "key", "value")}
        hidden = tensor(1, 128, 512)
        # Memory-bound calls whose time is mostly moving their bytes: the
        # transport's cost shows most here.
        ln8 = tensor(2048, 1024)
        ln32 = tensor(8192, 1024)
        cases = [
            ("LayerNorm [1, 64]", "layer_norm", {"input": ln},
             lambda: native.LayerNorm(v1.LayerNormRequest(input=wire(ln)))),
            ("LayerNorm 8 MB", "layer_norm", {"input": ln8},
             lambda: native.LayerNorm(v1.LayerNormRequest(input=wire(ln8)))),
            ("LayerNorm 32 MB", "layer_norm", {"input": ln32},
             lambda: native.LayerNorm(v1.LayerNormRequest(input=wire(ln32)))),
            ("Attend B1 H8 L128 d64", "attend", small,
             lambda: native.Attend(v1.AttendRequest(
                 **{n: wire(a) for n, a in small.items()}))),
            ("Attend B8 H8 L512 (3x8MB)", "attend", large,
             lambda: native.Attend(v1.AttendRequest(
                 **{n: wire(a) for n, a in large.items()}))),
            ("MHA demo B1 L128 E512", "demo",
             {n: hidden for n in ("query", "key", "value")},
             lambda: native.MultiHeadAttend(v1.MultiHeadAttendRequest(
                 model="demo", query=wire(hidden), key=wire(hidden),
                 value=wire(hidden)))),
        ]
        print(f"{'case':24} {'path':10} {'ms':>9} {'x native':>9} {'calls':>6}")
        for name, model, inputs, native_call in cases:

            def grpc_call(model=model, inputs=inputs):
                request = pb.ModelInferRequest(model_name=model)
                for n, a in inputs.items():
                    request.inputs.add(name=n, datatype="FP32", shape=a.shape)
                    request.raw_input_contents.append(a.tobytes())
                response = protocol.ModelInfer(request)
                return np.frombuffer(response.raw_output_contents[0], np.float32)

            def http_call(binary, model=model, inputs=inputs):
                body = {"inputs": [], "outputs": [
                    {"name": "output", "parameters": {"binary_data": binary}}]}
                blobs = []
                for n, a in inputs.items():
                    item = {"name": n, "datatype": "FP32", "shape": a.shape}
                    if binary:
                        item["parameters"] = {"binary_data_size": a.nbytes}
                        blobs.append(a.tobytes())
                    else:
                        item["data"] = a.ravel().tolist()
                    body["inputs"].append(item)
                header = json.dumps(body).encode()
                headers = {"Content-Type": "application/json"}
                if binary:
                    headers["Inference-Header-Content-Length"] = str(len(header))
                try:
                    connection.request("POST", f"/v2/models/{model}/infer",
                                       header + b"".join(blobs), headers)
                except (BrokenPipeError, ConnectionResetError):
                    # The server closes connections idle for 5 s.
                    connection.close()
                    connection.request("POST", f"/v2/models/{model}/infer",
                                       header + b"".join(blobs), headers)
                reply = connection.getresponse()
                data = reply.read()
                if reply.status != 200:
                    raise RuntimeError(data[:200])
                if binary:
                    length = int(reply.getheader("Inference-Header-Content-Length"))
                    return np.frombuffer(data[length:], np.float32)
                return np.asarray(json.loads(data)["outputs"][0]["data"],
                                  np.float32)

            expected = np.frombuffer(native_call().output.raw_data, np.float32)
            paths = [("v2 grpc", grpc_call),
                     ("v2 binary", lambda: http_call(True))]
            # JSON numbers for millions of values take Python seconds to
            # write and parse: nobody sends those as JSON.
            if sum(a.size for a in inputs.values()) <= 1 << 20:
                paths.append(("v2 json", lambda: http_call(False)))
            for path, call in paths:
                got = call()
                if not np.array_equal(got, expected):
                    sys.exit(f"{name} {path}: result differs from native")
            base, count = median_ms(native_call, args.seconds)
            print(f"{name:24} {'native':10} {base:9.3f} {1:9.2f} {count:6}")
            for path, call in paths:
                ms, count = median_ms(call, args.seconds)
                print(f"{name:24} {path:10} {ms:9.3f} {ms / base:9.2f} {count:6}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
