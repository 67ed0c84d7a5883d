"""Shared memory for clients on the server's host.

A SharedMemoryRegion is a POSIX shared-memory object this process creates
and registers with the server under a name. Tensors copied into it travel as
(region, offset, byte_size) references instead of bytes in the message, and
results the request places in it are read back as numpy views, so that
tensor bytes never cross the socket nor count against the message size.
"""
import itertools
import os
import secrets
from multiprocessing import shared_memory

import grpc
import numpy as np

from attnserve.v1 import attention_pb2 as pb
from attnserve_client import tensors

# Where each tensor and result starts: the server needs offsets that are
# multiples of the element size; 64 bytes also keeps them cache-line aligned.
ALIGNMENT = 64

_counter = itertools.count()


def _unique_key():
    """A new object name for this process, "attnserve-py-<pid>-<n>-<hex>"."""
    return (f"attnserve-py-{os.getpid()}-{next(_counter)}-"
            f"{secrets.token_hex(4)}")


class _Mapping(shared_memory.SharedMemory):
    """SharedMemory whose close() tolerates views still in use.

    Views keep the buffer exported: SharedMemory.close() then raises
    BufferError, and so would its finalizer. Here the mapping instead stays
    until the last view is gone, when Python unmaps it: a view never points
    at unmapped memory.
    """

    def close(self):
        try:
            super().close()
        except BufferError:
            pass


