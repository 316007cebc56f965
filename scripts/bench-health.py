#!/usr/bin/env python3
"""Active health checks with no traffic: one node, one namespace with 100
deployments x 32 instances (32 listeners of one nginx) asking for 100 ms checks (the shape in
docs/security.md, "Health checks on a budget"). Prints the node's CPU
(utime + stime from /proc/PID/stat) over a window with no request at all,
and the checks its upstreams received in that window.

    python3 scripts/bench-health.py [--bin target/debug/meshgate] [--seconds 10]
        [--deployments 100] [--deploy-extra 'health_min_interval_ms = 100\\nhealth_idle_seconds = 1']

Bounded: one node, one nginx with 32 listeners on 127.0.0.1, a fixed window; everything is
stopped at the end. A binary without the health settings (an older build)
is started without them (it refuses unknown keys).
"""
import argparse, json, os, re, resource, subprocess, sys, tempfile, threading, time
import urllib.request

OPERATOR = "mgop_bench_operator_key_0123456789"
RATES = ("general_per_minute = 100000000\ngeneral_burst = 10000000\n"
         "namespace_per_minute = 100000000\nnamespace_burst = 10000000\n")


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def upstreams(n, tmp):
    """n listeners of one nginx (answering 200 to everything) and a stub_status
    port counting the requests; returns (urls, count(), nginx process)."""
    ports = [free_port() for _ in range(n)]
    status = free_port()
    listens = "".join(f"    listen 127.0.0.1:{p} backlog=4096;\n" for p in ports)
    conf = os.path.join(tmp, "nginx.conf")
    with open(conf, "w") as f:
        f.write(f"""daemon off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log crit;
events {{ worker_connections 16384; }}
http {{
  access_log off;
  client_body_temp_path {tmp}; proxy_temp_path {tmp}; fastcgi_temp_path {tmp};
  uwsgi_temp_path {tmp}; scgi_temp_path {tmp};
  keepalive_timeout 0;
  server {{
{listens}    location / {{ return 200; }}
  }}
  server {{
    listen 127.0.0.1:{status};
    location / {{ stub_status; }}
  }}
}}
""")
    proc = subprocess.Popen(["nginx", "-c", conf, "-p", tmp], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)

    def count():
        with urllib.request.urlopen(f"http://127.0.0.1:{status}/", timeout=10) as r:
            # "Active connections: 1\nserver accepts handled requests\n a b c\n..."
            return int(r.read().decode().splitlines()[2].split()[2])

    for _ in range(100):
        try:
            count()
            break
        except Exception:
            time.sleep(0.05)
    return [f"http://127.0.0.1:{p}" for p in ports], count, proc


def call(base, method, path, key, body=None):
    req = urllib.request.Request(base + path, method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"authorization": f"Bearer {key}",
                                          "content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def start(binary, data, deploy_extra):
    cfg = os.path.join(data, "config.toml")
    for extra in (deploy_extra, ""):
        with open(cfg, "w") as f:
            f.write(f"[rate_limit]\n{RATES}[deploy]\nupstream_allow = [\"127.0.0.0/8\"]\n{extra}")
        p = subprocess.Popen([binary, "serve", "--config", cfg, "--listen", "127.0.0.1:0",
                              "--data-dir", os.path.join(data, "data")],
                             env={**os.environ, "MESHGATE_OPERATOR_KEY": OPERATOR, "RUST_LOG": "error"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for line in p.stdout:
            m = re.match(r"meshgate listening on (\S+)", line)
            if m:
                threading.Thread(target=lambda: p.stdout.read(), daemon=True).start()
                threading.Thread(target=lambda: p.stderr.read(), daemon=True).start()
                return p, m.group(1)
        err = p.stderr.read()
        p.wait()
        if "unknown key" not in err and "unknown field" not in err:
            sys.exit(f"node did not start: {err}")
    sys.exit("node did not start")


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/debug/meshgate")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--deployments", type=int, default=100)
    ap.add_argument("--deploy-extra", default="health_min_interval_ms = 100\n")
    a = ap.parse_args()
    # The old checker opens thousands of connections at once.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with tempfile.TemporaryDirectory() as data:
        urls, checks, nginx = upstreams(32, data)
        node, base = start(a.bin, data, a.deploy_extra.replace("\\n", "\n") + "\n")
        try:
            s, v = call(base, "POST", "/v1/namespaces", OPERATOR, {"name": "evil"})
            assert s == 201, v
            key = v["api_key"]
            for d in range(a.deployments):
                s, v = call(base, "POST", "/v1/deployments", key, {
                    "name": f"d{d}", "hosts": [f"d{d}.evil.test"],
                    "upstream": {"instances": urls,
                                 "health": {"path": f"/h/{d}", "interval_ms": 100}}})
                assert s == 201, v
            time.sleep(3)  # warm-up: every checker started
            c0, t0, k0 = cpu_ticks(node.pid), time.monotonic(), checks()
            time.sleep(a.seconds)
            c1, t1, k1 = cpu_ticks(node.pid), time.monotonic(), checks()
            hz = os.sysconf("SC_CLK_TCK")
            cpu = (c1 - c0) / hz / (t1 - t0)
            print("| binary | deployments x 32 | window | node CPU (cores) | checks received /s |")
            print("|---|---|---|---|---|")
            print(f"| {a.bin} | {a.deployments} | {t1 - t0:.1f} s, no traffic | {cpu:.3f} | {(k1 - k0) / (t1 - t0):.0f} |")
        finally:
            nginx.terminate()
            nginx.wait(10)
            node.terminate()
            try:
                node.wait(10)
            except subprocess.TimeoutExpired:
                node.kill()


if __name__ == "__main__":
    main()
