#!/usr/bin/env python3
"""Hostile-load figures for an agentd binary (Python 3.11 standard library only).

Starts `agentd serve` on 127.0.0.1 with a throw-away configuration (memory store, a scripted
model), then measures:

1. follows of finished runs: resident memory (VmRSS) before and after N SSE follows of runs
   that have already ended; every follow must leave nothing behind in the daemon.
2. slow header senders: S connections that send a request head one byte every 100 ms (every
   tenth sends nothing at all). Meanwhile
   /healthz is probed on fresh connections (latency percentiles), and the time each slow
   socket stays open is recorded (the daemon must close them within server.header_read_timeout).

Bounded: counts are capped, every phase has a deadline, only loopback is used, and the daemon
is stopped at the end. Example:

    cargo build --release
    python3 scripts/hostile-load.py --binary target/release/agentd
"""

import argparse
import errno
import http.client
import json
import os
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

TOKEN = "hostile-load-token-0123456789"
HOST = "127.0.0.1"

CONFIG = """
[server]
listen = "127.0.0.1:0"
header_read_timeout = "{header_timeout}s"
shutdown_timeout = "5s"

[store]
url = "memory:"

[[tenants]]
id = "load"
tokens = ["{token}"]

[limits]
max_streams_per_tenant = 0

[models.quick]
kind = "scripted"
replies = [ {{ tool_calls = [ {{ name = "echo", arguments = {{ text = "hi" }} }} ] }}, {{ text = "done" }} ]

[tools.echo]
kind = "builtin"
builtin = "echo"

[agents.quick]
model = "quick"
tools = ["echo"]
"""


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def start_daemon(binary, header_timeout, workdir):
    config = os.path.join(workdir, "agentd.toml")
    with open(config, "w") as f:
        f.write(CONFIG.format(header_timeout=header_timeout, token=TOKEN))
    log = open(os.path.join(workdir, "agentd.log"), "w")
    proc = subprocess.Popen(
        [binary, "serve", "--config", config, "--listen", f"{HOST}:0"],
        stdout=log,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RUST_LOG": "warn"},
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if line.startswith("agentd listening on http://"):
            port = int(line.strip().rsplit(":", 1)[1])
            # Keep draining stderr so the daemon never blocks on it.
            threading.Thread(target=lambda: proc.stderr.read(), daemon=True).start()
            return proc, port
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("the daemon did not start")


def request(port, method, path, body=None, accept=None, timeout=30):
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    if accept:
        headers["Accept"] = accept
    conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
    res = conn.getresponse()
    data = res.read()
    conn.close()
    return res.status, data


def wait_ready(port, within=30):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            status, _ = request(port, "GET", "/readyz", timeout=2)
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError("the daemon did not become ready")


def finished_runs(port, count, deadline):
    ids = []
    for _ in range(count):
        status, data = request(port, "POST", "/v1/runs", {"agent": "quick", "input": "go"})
        assert status == 201, data
        ids.append(json.loads(data)["id"])
    for run in ids:
        while True:
            status, data = request(port, "GET", f"/v1/runs/{run}")
            if json.loads(data)["status"] == "succeeded":
                break
            if time.monotonic() > deadline:
                raise RuntimeError("runs did not finish in time")
            time.sleep(0.01)
    return ids


def follow_all(port, ids, total, threads, deadline):
    """`total` SSE follows spread over `ids`, on `threads` keep-alive connections."""
    counter = iter(range(total))
    lock = threading.Lock()
    errors = []

    def worker():
        conn = http.client.HTTPConnection(HOST, port, timeout=30)
        headers = {"Authorization": f"Bearer {TOKEN}", "Accept": "text/event-stream"}
        while time.monotonic() < deadline:
            with lock:
                i = next(counter, None)
            if i is None:
                break
            try:
                conn.request("GET", f"/v1/runs/{ids[i % len(ids)]}/events", headers=headers)
                res = conn.getresponse()
                body = res.read()
                if res.status != 200 or b"run_succeeded" not in body:
                    errors.append(f"follow {i}: {res.status}")
            except (OSError, http.client.HTTPException) as e:
                errors.append(f"follow {i}: {e}")
                conn.close()
                conn = http.client.HTTPConnection(HOST, port, timeout=30)
        conn.close()

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return errors


def settle(pid, seconds=3.0):
    """RSS after `seconds` of quiet (the allocator gives pages back lazily)."""
    time.sleep(seconds)
    return rss_kib(pid)


def measure_follows(proc, port, runs, follows, deadline):
    ids = finished_runs(port, runs, deadline)
    # Warm up every code path and the allocator once, then take the baseline.
    errors = follow_all(port, ids, len(ids) * 2, 8, deadline)
    base = settle(proc.pid)
    started = time.monotonic()
    errors += follow_all(port, ids, follows, 8, deadline)
    took = time.monotonic() - started
    right_after = rss_kib(proc.pid)
    after = settle(proc.pid)
    growth = (after - base) / base * 100
    print(f"follows of finished runs: {follows} follows of {runs} runs in {took:.1f} s, "
          f"{len(errors)} errors")
    print(f"  RSS baseline {base / 1024:.1f} MiB, right after {right_after / 1024:.1f} MiB, "
          f"settled {after / 1024:.1f} MiB: {growth:+.1f}% ({'within' if abs(growth) <= 5 else 'NOT within'} 5%)")
    for e in errors[:5]:
        print("  error:", e)
    return abs(growth) <= 5 and not errors


def measure_slow_headers(port, slow, header_timeout, deadline):
    head = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Slow: "
    sel = selectors.DefaultSelector()
    socks = {}
    opened = time.monotonic()
    for i in range(slow):
        # Non-blocking connects: every socket's clock starts now, not after the others.
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.connect_ex((HOST, port))
        # Every tenth sends nothing at all.
        socks[s] = {"i": i, "sent": 0, "silent": i % 10 == 0, "opened": time.monotonic(), "closed": None}
        sel.register(s, selectors.EVENT_READ)
    print(f"slow header senders: {slow} connections opened in {time.monotonic() - opened:.2f} s")
    latencies = []
    stop = threading.Event()

    def probe():
        while not stop.is_set():
            t = time.monotonic()
            try:
                conn = http.client.HTTPConnection(HOST, port, timeout=5)
                conn.request("GET", "/healthz")
                res = conn.getresponse()
                res.read()
                conn.close()
                if res.status == 200:
                    latencies.append((time.monotonic() - t) * 1000)
                else:
                    latencies.append(float("inf"))
            except OSError:
                latencies.append(float("inf"))
            time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    give_up = min(deadline, time.monotonic() + header_timeout * 3 + 5)
    next_byte = time.monotonic()
    open_left = len(socks)
    while open_left and time.monotonic() < give_up:
        now = time.monotonic()
        if now >= next_byte:
            next_byte = now + 0.1
            for s, st in socks.items():
                if st["closed"] is None and not st["silent"]:
                    byte = head[st["sent"]:st["sent"] + 1] or b"a"
                    try:
                        s.send(byte)
                        st["sent"] += 1
                    except (BlockingIOError, InterruptedError):
                        pass
                    except OSError as e:
                        if e.errno in (errno.ENOTCONN, errno.EAGAIN):
                            continue
                        st["closed"] = time.monotonic()
                        open_left -= 1
                        sel.unregister(s)
        for key, _ in sel.select(timeout=max(0.0, next_byte - time.monotonic())):
            s = key.fileobj
            st = socks[s]
            try:
                data = s.recv(4096)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data and st["closed"] is None:
                st["closed"] = time.monotonic()
                open_left -= 1
                sel.unregister(s)
    stop.set()
    prober.join()
    for s in socks:
        s.close()
    open_for = [st["closed"] - st["opened"] for st in socks.values() if st["closed"] is not None]
    finite = sorted(x for x in latencies if x != float("inf"))
    failed = len(latencies) - len(finite)
    q = statistics.quantiles(finite, n=100, method="inclusive") if len(finite) >= 2 else finite * 99
    print(f"  /healthz meanwhile: {len(latencies)} probes, p50 {q[49]:.1f} ms, p99 {q[98]:.1f} ms, "
          f"max {max(finite):.1f} ms, {failed} failed")
    print(f"  closed by the daemon: {len(open_for)} of {slow}; open for at most "
          f"{max(open_for):.2f} s (header_read_timeout {header_timeout} s), "
          f"median {statistics.median(open_for):.2f} s" if open_for else "  none closed")
    return len(open_for) == slow and max(open_for) <= header_timeout + 1.0 and max(finite) <= 100 and not failed


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", required=True, help="path of the agentd binary (a release build)")
    p.add_argument("--runs", type=int, default=200, help="finished runs to follow (max 2000)")
    p.add_argument("--follows", type=int, default=10000, help="SSE follows of finished runs (max 50000)")
    p.add_argument("--slow", type=int, default=1000, help="slow header senders (max 4000)")
    p.add_argument("--header-timeout", type=int, default=2, help="server.header_read_timeout, seconds")
    p.add_argument("--max-seconds", type=int, default=600, help="overall bound")
    a = p.parse_args()
    a.runs = max(1, min(a.runs, 2000))
    a.follows = max(1, min(a.follows, 50000))
    a.slow = max(1, min(a.slow, 4000))
    deadline = time.monotonic() + a.max_seconds
    with tempfile.TemporaryDirectory() as workdir:
        proc, port = start_daemon(a.binary, a.header_timeout, workdir)
        try:
            wait_ready(port)
            ok_follow = measure_follows(proc, port, a.runs, a.follows, deadline)
            ok_slow = measure_slow_headers(port, a.slow, a.header_timeout, deadline)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
    print("result:", "ok" if ok_follow and ok_slow else "NOT ok")
    return 0 if ok_follow and ok_slow else 1


if __name__ == "__main__":
    sys.exit(main())