class SharedMemoryRegion:
    """A shared-memory object of `byte_size` bytes registered as `name`.

    `stub` is an AttentionServiceStub (see connect()) of a server on this
    host; `metadata` goes with the register and unregister calls (e.g. an
    ("authorization", "Bearer TOKEN") pair when the channel does not add
    it). Tensors and result room are placed one after another, each
    ALIGNMENT-aligned; reset() starts over for the next request. A region
    serves one request at a time and is not thread-safe.

    Use it as a context manager, or call close(): the server keeps a
    registered region mapped until it is unregistered.
    """

    def __init__(self, stub, name, byte_size, metadata=None):
        if not name:
            # An empty name would make close() unregister every region.
            raise ValueError("a shared memory region needs a name")
        if byte_size <= 0:
            raise ValueError(f"byte_size must be > 0, not {byte_size}")
        self._stub = stub
        self._metadata = metadata
        self._name = name
        self._used = 0
        self._shm = _Mapping(name=_unique_key(), create=True, size=byte_size)
        self._key = "/" + self._shm.name  # shm_open's name: /dev/shm/NAME
        try:
            stub.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(
                region=pb.SharedMemoryRegion(name=name, key=self._key,
                                             byte_size=byte_size)),
                metadata=metadata)
        except BaseException:
            self._release()
            raise

    @property
    def name(self):
        """The name requests use for this region."""
        return self._name

    @property
    def key(self):
        """The object's shm_open name, "/NAME" (the file /dev/shm/NAME)."""
        return self._key

    @property
    def byte_size(self):
        return self._shm_or_raise().size

    @property
    def used(self):
        """Bytes placed or reserved since creation or the last reset()."""
        return self._used

    @property
    def closed(self):
        return self._shm is None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else \
            f"{self._used}/{self._shm.size} bytes used"
        return f"SharedMemoryRegion({self._name!r}, {self._key!r}, {state})"

    def close(self):
        """Unregisters the region, then removes its object; idempotent.

        The unregister call's errors are ignored: a server that is gone or
        restarted holds no mapping to release. numpy views from to_numpy()
        keep their memory mapped (not registered) until they are dropped.
        """
        if self._shm is None:
            return
        try:
            self._stub.UnregisterSharedMemory(
                pb.UnregisterSharedMemoryRequest(name=self._name),
                metadata=self._metadata, timeout=10)
        except grpc.RpcError:
            pass
        finally:
            self._release()

    def reset(self):
        """Frees the whole region for the next request.

        Views of earlier results stay valid but show whatever the next
        request writes over them.
        """
        self._shm_or_raise()
        self._used = 0

    def _release(self):
        """Closes the mapping and unlinks the object, exactly once."""
        shm, self._shm = self._shm, None
        try:
            shm.unlink()  # also forgets it in multiprocessing's tracker
        finally:
            shm.close()

    def _shm_or_raise(self):
        if self._shm is None:
            raise ValueError(f"shared memory region {self._name!r} is closed")
        return self._shm

    def _reserve(self, byte_size):
        """Offset of `byte_size` free bytes, ALIGNMENT-aligned."""
        shm = self._shm_or_raise()
        offset = -(-self._used // ALIGNMENT) * ALIGNMENT
        if offset + byte_size > shm.size:
            raise ValueError(
                f"shared memory region {self._name!r}: {byte_size} bytes "
                f"needed at offset {offset}, {shm.size} in all; reset() it "
                "or use a larger region")
        self._used = offset + byte_size
        return offset

    def tensor(self, value):
        """A wire Tensor whose values are copied into the region.

        Takes what to_tensor() takes (numpy arrays, torch tensors, lists;
        float32, float16, bool, uint8, torch.bfloat16; float64 is sent as
        float32); strided or big-endian values are converted in the copy.
        """
        dtype, array = tensors._wire_array(value)
        wire = tensors._WIRE_TO_NUMPY[dtype]
        byte_size = array.size * wire.itemsize
        offset = self._reserve(byte_size)
        destination = np.ndarray(array.shape, wire, buffer=self._shm.buf,
                                 offset=offset)
        destination[...] = array
        del destination  # no lasting export of the buffer
        return pb.Tensor(dtype=dtype, shape=array.shape,
                         shared_memory=pb.SharedMemoryRef(
                             region=self._name, offset=offset,
                             byte_size=byte_size))

    def result(self, byte_size):
        """A SharedMemoryRef to `byte_size` free bytes for a result.

        The room must hold the result: elements x 4 bytes covers every
        result dtype.
        """
        offset = self._reserve(byte_size)
        return pb.SharedMemoryRef(region=self._name, offset=offset,
                                  byte_size=byte_size)

    def result_regions(self, output_bytes, weights_bytes=0):
        """ResultRegions for a request: room for the output, and for the
        weights when `weights_bytes` > 0."""
        regions = pb.ResultRegions(output=self.result(output_bytes))
        if weights_bytes > 0:
            regions.weights.CopyFrom(self.result(weights_bytes))
        return regions

    def _view(self, tensor):
        """numpy view of the wire layout of a tensor in this region."""
        ref = tensor.shared_memory
        if ref.region != self._name:
            raise ValueError(f"tensor is in shared memory region "
                             f"{ref.region!r}, not {self._name!r}")
        if tensor.dtype not in tensors._WIRE_TO_NUMPY:
            raise ValueError(f"unknown wire dtype {tensor.dtype}")
        dtype = tensors._WIRE_TO_NUMPY[tensor.dtype]
        shape = tuple(tensor.shape)
        byte_size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        shm = self._shm_or_raise()
        if ref.byte_size != byte_size or ref.offset + byte_size > shm.size:
            raise ValueError(
                f"shared memory reference (offset {ref.offset}, byte_size "
                f"{ref.byte_size}) does not fit {shape} of {dtype} in region "
                f"{self._name!r} of {shm.size} bytes")
        # frombuffer, unlike ndarray(buffer=...), keeps the buffer exported
        # while the array lives: the mapping then cannot be closed under it
        # (see _Mapping).
        return np.frombuffer(shm.buf, dtype, count=byte_size // dtype.itemsize,
                             offset=ref.offset).reshape(shape)

    def to_numpy(self, tensor):
        """numpy array of a response tensor; a view when it is in shared
        memory.

        The view reads the region's memory as it is: it is valid while the
        region is open, and the next request that writes there (after
        reset()) changes it; call .copy() to keep the values. BFLOAT16 is
        widened to float32 (a copy; to_torch() keeps it). Tensors carried in
        raw_data or float_data go to the package's to_numpy().
        """
        if not tensor.HasField("shared_memory"):
            return tensors.to_numpy(tensor)
        array = self._view(tensor)
        if tensor.dtype == pb.DATA_TYPE_BFLOAT16:
            return (array.astype(np.uint32) << 16).view(np.float32)
        return array

    def to_torch(self, tensor):
        """torch tensor of a response tensor; a view when it is in shared
        memory (BFLOAT16 too), with to_numpy()'s lifetime."""
        if tensors.torch is None:
            raise ImportError("to_torch needs PyTorch")
        if not tensor.HasField("shared_memory"):
            return tensors.to_torch(tensor)
        array = self._view(tensor)
        if tensor.dtype == pb.DATA_TYPE_BFLOAT16:
            bits = tensors.torch.from_numpy(array.view(np.int16))
            return bits.view(tensors.torch.bfloat16)
        return tensors.torch.from_numpy(array)
