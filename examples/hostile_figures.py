#!/usr/bin/env python3
"""Before/after figures of docs/reliability.md ("Connections", "Shutdown").

Runs one `lazaret serve` binary (default config unless --config) against
hostile clients and prints what it measured, as JSON:

    python3 examples/hostile_figures.py target/debug/lazaret

Standard library only. Linux only (/proc). Each scenario starts its own
server on 127.0.0.1 with a fresh data directory.
"""

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

TOKEN = "tok-admin-0123456789"


def start(binary, config="", nofile=None):
    d = tempfile.mkdtemp()
    cfg = os.path.join(d, "lazaret.toml")
    with open(cfg, "w") as f:
        f.write(config)
    p = subprocess.Popen(
        [binary, "serve", "--listen", "127.0.0.1:0", "--data", os.path.join(d, "data"), "--config", cfg],
        stdout=subprocess.PIPE, stderr=open(os.path.join(d, "err.log"), "w"), text=True,
        preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None)
    line = p.stdout.readline()
    base = line.strip().split("listening on ")[1]
    threading.Thread(target=lambda: p.stdout.read(), daemon=True).start()
    host, port = base.removeprefix("http://").split(":")
    return p, (host, int(port)), base


def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def get(base, path, timeout=5, token=None):
    req = urllib.request.Request(base + path)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception as e:  # noqa: BLE001 - a figure, not a test
        return f"failed: {type(e).__name__}"


def read_reply(s, wait):
    s.settimeout(wait)
    buf = b""
    try:
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                return ("closed", buf[:40].decode(errors="replace"))
            buf += chunk
        return ("reply", buf.split(b"\r\n")[0].decode())
    except socket.timeout:
        return ("open", None)
    except OSError as e:
        return ("closed", str(e))


def idle_then_normal_nofile_256(binary):
    """300 idle sockets against a server whose open-file limit is 256."""
    p, addr, base = start(binary, nofile=256)
    socks = [socket.create_connection(addr) for _ in range(300)]
    out = {"normal_request_with_300_idle": get(base, "/v1/stats"), "fds_with_300_idle": fds(p.pid)}
    time.sleep(1)
    out["normal_request_1s_later"] = get(base, "/v1/stats")
    p.kill()
    return out


def idle_then_normal(binary):
    p, addr, base = start(binary)
    socks = [socket.create_connection(addr) for _ in range(300)]
    status = get(base, "/v1/stats")
    out = {"normal_request_with_300_idle": status, "fds_with_300_idle": fds(p.pid)}
    t0 = time.time()
    closed = 0
    deadline = t0 + 90
    for s in socks:
        kind, _ = read_reply(s, max(0.01, deadline - time.time()))
        closed += kind == "closed"
    out["idle_closed_by_server_within_90s"] = closed
    p.kill()
    return out


def host_of(base):
    """The server's own address, the Host a tokenless server answers."""
    return base.removeprefix("http://").encode()


def slowloris(binary):
    p, addr, base = start(binary)
    socks = []
    for _ in range(500):
        s = socket.create_connection(addr)
        s.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: " + host_of(base) + b"\r\nX-Slow: a")
        socks.append(s)
    stop = time.time() + 30
    # A byte every second to each, for 30 s at most, until the server cuts them.
    open_socks = list(socks)
    while open_socks and time.time() < stop:
        still = []
        for s in open_socks:
            try:
                s.sendall(b"a")
                s.setblocking(False)
                try:
                    if s.recv(1) == b"":
                        continue
                except BlockingIOError:
                    pass
                finally:
                    s.setblocking(True)
                still.append(s)
            except OSError:
                pass
        open_socks = still
        time.sleep(1)
    out = {"slowloris_500_still_open_after_30s": len(open_socks), "fds": fds(p.pid),
           "normal_request": get(base, "/v1/stats")}
    p.kill()
    return out


