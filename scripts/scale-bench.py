#!/usr/bin/env python3
"""Throughput of 1, 2 and 3 agentd daemons sharing one Redis, where each node's model pool is
the limit: a scripted model answering in 50 ms, 32 model workers per node, runs of two model
turns around one tool call. Closed loop over HTTP: CLIENTS_PER_NODE clients per node, each
starting a run through its node and following its events (SSE) to the end, for DURATION
seconds. Prints runs/s per cluster size and the ratio to one node.

Loopback only, bounded in time. Needs a release build (`cargo build --release`) and Redis:

    scripts/scale-bench.py [--redis redis://127.0.0.1:6379/0] [--nodes 1,2,3] [--duration 15]
"""

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid

TOKEN = "scale-token-0123456789"

CONFIG = """
[server]
listen = "127.0.0.1:0"
shutdown_timeout = "5s"

[store]
url = "{store}"

[[tenants]]
id = "scale"
tokens = ["{token}"]

[runtime]
model_workers = 32
passivate_after = "0s"

[models.fifty]
kind = "scripted"
delay = "50ms"
replies = [
  {{ tool_calls = [ {{ name = "add", arguments = {{ a = 1, b = 2 }} }} ] }},
  {{ text = "3" }},
]

[tools.add]
kind = "builtin"
builtin = "add"

[agents.work]
model = "fifty"
tools = ["add"]
"""


def start_node(binary, config_path, log_path):
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        [binary, "serve", "--config", config_path, "--listen", "127.0.0.1:0"],
        stdout=log,
        stderr=subprocess.PIPE,
        env={**os.environ, "RUST_LOG": "warn"},
    )
    deadline = time.time() + 30
    while time.time() < deadline:
        line = proc.stderr.readline().decode(errors="replace")
        if not line:
            break
        log.write(line.encode())
        if line.startswith("agentd listening on http://"):
            hostport = line.strip().split("http://", 1)[1]
            threading.Thread(target=drain, args=(proc.stderr, log), daemon=True).start()
            host, port = hostport.rsplit(":", 1)
            wait_ready(host, int(port))
            return proc, (host, int(port))
    proc.kill()
    sys.exit(f"agentd did not start; see {log_path}")


def drain(stream, log):
    for line in stream:
        log.write(line)


def wait_ready(host, port):
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            c = http.client.HTTPConnection(host, port, timeout=2)
            c.request("GET", "/readyz")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    sys.exit("agentd not ready")


def one_run(conn, host, port):
    """Starts a run and follows it to its terminal event; returns True if it succeeded."""
    body = json.dumps({"agent": "work", "input": "1 + 2"})
    conn.request(
        "POST",
        "/v1/runs",
        body,
        {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    r = conn.getresponse()
    data = json.loads(r.read())
    if r.status != 201:
        raise RuntimeError(f"create: {r.status} {data}")
    run = data["id"]
    stream = http.client.HTTPConnection(host, port, timeout=60)
    stream.request(
        "GET",
        f"/v1/runs/{run}/events",
        headers={"Authorization": f"Bearer {TOKEN}", "Accept": "text/event-stream"},
    )
    resp = stream.getresponse()
    outcome = None
    for raw in resp:
        line = raw.decode(errors="replace").strip()
        if line.startswith("event: run_"):
            kind = line.split(": ", 1)[1]
            if kind in ("run_succeeded", "run_failed", "run_cancelled"):
                outcome = kind
                break
    stream.close()
    return outcome == "run_succeeded"


def client(addr, stop, counts, errors):
    host, port = addr
    conn = http.client.HTTPConnection(host, port, timeout=60)
    while not stop.is_set():
        try:
            ok = one_run(conn, host, port)
            with counts["lock"]:
                counts["done" if ok else "failed"] += 1
        except Exception as e:  # noqa: BLE001 - reported, then the client reconnects
            errors.append(str(e))
            conn = http.client.HTTPConnection(host, port, timeout=60)
            time.sleep(0.1)


def measure(binary, redis, n, duration, clients_per_node, workdir):
    store = f"{redis}?ns=scale{uuid.uuid4().hex[:8]}"
    procs, addrs = [], []
    for i in range(n):
        path = os.path.join(workdir, f"node{n}-{i}.toml")
        with open(path, "w") as f:
            f.write(CONFIG.format(store=store, token=TOKEN))
        proc, addr = start_node(binary, path, os.path.join(workdir, f"node{n}-{i}.log"))
        procs.append(proc)
        addrs.append(addr)
    stop = threading.Event()
    counts = {"lock": threading.Lock(), "done": 0, "failed": 0}
    errors = []
    threads = [
        threading.Thread(target=client, args=(addr, stop, counts, errors), daemon=True)
        for addr in addrs
        for _ in range(clients_per_node)
    ]
    # Warm up, then count completions over the window.
    for t in threads:
        t.start()
    time.sleep(2)
    with counts["lock"]:
        start_done = counts["done"]
    t0 = time.time()
    time.sleep(duration)
    with counts["lock"]:
        done = counts["done"] - start_done
    elapsed = time.time() - t0
    stop.set()
    for t in threads:
        t.join(timeout=70)
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
    return done / elapsed, counts["failed"], errors[:3]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--nodes", default="1,2,3")
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--clients-per-node", type=int, default=48)
    ap.add_argument("--binary", default=os.path.join("target", "release", "agentd"))
    a = ap.parse_args()
    if not os.path.exists(a.binary):
        sys.exit(f"{a.binary} not found: run `cargo build --release` first")
    with tempfile.TemporaryDirectory() as workdir:
        base = None
        for n in [int(x) for x in a.nodes.split(",")]:
            rate, failed, errors = measure(
                a.binary, a.redis, n, a.duration, a.clients_per_node, workdir
            )
            base = base or rate
            print(
                f"{n} node(s): {rate:7.1f} runs/s  ({rate / base:.2f}x one node)"
                f"  failed={failed} errors={errors}",
                flush=True,
            )


if __name__ == "__main__":
    main()
