"""Opening a channel to an attnserve server."""
import grpc

from attnserve.v1 import attention_pb2_grpc as pb_grpc
from attnserve_client.memory import keep_large_buffers

# grpcio caps received messages at 4 MiB by default; attention outputs and
# weights are often larger. Unlimited here: the server enforces its own limit
# (--max_message_mb, 256 MiB by default) and says so in its error. Only the
# message sizes are set: on loopback, none of gRPC's HTTP/2 and transport
# settings (frame size, flow-control windows, write buffer, read chunk size)
# changed the latency of large messages. Tensors above the limit, or copied
# once too often, go through shared memory (SharedMemoryRegion).
MESSAGE_SIZE_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
]


def connect(target, credentials=None, options=(), keep_buffers=True):
    """Returns an AttentionServiceStub for `target` ("host:port").

    With `credentials` (grpc.ssl_channel_credentials(...), possibly composed
    with call credentials) the channel is secure, else plaintext. `options`
    are more channel arguments; one naming a MESSAGE_SIZE_OPTIONS key
    replaces that default. The channel is `stub.channel`; close it when
    done. With `keep_buffers` the process keeps large freed buffers for
    reuse (keep_large_buffers()), which makes large calls several times
    faster; pass False to leave the process's allocator as it is.
    """
    if keep_buffers:
        keep_large_buffers()
    options = list(options)
    given = {key for key, _ in options}
    options = [option for option in MESSAGE_SIZE_OPTIONS
               if option[0] not in given] + options
    if credentials is None:
        channel = grpc.insecure_channel(target, options=options)
    else:
        channel = grpc.secure_channel(target, credentials, options=options)
    stub = pb_grpc.AttentionServiceStub(channel)
    stub.channel = channel
    return stub
