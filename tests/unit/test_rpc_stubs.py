"""The committed gRPC stubs are what `python -m rpc.generate` makes from rpc/pdserve.proto."""

import pytest

pytestmark = pytest.mark.unit


def test_generated_stubs_are_fresh():
    pytest.importorskip("grpc_tools", reason="grpcio-tools is in the dev extra")
    from rpc.generate import main

    assert main(["--check"]) == 0, "rpc stubs are stale: run python -m rpc.generate"


def test_protocol_has_the_documented_services():
    from rpc import pdserve_pb2 as pb

    services = pb.DESCRIPTOR.services_by_name
    assert set(services) == {"Registry", "Prefill", "Decode"}
    assert set(services["Registry"].methods_by_name) == {"Register", "Heartbeat", "Leave"}
    assert services["Decode"].methods_by_name["Decode"].server_streaming
    assert {"Reserve", "Abort", "Stats", "Connect", "Drain"} <= set(services["Decode"].methods_by_name)