def unauthenticated_bodies(binary):
    config = f'[[tokens]]\nname = "root"\nrole = "admin"\ntoken = "{TOKEN}"\n'
    p, addr, base = start(binary, config)
    before = rss_kib(p.pid)
    peak = [before]
    statuses = {}
    lock = threading.Lock()

    def one(i):
        s = socket.create_connection(addr)
        body_len = 2 * 1024 * 1024
        s.sendall(f"POST /v1/leases HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {body_len}\r\n\r\n".encode())
        chunk = b"x" * 65536
        sent = 0
        try:
            while sent < body_len:
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass
        kind, line = read_reply(s, 30)
        with lock:
            statuses[line] = statuses.get(line, 0) + 1
            peak[0] = max(peak[0], rss_kib(p.pid))
        s.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = {"rss_kib_before": before, "rss_kib_peak": peak[0], "rss_kib_after": rss_kib(p.pid),
           "replies": statuses}
    p.kill()
    return out


def traceback_3mb(binary):
    p, addr, base = start(binary)

    def post(path, body):
        req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, e.read()[:120].decode(errors="replace")

    post("/v1/jobs", {"type": "t", "tenant": "a", "payload": {}})
    _, leased = post("/v1/leases", {"worker_id": "w", "max_jobs": 1})
    j = leased["jobs"][0]
    status, body = post(f"/v1/jobs/{j['id']}/fail",
                        {"lease_token": j["lease_token"], "error": {"kind": "boom", "traceback": "x" * 3_000_000}})
    p.kill()
    return {"fail_with_3mb_traceback": status, "reply": body if status != 200 else "ok"}


def half_closed(binary):
    p, addr, base = start(binary)
    body = json.dumps({"type": "t", "tenant": "a", "payload": {}}).encode()
    s = socket.create_connection(addr)
    s.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: " + host_of(base) + b"\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    s.shutdown(socket.SHUT_WR)
    kind, line = read_reply(s, 10)
    time.sleep(0.5)
    # The first job's id is 1: 200 if the enqueue was committed.
    committed = get(base, "/v1/jobs/1")
    p.kill()
    return {"half_closed_enqueue": kind, "status_line": line, "get_job_1_after": committed}


def sigterm(binary, what):
    p, addr, base = start(binary)
    keep = []
    if what == "partial_request":
        s = socket.create_connection(addr)
        s.sendall(b"POST /v1/leases HTTP/1.1\r\nHost: " + host_of(base) + b"\r\nContent-Length: 50\r\n\r\n{")
        keep.append(s)
        time.sleep(0.5)
    elif what == "partial_head":
        s = socket.create_connection(addr)
        s.sendall(b"POST /v1/leases HTTP/1.1\r\nHost: " + host_of(base) + b"\r\nContent-Le")
        keep.append(s)
        time.sleep(0.5)
    elif what == "long_poll_60s":
        s = socket.create_connection(addr)
        body = b'{"worker_id": "w", "wait_ms": 60000}'
        s.sendall(b"POST /v1/leases HTTP/1.1\r\nHost: " + host_of(base) + b"\r\nContent-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        keep.append(s)
        time.sleep(0.5)
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=75)
        took = round(time.time() - t0, 2)
    except subprocess.TimeoutExpired:
        p.kill()
        took = "still running after 75 s"
    reply = read_reply(keep[0], 1)[1] if what == "long_poll_60s" else None
    return {f"sigterm_with_{what}_exit_s": took, "poll_reply": reply}


def main():
    binary = sys.argv[1]
    only = set(sys.argv[2:])
    for f in (idle_then_normal_nofile_256, idle_then_normal, slowloris, unauthenticated_bodies,
              traceback_3mb, half_closed):
        if not only or f.__name__ in only:
            print(json.dumps({f.__name__: f(binary)}), flush=True)
    for what in ("partial_request", "partial_head", "long_poll_60s"):
        if not only or what in only:
            print(json.dumps(sigterm(binary, what)), flush=True)


if __name__ == "__main__":
    main()
