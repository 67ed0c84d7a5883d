#!/usr/bin/python3
"""Decode sessions through a rolling restart, on loopback.

Three attnserve replicas share one --session_dir behind nginx running
deploy/nginx/nginx.conf, whose session routes hash the client's
`x-session-key`. SEQUENCES clients each create a decode session through
nginx, prefill it and then step it one token at a time, every step with its
`position` (so that a step retried after an error is the same step). A
fourth replica, outside the cluster, steps a reference copy of every
session with the same inputs.

While the clients run, every replica in turn is drained (SIGTERM: it saves
its sessions to the directory) and started again on its port; nginx's hash
moves each key to another replica, which takes the session up from its
file. With --kill, one replica is then killed (SIGKILL) and started again:
the restarted replica takes each of its sessions up from the journal the
killed one left, holding its full blocks of 512 tokens, and answers the
next step ABORTED ("... giving position N"); the client resends its tokens
from N (one step with position N), then retries the refused step.

With --protocol=open_inference the clients are Open Inference sequences
instead (ModelInfer on attention_session with sequence_id, sequence_start
and, on every later step, sequence_position), which nginx sends to any
replica: each request that reaches a replica not holding its sequence has
the holder hand the session over.

Passes when every sequence is still open at the end, every step's output
is bitwise equal to the reference's, every error a client saw is
UNAVAILABLE or CANCELLED (retried) or, with --kill, ABORTED, and no
sequence needed more than one rewind.

    deploy/session-handover-test.py [--sequences 64] [--kill]
        [--protocol=native|open_inference]

Needs the build (build/bin/attnserve), nginx-light and python3-grpcio,
python3-numpy (the script installs them with apt-get when missing), and
for the Open Inference stubs protoc and grpc_python_plugin.
"""
import argparse
import collections
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

RETRIED = {"UNAVAILABLE", "CANCELLED"}
HEADS, KV_HEADS, DIM = 4, 2, 32


def log(message):
    print(f"session-handover: {message}", flush=True)


def install():
    try:
        import grpc  # noqa: F401
        import numpy  # noqa: F401
        if shutil.which("nginx") or os.path.exists("/usr/sbin/nginx"):
            return
    except ImportError:
        pass
    log("installing nginx-light, python3-grpcio, python3-numpy (apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq",
                    "--no-install-recommends", "nginx-light",
                    "python3-grpcio", "python3-protobuf", "python3-numpy"],
                   check=True, env=env, stdout=subprocess.DEVNULL)


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class Replica:
    """One attnserve process on a fixed port."""

    def __init__(self, binary, port, tmp, name, session_dir=None):
        self.binary, self.port, self.name = binary, port, name
        self.out = open(os.path.join(tmp, f"{name}.log"), "ab")
        self.args = [binary, "--host=127.0.0.1", f"--port={port}",
                     "--metrics_port=-1", "--http_port=-1", "--threads=1",
                     "--drain_seconds=10", "--lame_duck_seconds=1",
                     "--coalesce_steps_us=0"]
        if session_dir:
            self.args.append(f"--session_dir={session_dir}")
        self.process = None

    def start(self):
        self.process = subprocess.Popen(self.args, stdout=self.out,
                                        stderr=self.out)
        wait_serving(f"127.0.0.1:{self.port}", self.name)

    def stop(self, sig):
        self.process.send_signal(sig)
        code = self.process.wait(timeout=60)
        if sig == signal.SIGTERM and code != 0:
            raise RuntimeError(f"{self.name} exited {code} on SIGTERM")


def wait_serving(target, name):
    import grpc
    from attnserve_client import connect, pb
    deadline = time.time() + 30
    while time.time() < deadline:
        stub = connect(target, keep_buffers=False)
        try:
            stub.ListModels(pb.ListModelsRequest(), timeout=1)
            return
        except grpc.RpcError:
            time.sleep(0.1)
        finally:
            stub.channel.close()
    raise RuntimeError(f"{name} did not start on {target}")


