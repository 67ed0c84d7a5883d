"""The Open Inference Protocol over HTTP/JSON (KServe v2 REST), urllib only."""
import json
import urllib.error
import urllib.parse
import urllib.request

import numpy as np

from open_inference.tensors import (InferenceServerError, InferResult,
                                    SharedMemoryInput, from_json_data,
                                    in_shared_memory, input_array,
                                    to_json_data)


def _json_value(value):
    """A parameter value as JSON takes it (numpy scalars unwrapped)."""
    if isinstance(value, np.generic):
        value = value.item()
    if not isinstance(value, (bool, int, float, str)):
        raise TypeError(f"parameter value {value!r}: not a bool, int, "
                        "float or str")
    return value


def build_infer_body(inputs, parameters=None, outputs=None, request_id=""):
    """The JSON inference request of HttpClient.infer's arguments."""
    body = {}
    if request_id:
        body["id"] = request_id
    if parameters:
        body["parameters"] = {k: _json_value(v)
                              for k, v in parameters.items()}
    body["inputs"] = []
    for name, value in inputs.items():
        if isinstance(value, SharedMemoryInput):
            body["inputs"].append({
                "name": name, "shape": value.shape,
                "datatype": value.datatype,
                "parameters": {k: _json_value(v)
                               for k, v in value.parameters.items()}})
            continue
        datatype, array = input_array(value)
        body["inputs"].append({"name": name, "shape": list(array.shape),
                               "datatype": datatype,
                               "data": to_json_data(datatype, array)})
    if outputs:
        body["outputs"] = []
        for output in outputs:
            if isinstance(output, str):
                body["outputs"].append({"name": output})
            else:
                name, output_parameters = output
                body["outputs"].append({
                    "name": name,
                    "parameters": {k: _json_value(v)
                                   for k, v in output_parameters.items()}})
    return body


def decode_infer_body(body, shared_memory_outputs=()):
    """InferResult of a JSON inference response; outputs placed in shared
    memory (named in `shared_memory_outputs` or by their parameters) have
    no data and map to None."""
    outputs, datatypes, shapes = {}, {}, {}
    for tensor in body["outputs"]:
        name = tensor["name"]
        datatypes[name] = tensor["datatype"]
        shapes[name] = list(tensor["shape"])
        if (name in shared_memory_outputs
                or in_shared_memory(tensor.get("parameters"))):
            if "data" in tensor:
                raise ValueError(f"{name}: in shared memory and in data")
            outputs[name] = None
            continue
        outputs[name] = from_json_data(tensor["datatype"], tensor["shape"],
                                       tensor["data"])
    return InferResult(outputs, body.get("model_name", ""),
                       body.get("model_version", ""), body.get("id", ""),
                       datatypes, shapes, body.get("parameters", {}), body)


def _decode(data):
    """A body as JSON when it is JSON, else as the bytes received."""
    try:
        return json.loads(data)
    except ValueError:
        return data


def _model_path(model, version):
    path = "/v2/models/" + urllib.parse.quote(model, safe="")
    if version:
        path += "/versions/" + urllib.parse.quote(version, safe="")
    return path


class HttpClient:
    """A client of the KServe v2 REST endpoints at `url` ("http://host:port").

    With `token`, every request carries `Authorization: Bearer <token>`.
    Error answers raise InferenceServerError with the HTTP status and the
    decoded body ({"error": message} from a conforming server).
    """

    def __init__(self, url, token=None, timeout_s=60):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        # Straight to the server: no proxy from the environment.
        self.opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}))

    def request(self, method, path, body=None, headers=None):
        """(status, decoded body) of one request; `body`: bytes or JSON."""
        headers = dict(headers or {})
        if self.token is not None:
            headers.setdefault("Authorization", f"Bearer {self.token}")
        if body is not None and not isinstance(body, bytes):
            # allow_nan=False: JSON has no NaN or infinities.
            body = json.dumps(body, allow_nan=False).encode()
        if body is not None:
            headers.setdefault("Content-Type", "application/json")
        request = urllib.request.Request(self.url + path, data=body,
                                         method=method, headers=headers)
        try:
            with self.opener.open(request, timeout=self.timeout_s) as reply:
                return reply.status, _decode(reply.read())
        except urllib.error.HTTPError as error:
            with error:
                return error.code, _decode(error.read())

    def _ok(self, method, path, body=None):
        status, payload = self.request(method, path, body)
        if status != 200:
            message = (payload["error"] if isinstance(payload, dict)
                       and "error" in payload else repr(payload))
            raise InferenceServerError(message, http_status=status,
                                       body=payload)
        return payload

    def _health(self, path, key):
        # Not ready is an answer (503 with {"ready": false}), not an error.
        status, payload = self.request("GET", path)
        if (status in (200, 503) and isinstance(payload, dict)
                and isinstance(payload.get(key), bool)):
            return payload[key]
        raise InferenceServerError(repr(payload), http_status=status,
                                   body=payload)

    def server_live(self):
        return self._health("/v2/health/live", "live")

    def server_ready(self):
        return self._health("/v2/health/ready", "ready")

    def server_metadata(self):
        return self._ok("GET", "/v2")

    def model_ready(self, model, version=""):
        # A model or version not served is not ready (503, ready false).
        return self._health(_model_path(model, version) + "/ready", "ready")

    def model_metadata(self, model, version=""):
        return self._ok("GET", _model_path(model, version))

    def infer(self, model, inputs, parameters=None, outputs=None,
              use_raw=None, request_id="", version=""):
        """Runs `model` on `inputs` (name -> array); an InferResult.

        As GrpcClient.infer; tensors travel as JSON numbers, so `use_raw`
        must be None or False.
        """
        if use_raw:
            raise ValueError("HTTP/JSON carries tensors as JSON data only")
        body = build_infer_body(inputs, parameters, outputs, request_id)
        return decode_infer_body(
            self._ok("POST", _model_path(model, version) + "/infer", body),
            {o["name"] for o in body.get("outputs", ())
             if in_shared_memory(o.get("parameters"))})
