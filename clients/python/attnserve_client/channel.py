"""Opening a channel to an attnserve server."""
import grpc

from attnserve.v1 import attention_pb2_grpc as pb_grpc

# grpcio caps received messages at 4 MiB by default; attention outputs and
# weights are often larger, and the server enforces its own limit.
_UNLIMITED = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
]


def connect(target, credentials=None, options=()):
    """Returns an AttentionServiceStub for `target` ("host:port").

    With `credentials` (grpc.ssl_channel_credentials(...), possibly composed
    with call credentials) the channel is secure, else plaintext. The
    channel is `stub.channel`; close it when done.
    """
    options = _UNLIMITED + list(options)
    if credentials is None:
        channel = grpc.insecure_channel(target, options=options)
    else:
        channel = grpc.secure_channel(target, credentials, options=options)
    stub = pb_grpc.AttentionServiceStub(channel)
    stub.channel = channel
    return stub