def start_nginx(ports, listen, tmp):
    conf = open(os.path.join(ROOT, "deploy", "nginx", "nginx.conf")).read()
    for i, port in enumerate(ports, 1):
        line = f"server attnserve-{i}:50051"
        if line not in conf:
            raise RuntimeError(f"nginx.conf has no '{line}' line")
        conf = conf.replace(line, f"server 127.0.0.1:{port}")
    conf = conf.replace("listen 8080 ", f"listen 127.0.0.1:{listen} ")
    prefix = os.path.join(tmp, "nginx")
    os.makedirs(os.path.join(prefix, "attnserve.d"))
    os.makedirs(os.path.join(prefix, "temp"))
    with open(os.path.join(prefix, "nginx.conf"), "w") as f:
        f.write(conf)
    with open(os.path.join(prefix, "attnserve.d", "local.conf"), "w") as f:
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            f.write(f"{kind}_temp_path {prefix}/temp/{kind};\n")
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    process = subprocess.Popen(
        [nginx, "-p", prefix + "/", "-c", os.path.join(prefix, "nginx.conf"),
         "-e", os.path.join(prefix, "error.log"), "-g",
         f"daemon off; pid {prefix}/nginx.pid; "
         f"error_log {prefix}/error.log warn;"],
        stdout=open(os.path.join(prefix, "access.log"), "wb"),
        stderr=subprocess.STDOUT)
    wait_serving(f"127.0.0.1:{listen}", "nginx")
    return process


class Sequence(threading.Thread):
    """One client: a session through nginx and its reference copy."""

    def __init__(self, index, cluster, reference, stop, prefill):
        super().__init__(daemon=True)
        self.index, self.cluster, self.reference = index, cluster, reference
        self.stop_event, self.prefill = stop, prefill
        self.key = (("x-session-key", f"sequence-{index}"),)
        self.errors = collections.Counter()
        self.first_error = {}
        self.steps = 0
        self.mismatches = 0
        self.rewinds = 0
        self.resent_tokens = 0
        self.lost = None  # the status that lost the session, if any

    def call(self, method, request):
        """`method` on the cluster, retrying UNAVAILABLE and CANCELLED."""
        import grpc
        backoff = 0.05
        while True:
            try:
                return method(request, metadata=self.key, timeout=30)
            except grpc.RpcError as error:
                code = error.code().name
                self.errors[code] += 1
                self.first_error.setdefault(code, error.details())
                if code not in RETRIED:
                    raise
                time.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    @staticmethod
    def step_request(session_id, position, q, k, v):
        from attnserve_client import pb, to_tensor
        return pb.SessionStepRequest(
            session_id=session_id, position=position, query=to_tensor(q),
            key=to_tensor(k), value=to_tensor(v))

    def resend(self, session, error, history, length):
        """Resends the tokens from the position an ABORTED step names."""
        import numpy as np
        match = re.search(r"giving position (\d+)", error.details() or "")
        if not match or int(match.group(1)) > length:
            raise error
        held = int(match.group(1))
        self.rewinds += 1
        if held == length:
            return
        q, k, v = (np.concatenate([step[i] for step in history], axis=1)
                   [:, held:length] for i in range(3))
        self.resent_tokens += length - held
        self.send(session, held, q, k, v)

    def send(self, session, position, q, k, v):
        """One step at `position` on the cluster (retried)."""
        return self.call(self.cluster.SessionStep,
                         self.step_request(session, position, q, k, v))

    def run(self):
        import grpc
        import numpy as np
        from attnserve_client import pb
        rng = np.random.default_rng(self.index)
        create = pb.CreateSessionRequest(
            num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
            rotary_dims=DIM, max_length=8192)
        session = self.call(self.cluster.CreateSession, create).session_id
        ref_session = self.reference.CreateSession(create).session_id
        length, n = 0, self.prefill
        history = []  # every step's (q, k, v), to resend after a rewind
        while not self.stop_event.is_set() and length + n <= 8192:
            q = rng.standard_normal((HEADS, n, DIM), dtype="float32")
            k = rng.standard_normal((KV_HEADS, n, DIM), dtype="float32")
            v = rng.standard_normal((KV_HEADS, n, DIM), dtype="float32")
            request = self.step_request(session, length, q, k, v)
            want = self.reference.SessionStep(
                self._with(request, ref_session))
            try:
                try:
                    got = self.call(self.cluster.SessionStep, request)
                except grpc.RpcError as error:
                    if error.code() != grpc.StatusCode.ABORTED:
                        raise
                    self.resend(session, error, history, length)
                    got = self.call(self.cluster.SessionStep, request)
            except grpc.RpcError as error:
                self.lost = f"{error.code().name}: {error.details()}"
                return
            if (got.length != want.length or
                    got.output.SerializeToString() !=
                    want.output.SerializeToString()):
                self.mismatches += 1
            history.append((q, k, v))
            length, n = want.length, 1
            self.steps += 1

    @staticmethod
    def _with(request, session_id):
        from attnserve_client import pb
        copy = pb.SessionStepRequest()
        copy.CopyFrom(request)
        copy.session_id = session_id
        return copy


