"""The Open Inference Protocol over gRPC (inference.GRPCInferenceService)."""
import grpc
import numpy as np

from inference import grpc_service_pb2 as pb
from inference import grpc_service_pb2_grpc as pb_grpc
from open_inference.tensors import (WIRE_DTYPES, InferenceServerError,
                                    InferResult, SharedMemoryInput,
                                    from_raw, input_array)

# Typed contents fields by datatype; FP16 and BF16 have none.
_CONTENTS_FIELDS = {
    "FP32": "fp32_contents",
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
}


def set_parameter(parameter, value):
    """Fills an InferParameter from a Python or numpy scalar."""
    if isinstance(value, (bool, np.bool_)):
        parameter.bool_param = bool(value)
    elif isinstance(value, (int, np.integer)):
        parameter.int64_param = int(value)
    elif isinstance(value, (float, np.floating)):
        parameter.double_param = float(value)
    elif isinstance(value, str):
        parameter.string_param = value
    else:
        raise TypeError(f"parameter value {value!r}: not a bool, int, "
                        "float or str")


def parameter_value(parameter):
    """The Python value of an InferParameter (None when unset)."""
    kind = parameter.WhichOneof("parameter_choice")
    return None if kind is None else getattr(parameter, kind)


def _output_request(output):
    """(name, parameters) of a requested output: a name or such a pair."""
    if isinstance(output, str):
        return output, {}
    name, parameters = output
    return name, parameters


def build_infer_request(model, inputs, parameters=None, outputs=None,
                        use_raw=True, request_id="", version=""):
    """The ModelInferRequest of GrpcClient.infer's arguments."""
    request = pb.ModelInferRequest(model_name=model, model_version=version,
                                   id=request_id or "")
    for key, value in (parameters or {}).items():
        set_parameter(request.parameters[key], value)
    for name, value in inputs.items():
        if isinstance(value, SharedMemoryInput):
            tensor = request.inputs.add(name=name, datatype=value.datatype,
                                        shape=value.shape)
            for key, parameter in value.parameters.items():
                set_parameter(tensor.parameters[key], parameter)
            continue
        datatype, array = input_array(value)
        tensor = request.inputs.add(name=name, datatype=datatype,
                                    shape=array.shape)
        if use_raw:
            request.raw_input_contents.append(array.tobytes())
        elif datatype in _CONTENTS_FIELDS:
            getattr(tensor.contents, _CONTENTS_FIELDS[datatype]).extend(
                array.ravel().tolist())
        else:
            raise ValueError(f"{name}: {datatype} travels only as raw "
                             "contents (use_raw=True)")
    for output in outputs or ():
        name, output_parameters = _output_request(output)
        requested = request.outputs.add(name=name)
        for key, value in output_parameters.items():
            set_parameter(requested.parameters[key], value)
    return request


def decode_infer_response(response, shared_memory_outputs=()):
    """InferResult of a ModelInferResponse, raw or typed contents.

    Outputs named in `shared_memory_outputs` (or whose parameters place
    them in shared memory) have no contents and map to None; the raw
    contents belong to the other outputs, in order (an empty entry for
    each output in shared memory is accepted too).
    """
    in_memory = {t.name for t in response.outputs
                 if t.name in shared_memory_outputs
                 or "shared_memory_region" in t.parameters}
    raw = list(response.raw_output_contents)
    if len(raw) == len(response.outputs) and in_memory:
        for i, tensor in enumerate(response.outputs):
            if tensor.name in in_memory and raw[i]:
                raise ValueError(f"{tensor.name}: in shared memory and in "
                                 "raw_output_contents")
        raw = [data for tensor, data in zip(response.outputs, raw)
               if tensor.name not in in_memory]
    by_value = [t for t in response.outputs if t.name not in in_memory]
    if raw and len(raw) != len(by_value):
        raise ValueError(f"{len(raw)} raw_output_contents for "
                         f"{len(by_value)} outputs")
    raw = dict(zip((t.name for t in by_value), raw))
    outputs, datatypes, shapes = {}, {}, {}
    for tensor in response.outputs:
        datatypes[tensor.name] = tensor.datatype
        shapes[tensor.name] = list(tensor.shape)
        if tensor.name in in_memory:
            outputs[tensor.name] = None
        elif raw:
            outputs[tensor.name] = from_raw(tensor.datatype, tensor.shape,
                                            raw[tensor.name])
        elif tensor.datatype in _CONTENTS_FIELDS:
            values = getattr(tensor.contents,
                             _CONTENTS_FIELDS[tensor.datatype])
            array = np.array(values, dtype=WIRE_DTYPES[tensor.datatype])
            outputs[tensor.name] = array.reshape(tuple(tensor.shape))
        else:
            raise ValueError(f"{tensor.name}: no contents for "
                             f"{tensor.datatype}")
    parameters = {k: parameter_value(v)
                  for k, v in response.parameters.items()}
    return InferResult(outputs, response.model_name, response.model_version,
                       response.id, datatypes, shapes, parameters, response)


