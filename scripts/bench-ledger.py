#!/usr/bin/env python3
"""The disk and compile ledger, measured against a running node.

Starts `meshgate serve` (the binary given, default target/debug/meshgate)
on 127.0.0.1 with a fresh data folder and runs, as the tenant "evil":

  wat    four concurrent deploys of a 16 MiB WAT text `(module (func)...)`,
         then four of a text just under 4 MiB: the answers and the node's
         peak RSS growth (VmHWM);
  nest   one deploy of a 1 MiB function body of nested blocks: the answer
         and the peak RSS growth;
  disk   six deploy/delete cycles of a site of four 16 MiB random files:
         the data folder's size on disk after each delete (after the blob
         sweep, when the node has one: `meshgate_blobs_deleted_total`;
         else after a 5 s settle).

Prints one table per part. Nothing leaves 127.0.0.1.

    python3 scripts/bench-ledger.py [--bin PATH] [--parts wat,nest,disk]
"""

import argparse
import io
import json
import os
import re
import subprocess
import tarfile
import tempfile
import threading
import time
import urllib.request

OPERATOR_KEY = "mgop_bench_operator_key_0123456789"
CONFIG = """[rate_limit]
general_per_minute = 1000000
general_burst = 100000
credential_per_minute = 100000
credential_burst = 10000
namespace_per_minute = 1000000
namespace_burst = 100000
[deploy]
max_site_bytes = 83886080
"""


def kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def disk_bytes(path):
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


class Node:
    def __init__(self, binary):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = os.path.join(self.tmp.name, "data")
        os.makedirs(self.dir)
        cfg = os.path.join(self.tmp.name, "config.toml")
        with open(cfg, "w") as f:
            f.write(CONFIG)
        env = dict(os.environ, MESHGATE_OPERATOR_KEY=OPERATOR_KEY, RUST_LOG="warn")
        self.proc = subprocess.Popen(
            [binary, "serve", "--config", cfg, "--listen", "127.0.0.1:0", "--data-dir", self.dir],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        for line in self.proc.stdout:
            m = re.match(r"meshgate listening on (\S+)", line)
            if m:
                self.base = m.group(1)
                break
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
        for _ in range(300):
            try:
                if urllib.request.urlopen(self.base + "/readyz").status == 200:
                    break
            except Exception:
                time.sleep(0.1)

    def call(self, method, path, key, body=None, ctype="application/json"):
        req = urllib.request.Request(self.base + path, data=body, method=method)
        req.add_header("authorization", f"Bearer {key}")
        if body is not None:
            req.add_header("content-type", ctype)
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def namespace(self, name):
        s, b = self.call("POST", "/v1/namespaces", OPERATOR_KEY, json.dumps({"name": name}).encode())
        assert s == 201, b
        return json.loads(b)["api_key"]

    def metric(self, name):
        s, b = self.call("GET", "/metrics", OPERATOR_KEY)
        for line in b.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.tmp.cleanup()


def multipart(parts):
    boundary = "mgbenchledger"
    out = io.BytesIO()
    for name, data in parts:
        out.write(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n".encode()
        )
        out.write(data)
        out.write(b"\r\n")
    out.write(f"--{boundary}--\r\n".encode())
    return out.getvalue(), f"multipart/form-data; boundary={boundary}"


def code(body):
    try:
        return json.loads(body)["error"]["code"]
    except Exception:
        return "-"


def deploy_fn(node, key, name, wasm):
    body, ct = multipart([("name", name.encode()), ("wasm", wasm)])
    return node.call("POST", "/v1/functions", key, body, ct)


def at_once(node, key, text, n=4):
    results = [None] * n
    barrier = threading.Barrier(n)

    def one(i):
        barrier.wait()
        results[i] = deploy_fn(node, key, f"wat{i}", text)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def empty_functions(size):
    n = (size - len(b"(module)")) // len(b"(func)")
    return b"(module" + b"(func)" * n + b")"


def nested_blocks(depth):
    def leb(v):
        out = bytearray()
        while True:
            b = v & 0x7F
            v >>= 7
            if v == 0:
                out.append(b)
                return bytes(out)
            out.append(b | 0x80)

    def section(i, content):
        return bytes([i]) + leb(len(content)) + content

    body = b"\x00" + b"\x02\x40" * depth + b"\x0b" * depth + b"\x0b"
    m = b"\x00asm\x01\x00\x00\x00"
    m += section(1, b"\x01\x60\x00\x00")
    m += section(3, b"\x01\x00")
    m += section(7, b"\x01\x06_start\x00\x00")
    m += section(10, b"\x01" + leb(len(body)) + body)
    return m


def part_wat(node, key):
    pid = node.proc.pid
    deploy_fn(node, key, "warm", b'(module (func (export "_start")))')
    print("| WAT deploys, 4 at once | answers | node peak RSS |")
    print("|---|---|---:|")
    for label, size in [("16 MiB", 16 << 20), ("4 MiB - 64 B", (4 << 20) - 64)]:
        before = kib(pid, "VmHWM:")
        base_rss = kib(pid, "VmRSS:")
        answers = at_once(node, key, empty_functions(size))
        after = kib(pid, "VmHWM:")
        got = ", ".join(f"{s} {code(b)}" for s, b in answers)
        print(f"| {label} | {got} | {base_rss // 1024} MiB -> peak {after // 1024} MiB (+{(after - before) // 1024} MiB) |")


def part_nest(node, key):
    pid = node.proc.pid
    module = nested_blocks(((1 << 20) - 16) // 3)
    before = kib(pid, "VmHWM:")
    t = time.monotonic()
    s, b = deploy_fn(node, key, "nested", module)
    took = time.monotonic() - t
    after = kib(pid, "VmHWM:")
    print("| 1 MiB nested-blocks module | answer | time | node peak RSS growth |")
    print("|---|---|---:|---:|")
    print(f"| {len(module)} bytes | {s} {code(b)} | {took:.2f} s | +{(after - before) // 1024} MiB |")


def part_disk(node, key):
    base = disk_bytes(node.dir)
    print(f"| cycle | data folder growth after the delete (base {base / 2**20:.0f} MiB) |")
    print("|---:|---:|")
    for cycle in range(1, 7):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
            for i in range(4):
                data = os.urandom(16 << 20)
                info = tarfile.TarInfo(f"f{i}.bin")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        body, ct = multipart([("name", b"big"), ("hosts", b"big.evil.test"), ("tarball", buf.getvalue())])
        s, b = node.call("POST", "/v1/deployments", key, body, ct)
        assert s == 201, b
        s, b = node.call("DELETE", "/v1/deployments/big", key)
        assert s == 200, b
        if node.metric("meshgate_blobs_deleted_total") is not None:
            deadline = time.monotonic() + 120
            while node.metric("meshgate_blobs_deleted_total") < 4 * cycle and time.monotonic() < deadline:
                time.sleep(0.1)
        else:
            time.sleep(5)
        print(f"| {cycle} | {(disk_bytes(node.dir) - base) / 2**20:.0f} MiB |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", default="target/debug/meshgate")
    p.add_argument("--parts", default="wat,nest,disk")
    a = p.parse_args()
    for part in a.parts.split(","):
        node = Node(a.bin)
        try:
            key = node.namespace("evil")
            {"wat": part_wat, "nest": part_nest, "disk": part_disk}[part](node, key)
            print()
        finally:
            node.stop()


if __name__ == "__main__":
    main()