def inference_stubs(workdir):
    """The Open Inference protocol's Python modules, generated from proto/."""
    subprocess.run(
        ["protoc", f"--proto_path={ROOT}/proto", f"--python_out={workdir}",
         f"--grpc_out={workdir}",
         "--plugin=protoc-gen-grpc=" + shutil.which("grpc_python_plugin"),
         "inference/grpc_service.proto"], check=True)
    sys.path.insert(0, workdir)
    from inference import grpc_service_pb2, grpc_service_pb2_grpc
    return grpc_service_pb2, grpc_service_pb2_grpc


class InferenceSequence(Sequence):
    """One Open Inference sequence through nginx, and its reference."""

    def __init__(self, index, cluster, reference, stop, prefill, oi):
        super().__init__(index, cluster, reference, stop, prefill)
        self.oi = oi
        self.sequence_id = index + 1

    def request(self, position, q, k, v, start=False):
        r = self.oi.ModelInferRequest(model_name="attention_session")
        r.parameters["sequence_id"].int64_param = self.sequence_id
        if start:
            r.parameters["sequence_start"].bool_param = True
            r.parameters["max_length"].int64_param = 8192
        else:
            # The step's position: a step retried after an error is the
            # same step.
            r.parameters["sequence_position"].int64_param = position
        for name, x in (("query", q), ("key", k), ("value", v)):
            tensor = r.inputs.add(name=name, datatype="FP32")
            tensor.shape.extend(x.shape)
            r.raw_input_contents.append(x.tobytes())
        return r

    def send(self, session, position, q, k, v):
        return self.call(self.cluster.ModelInfer,
                         self.request(position, q, k, v))

    def run(self):
        import grpc
        import numpy as np
        rng = np.random.default_rng(self.index)
        length, n = 0, self.prefill
        history = []
        while not self.stop_event.is_set() and length + n <= 8192:
            q = rng.standard_normal((HEADS, n, DIM), dtype="float32")
            k = rng.standard_normal((KV_HEADS, n, DIM), dtype="float32")
            v = rng.standard_normal((KV_HEADS, n, DIM), dtype="float32")
            request = self.request(length, q, k, v, start=length == 0)
            want = self.reference.ModelInfer(request)
            try:
                try:
                    got = self.call(self.cluster.ModelInfer, request)
                except grpc.RpcError as error:
                    if error.code() != grpc.StatusCode.ABORTED:
                        raise
                    self.resend(None, error, history, length)
                    got = self.call(self.cluster.ModelInfer, request)
            except grpc.RpcError as error:
                self.lost = f"{error.code().name}: {error.details()}"
                return
            if (got.raw_output_contents != want.raw_output_contents or
                    got.parameters["sequence_length"].int64_param !=
                    want.parameters["sequence_length"].int64_param):
                self.mismatches += 1
            history.append((q, k, v))
            length = want.parameters["sequence_length"].int64_param
            n = 1
            self.steps += 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--attnserve",
                        default=os.path.join(ROOT, "build", "bin", "attnserve"))
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=600)
    parser.add_argument("--settle_s", type=float, default=3.0,
                        help="seconds of stepping before and between stops")
    parser.add_argument("--kill", action="store_true",
                        help="also SIGKILL one replica after the restarts")
    parser.add_argument("--protocol", choices=("native", "open_inference"),
                        default="native",
                        help="decode sessions, or Open Inference sequences")
    args = parser.parse_args()
    install()
    import grpc
    from attnserve_client import connect

    tmp = tempfile.mkdtemp(prefix="attnserve-handover-")
    session_dir = os.path.join(tmp, "sessions")
    ports = free_ports(5)
    replicas = [Replica(args.attnserve, ports[i], tmp, f"replica{i + 1}",
                        session_dir) for i in range(3)]
    reference = Replica(args.attnserve, ports[3], tmp, "reference")
    nginx = None
    try:
        for replica in replicas + [reference]:
            replica.start()
        nginx = start_nginx(ports[:3], ports[4], tmp)
        log(f"3 replicas sharing {session_dir}, nginx on :{ports[4]}, "
            f"{args.sequences} sequences")
        stop = threading.Event()
        if args.protocol == "native":
            cluster = connect(f"127.0.0.1:{ports[4]}", keep_buffers=False)
            ref = connect(f"127.0.0.1:{ports[3]}", keep_buffers=False)
            sequences = [Sequence(i, cluster, ref, stop, args.prefill)
                         for i in range(args.sequences)]
        else:
            oi, oi_grpc = inference_stubs(tmp)
            cluster, ref = (
                oi_grpc.GRPCInferenceServiceStub(
                    grpc.insecure_channel(f"127.0.0.1:{port}"))
                for port in (ports[4], ports[3]))
            sequences = [InferenceSequence(i, cluster, ref, stop,
                                           args.prefill, oi)
                         for i in range(args.sequences)]
        for sequence in sequences:
            sequence.start()
        time.sleep(args.settle_s)
        for replica in replicas:
            started = time.time()
            replica.stop(signal.SIGTERM)
            drained = time.time() - started
            replica.start()
            log(f"{replica.name}: drained in {drained:.1f} s, restarted")
            time.sleep(args.settle_s)
        restarted = sum(s.steps for s in sequences)
        lost_in_restarts = [s for s in sequences if s.lost]
        if args.kill:
            replicas[0].stop(signal.SIGKILL)
            replicas[0].start()
            log(f"{replicas[0].name}: killed and restarted")
            time.sleep(args.settle_s)
        stop.set()
        for sequence in sequences:
            sequence.join(timeout=60)
        errors = collections.Counter()
        first = {}
        for sequence in sequences:
            errors.update(sequence.errors)
            for code, message in sequence.first_error.items():
                first.setdefault(code, message)
        steps = sum(s.steps for s in sequences)
        mismatches = sum(s.mismatches for s in sequences)
        lost = [s for s in sequences if s.lost]
        rewound = [s for s in sequences if s.rewinds]
        log(f"{steps} steps ({restarted} through the rolling restart), "
            f"{mismatches} not bitwise equal to the reference; sequences "
            f"lost in the restarts: {len(lost_in_restarts)}, in all: "
            f"{len(lost)}; {len(rewound)} sequences rewound (at most "
            f"{max([s.rewinds for s in sequences] + [0])} times each), "
            f"resending {sum(s.resent_tokens for s in sequences)} tokens")
        for code, count in sorted(errors.items()):
            log(f"  {count} x {code}, first: {first[code]}")
        for sequence in lost[:5]:
            log(f"  sequence {sequence.index} lost: {sequence.lost}")
        unexpected = set(errors) - RETRIED
        if args.kill:
            unexpected -= {"ABORTED"}  # the killed replica's sessions
        ok = (mismatches == 0 and not lost and not unexpected and steps > 0
              and all(s.rewinds <= 1 for s in sequences))
        log("PASS" if ok else "FAIL")
        return 0 if ok else 1
    finally:
        for replica in replicas + [reference]:
            if replica.process and replica.process.poll() is None:
                replica.process.kill()
                replica.process.wait()
        if nginx:
            nginx.kill()
            nginx.wait()
        if os.environ.get("KEEP_TMP") == "1":
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
