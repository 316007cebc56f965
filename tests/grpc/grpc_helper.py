#!/usr/bin/env python3
"""A gRPC upstream and client for meshgate's gRPC tests (tests/it/grpc.rs)
and bench (scripts/bench-grpc.sh), with Python grpcio and raw bytes: generic
handlers and identity serializers, so no .proto file and no protoc step.

  grpc_helper.py serve PORT
      Serves service `test.Echo` on 127.0.0.1:PORT and prints "ready".
      Unary        echoes the request; initial metadata x-initial: hello,
                   trailing metadata x-custom-trailer: kept.
      ServerStream request is a count N as text: answers msg-0 .. msg-(N-1),
                   trailing metadata x-stream-trailer: done.
      Bidi         echoes each message as it comes.
      Sleep        sleeps 1 s, then echoes.
      Fail         ends with NOT_FOUND "nothing here" and x-why: custom.
      Die          sends two messages, then the process exits at once.
      Headers      answers the request's metadata as JSON.

  grpc_helper.py call ADDR AUTHORITY CASE [ARG] [--key K] [--timeout S] [--repeat N]
      Runs one call through ADDR with :authority AUTHORITY and prints one
      JSON line: code, details, trailers, initial metadata, messages; with
      --repeat, N unary calls on one channel and their codes.

  grpc_helper.py bench ADDR AUTHORITY SECONDS CONCURRENCY
      Unary calls for SECONDS from CONCURRENCY threads; prints calls/s.
"""
import json
import os
import sys
import threading
import time
from concurrent import futures

try:
    import grpc
except ImportError:
    sys.stderr.write(
        "grpcio is missing: scripts/test.sh installs it "
        "(python3 -m pip install grpcio)\n")
    sys.exit(3)

ident = lambda b: b


def handlers():
    def unary(req, ctx):
        ctx.send_initial_metadata((("x-initial", "hello"),))
        ctx.set_trailing_metadata((("x-custom-trailer", "kept"),))
        return req

    def server_stream(req, ctx):
        n = int(req.decode() or "0")
        for i in range(n):
            yield f"msg-{i}".encode()
        ctx.set_trailing_metadata((("x-stream-trailer", "done"),))

    def bidi(it, ctx):
        for m in it:
            yield m

    def sleep(req, ctx):
        time.sleep(1.0)
        return req

    def fail(req, ctx):
        ctx.set_trailing_metadata((("x-why", "custom"),))
        ctx.abort(grpc.StatusCode.NOT_FOUND, "nothing here")

    def die(req, ctx):
        yield b"one"
        yield b"two"
        time.sleep(0.2)
        os._exit(1)

    def headers(req, ctx):
        md = {}
        for k, v in ctx.invocation_metadata():
            md[k] = v if isinstance(v, str) else v.hex()
        return json.dumps(md).encode()

    u = lambda f: grpc.unary_unary_rpc_method_handler(f, ident, ident)
    return grpc.method_handlers_generic_handler("test.Echo", {
        "Unary": u(unary),
        "Sleep": u(sleep),
        "Fail": u(fail),
        "Headers": u(headers),
        "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream, ident, ident),
        "Die": grpc.unary_stream_rpc_method_handler(die, ident, ident),
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi, ident, ident),
    })


def serve(port):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    server.add_generic_rpc_handlers((handlers(),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


def channel(addr, authority):
    return grpc.insecure_channel(addr, options=[("grpc.default_authority", authority)])


def repeat(addr, authority, case, arg, key, timeout, n):
    """N unary calls on one channel, as fast as they go: their codes."""
    ch = channel(addr, authority)
    md = (("x-api-key", key),) if key else None
    f = ch.unary_unary("/test.Echo/" + case, ident, ident)
    codes = []
    for _ in range(n):
        try:
            f(arg.encode(), timeout=timeout, metadata=md)
            codes.append("OK")
        except grpc.RpcError as e:
            codes.append(e.code().name)
    print(json.dumps({"codes": codes}), flush=True)


def call(addr, authority, case, arg, key, timeout):
    ch = channel(addr, authority)
    md = (("x-api-key", key),) if key else None
    out = {"code": "OK", "details": "", "trailers": {}, "initial": {}, "messages": []}
    path = "/test.Echo/" + case
    try:
        if case in ("Unary", "Sleep", "Fail", "Headers", "Missing"):
            f = ch.unary_unary(path, ident, ident)
            resp, c = f.with_call(arg.encode(), timeout=timeout, metadata=md)
            out["messages"].append(resp.decode(errors="replace"))
        elif case in ("ServerStream", "Die"):
            c = ch.unary_stream(path, ident, ident)(arg.encode(), timeout=timeout, metadata=md)
            for m in c:
                out["messages"].append(m.decode())
        elif case == "Bidi":
            n = int(arg)
            c = ch.stream_stream(path, ident, ident)(
                (f"m{i}".encode() for i in range(n)), timeout=timeout, metadata=md)
            for m in c:
                out["messages"].append(m.decode())
        else:
            raise SystemExit(f"unknown case {case}")
        out["trailers"] = dict(c.trailing_metadata() or ())
        out["initial"] = dict(c.initial_metadata() or ())
    except grpc.RpcError as e:
        out["code"] = e.code().name
        out["details"] = e.details() or ""
        out["trailers"] = dict(e.trailing_metadata() or ())
        out["initial"] = dict(e.initial_metadata() or ())
    print(json.dumps(out), flush=True)


def bench(addr, authority, seconds, concurrency):
    ch = channel(addr, authority)
    f = ch.unary_unary("/test.Echo/Unary", ident, ident)
    f(b"warm", timeout=10)
    end = time.monotonic() + seconds
    counts = [0] * concurrency

    def run(i):
        while time.monotonic() < end:
            f(b"ping", timeout=10)
            counts[i] += 1

    ts = [threading.Thread(target=run, args=(i,)) for i in range(concurrency)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    print(f"{sum(counts) / seconds:.0f}", flush=True)


def main(argv):
    if argv[1] == "serve":
        serve(int(argv[2]))
    elif argv[1] == "call":
        rest = argv[2:]
        key, timeout = None, 10.0
        if "--key" in rest:
            i = rest.index("--key")
            key = rest[i + 1]
            del rest[i:i + 2]
        if "--timeout" in rest:
            i = rest.index("--timeout")
            timeout = float(rest[i + 1])
            del rest[i:i + 2]
        n = None
        if "--repeat" in rest:
            i = rest.index("--repeat")
            n = int(rest[i + 1])
            del rest[i:i + 2]
        addr, authority, case = rest[:3]
        arg = rest[3] if len(rest) > 3 else ""
        if n is None:
            call(addr, authority, case, arg, key, timeout)
        else:
            repeat(addr, authority, case, arg, key, timeout, n)
    elif argv[1] == "bench":
        bench(argv[2], argv[3], float(argv[4]), int(argv[5]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
