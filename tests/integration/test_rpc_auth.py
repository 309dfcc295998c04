"""Control-plane authentication over a real gRPC server on 127.0.0.1."""

from concurrent import futures

import grpc
import pytest

from rpc import pdserve_pb2 as pb
from rpc import pdserve_pb2_grpc as pb_grpc
from rpc.auth import ServerAuthInterceptor, client_interceptor

pytestmark = pytest.mark.integration
SECRET = b"cluster-secret-for-tests-0123456789"


class EchoRegistry(pb_grpc.RegistryServicer):
    """Test double: a Registry that accepts everyone (the interceptor is what is tested)."""

    def Register(self, request, context):
        return pb.RegisterResponse(accepted=True, router_id="echo")


@pytest.fixture
def server():
    srv = grpc.server(futures.ThreadPoolExecutor(2, thread_name_prefix="auth-test"),
                      interceptors=[ServerAuthInterceptor(SECRET)])
    pb_grpc.add_RegistryServicer_to_server(EchoRegistry(), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.stop(0).wait()


def _register(address, interceptor=None):
    with grpc.insecure_channel(address) as ch:
        if interceptor is not None:
            ch = grpc.intercept_channel(ch, interceptor)
        return pb_grpc.RegistryStub(ch).Register(pb.RegisterRequest(), timeout=5)


def test_member_with_the_secret_is_accepted(server):
    assert _register(server, client_interceptor(SECRET)).router_id == "echo"


@pytest.mark.parametrize("interceptor", [None, client_interceptor(b"another-secret-0123456789")])
def test_unauthenticated_caller_is_refused(server, interceptor):
    with pytest.raises(grpc.RpcError) as err:
        _register(server, interceptor)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
