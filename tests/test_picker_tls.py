"""The picker's ext_proc over TLS (`--secure-serving`, as GAIE's endpoint picker serves it and the
gateways' stock settings expect): a self-signed certificate made at start, or one from a mounted
kubernetes.io/tls Secret; a real gRPC server and a TLS client on loopback."""

from __future__ import annotations

import asyncio
import json
import ssl

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

from dynamo_ppd.launch.process import free_port
from dynamo_ppd.picker.args import parse_args
from dynamo_ppd.picker.extproc import DESTINATION_HEADER, ExtProcService
from dynamo_ppd.picker.picker import Pick
from dynamo_ppd.picker.tls import read_cert_dir, self_signed, server_credentials


class _Picker:
    def frontend(self, subset=None) -> str:
        return "10.0.0.8:8000"

    async def pick(self, headers, body, path, subset=None, clock=None) -> Pick:
        return Pick("10.0.0.8:8000", {"x-dynamo-routing": "decode_local"}, (), None)


class _Metrics:
    def observe(self, outcome, seconds, cpu_s=0.0, stages=None) -> None:
        pass


async def _one_request(port: int, cert_pem: bytes) -> list[pb.ProcessingResponse]:
    # Like a gateway that does not verify the picker's certificate: trust what it presents.
    credentials = grpc.ssl_channel_credentials(root_certificates=cert_pem)
    options = [("grpc.ssl_target_name_override", "dynamo-ppd-picker")]
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials, options=options) as ch:
        stub = external_processor_pb2_grpc.ExternalProcessorStub(ch)
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
        path = base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions")
        headers = base_pb2.HeaderMap(headers=[path])
        requests = [pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers)),
                    pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]
        return [r async for r in stub.Process(iter(requests))]


@pytest.mark.e2e
def test_ext_proc_over_tls_with_a_self_signed_certificate():
    async def scenario():
        port = free_port()
        server = grpc.aio.server()
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
            ExtProcService(_Picker(), _Metrics()), server)  # type: ignore[arg-type]
        credentials, cert_pem = server_credentials(None)
        server.add_secure_port(f"127.0.0.1:{port}", credentials)
        await server.start()
        try:
            presented = await asyncio.to_thread(ssl.get_server_certificate, ("127.0.0.1", port))
            replies = await _one_request(port, presented.encode())
            # A plaintext client gets nowhere: the port speaks only TLS.
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = external_processor_pb2_grpc.ExternalProcessorStub(ch)
                with pytest.raises(grpc.aio.AioRpcError):
                    [r async for r in stub.Process(iter([pb.ProcessingRequest()]), timeout=3)]
        finally:
            await server.stop(None)
        return replies, presented, cert_pem

    replies, presented, cert_pem = asyncio.run(scenario())
    assert ssl.PEM_cert_to_DER_cert(presented) == ssl.PEM_cert_to_DER_cert(cert_pem.decode())
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body"]
    sets = {o.header.key: o.header.raw_value.decode()
            for o in replies[0].request_headers.response.header_mutation.set_headers}
    assert sets[DESTINATION_HEADER] == "10.0.0.8:8000"


@pytest.mark.unit
def test_a_certificate_directory_needs_both_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="tls.key"):
        read_cert_dir(str(tmp_path))
    key, cert = self_signed()
    (tmp_path / "tls.key").write_bytes(key)
    (tmp_path / "tls.crt").write_bytes(cert)
    assert read_cert_dir(str(tmp_path)) == (key, cert)
    assert b"BEGIN CERTIFICATE" in cert and b"PRIVATE KEY" in key


@pytest.mark.unit
def test_tls_flags():
    _, picker = parse_args(["--secure-serving", "--cert-path", "/etc/picker-tls"])
    assert picker.secure_serving and picker.cert_path == "/etc/picker-tls"
    assert not parse_args([])[1].secure_serving
    with pytest.raises(SystemExit):
        parse_args(["--cert-path", "/etc/picker-tls"])  # without --secure-serving: a mistake