def _tensor_metadata(tensors):
    # As the HTTP/JSON metadata: "parameters" only when there are some.
    described = []
    for t in tensors:
        tensor = {"name": t.name, "datatype": t.datatype,
                  "shape": list(t.shape)}
        if t.parameters:
            tensor["parameters"] = {k: parameter_value(v)
                                    for k, v in t.parameters.items()}
        described.append(tensor)
    return described


class GrpcClient:
    """A client of inference.GRPCInferenceService at `target` ("host:port").

    With `token`, every call carries `authorization: Bearer <token>`.
    Errors raise InferenceServerError with the call's grpc_code. `stub` and
    `channel` are there for requests this class does not make.
    """

    def __init__(self, target, token=None, timeout_s=60, options=()):
        # No 4 MiB receive cap: the server enforces its own limit.
        options = [("grpc.max_receive_message_length", -1),
                   ("grpc.max_send_message_length", -1)] + list(options)
        self.channel = grpc.insecure_channel(target, options=options)
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.metadata = ((("authorization", f"Bearer {token}"),)
                         if token is not None else None)
        self.timeout_s = timeout_s

    def close(self):
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def call(self, method, request):
        """Calls RPC `method` (e.g. "ModelInfer") with the client's token."""
        try:
            return getattr(self.stub, method)(
                request, metadata=self.metadata, timeout=self.timeout_s)
        except grpc.RpcError as error:
            raise InferenceServerError(error.details(),
                                       grpc_code=error.code()) from None

    def server_live(self):
        return self.call("ServerLive", pb.ServerLiveRequest()).live

    def server_ready(self):
        return self.call("ServerReady", pb.ServerReadyRequest()).ready

    def server_metadata(self):
        reply = self.call("ServerMetadata", pb.ServerMetadataRequest())
        return {"name": reply.name, "version": reply.version,
                "extensions": list(reply.extensions)}

    def model_ready(self, model, version=""):
        return self.call("ModelReady", pb.ModelReadyRequest(
            name=model, version=version)).ready

    def model_metadata(self, model, version=""):
        reply = self.call("ModelMetadata", pb.ModelMetadataRequest(
            name=model, version=version))
        return {"name": reply.name, "versions": list(reply.versions),
                "platform": reply.platform,
                "inputs": _tensor_metadata(reply.inputs),
                "outputs": _tensor_metadata(reply.outputs)}

    def infer(self, model, inputs, parameters=None, outputs=None,
              use_raw=None, request_id="", version=""):
        """Runs `model` on `inputs` (name -> array); an InferResult.

        `parameters`: request parameters (bool, int, float or str values).
        `outputs`: names (or (name, parameters) pairs) of the outputs wanted;
        None for all. `use_raw` (default True): tensors in
        raw_input_contents, else in typed contents (FP32, BOOL, UINT8).
        A SharedMemoryInput in `inputs` is sent by reference, and an output
        with shared_memory_parameters() is placed in the region (None in
        the result).
        """
        request = build_infer_request(
            model, inputs, parameters, outputs,
            use_raw=True if use_raw is None else use_raw,
            request_id=request_id, version=version)
        return decode_infer_response(
            self.call("ModelInfer", request),
            {o.name for o in request.outputs
             if "shared_memory_region" in o.parameters})
