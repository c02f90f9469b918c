import asyncio

import grpc

import bucketimer
from bucketimer.grpc import aio as btg

# Server: a call's budget is the client's deadline, at most 0.5 s; when it runs
# out, the handler is cancelled and the client gets DEADLINE_EXCEEDED.
server_interceptors = [btg.ServerDeadlineInterceptor(max_time=0.5)]

# Client: a call without a timeout gets 2 s; a call made inside a handler gets
# at most what is left of that handler's budget.
client_interceptors = [btg.DefaultTimeoutInterceptor(2.0)]

# The rest is a demo: a server on 127.0.0.1 and two calls, one of them too slow.

async def work(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    await asyncio.sleep(float(request))  # a backend that is sometimes slow
    return request


async def main() -> None:
    server = grpc.aio.server(interceptors=server_interceptors)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "demo.Work", {"Do": grpc.unary_unary_rpc_method_handler(work)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                         interceptors=client_interceptors) as channel:
        do: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]
        do = channel.unary_unary("/demo.Work/Do")
        print(await do(b"0.1"))  # b'0.1'
        try:
            await do(b"5")
        except grpc.aio.AioRpcError as e:
            print(e.code())  # StatusCode.DEADLINE_EXCEEDED
    await server.stop(None)


bucketimer.run(main())
