"""Figures for docs/reliability.md, items 5, 6 and 10 (issue 11).

Starts the given lazaret binary on a temporary data directory and prints
what it does with long and control-character names, `payload: null`,
`limit=0`, 5,000 random types and lanes (metric series), one batch of
5,000 poison jobs naming 5,000 tenants (admission records), a request
nested 200 deep (its audit entry) and 1,100 denied calls after a purge
(whether the purge is still in view). Run it on an old and a new build:

    python3 docs/reliability_figures.py target/debug/lazaret

Needs `requests`.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import requests

BIN = sys.argv[1]
d = tempfile.mkdtemp()
cfg = os.path.join(d, "c.toml")
open(cfg, "w").write('''
payload_bytes_max = 64
[[tokens]]
name = "root"
role = "admin"
token = "tok-admin-0123456789"
[[tokens]]
name = "prod"
role = "producer"
token = "tok-prod-0123456789"
[[tokens]]
name = "work"
role = "worker"
token = "tok-work-0123456789"
''')
p = subprocess.Popen([BIN, "serve", "--listen", "127.0.0.1:0", "--data", os.path.join(d, "data"), "--config", cfg], stdout=subprocess.PIPE, stderr=open(os.path.join(d,"err"),"w"))
base = p.stdout.readline().decode().split("on ")[1].strip()
time.sleep(0.3)
A = {"Authorization": "Bearer tok-admin-0123456789"}
P = {"Authorization": "Bearer tok-prod-0123456789"}
W = {"Authorization": "Bearer tok-work-0123456789"}
s = requests.Session()
def post(path, body, h=A, raw=None):
    return s.post(base+path, data=raw if raw is not None else json.dumps(body), headers={**h, "content-type":"application/json"})
res = {}
big = "x"*10_000
huge = "x"*1_000_000
r = post("/v1/jobs", {"type": "t", "tenant": big, "payload": {}}, P); res["enqueue 10KB tenant"] = r.status_code
r = post("/v1/jobs", {"type": big, "tenant": "a", "payload": {}}, P); res["enqueue 10KB type"] = r.status_code
r = post("/v1/jobs", {"type": "t", "tenant": "a\u0000b", "payload": {}}, P); res["enqueue NUL tenant"] = r.status_code
r = post("/v1/jobs", {"type": "t", "tenant": "a", "idempotency_key": big, "payload": {}}, P); res["enqueue 10KB idem key"] = r.status_code
r = post("/v1/leases", {"worker_id": huge, "max_jobs": 1, "lease_ms": 30000}, W); res["lease 10KB worker_id"] = r.status_code
r = post("/v1/jobs", {"type": "t", "tenant": "a", "payload": None}, P); res["payload null"] = (r.status_code, r.text[:150])
r = s.get(base+"/v1/dead-letters?limit=0", headers=A); res["dead-letters limit=0"] = r.status_code
r = s.get(base+"/v1/audit?limit=0", headers=A); res["audit limit=0"] = r.status_code
# metrics series for 5000 random types and lanes
jobs = [{"type": "ty%d" % i, "tenant": "a", "lane": "ln%d" % i, "payload": {}} for i in range(5000)]
r = post("/v1/jobs/batch", {"jobs": jobs}, P); res["batch 5000 types"] = r.status_code
m = s.get(base+"/metrics").text
res["enqueued_total series"] = sum(1 for l in m.splitlines() if l.startswith("lazaret_jobs_enqueued_total{"))
res["queue_depth series"] = sum(1 for l in m.splitlines() if l.startswith("lazaret_queue_depth{"))
# admission records across tenants
jobs = [{"type": "t", "tenant": "ten%d" % i, "payload": {"x": "y"*100}} for i in range(5000)]
r = post("/v1/jobs/batch", {"jobs": jobs}, P)
n = 0; cur = None
while True:
    q = "/v1/dead-letters?stage=admission&limit=1000" + ("&cursor="+cur if cur else "")
    j = s.get(base+q, headers=A).json(); n += len(j["items"]); cur = j["next_cursor"]
    if not cur: break
res["admission records from one 5000-tenant batch"] = n
# deep pause request
deep = '{"type": "zz", "junk": ' + "["*200 + "]"*200 + "}"
r = post("/v1/pause", None, A, raw=deep); res["deep pause"] = r.status_code
a = s.get(base+"/v1/audit?limit=5", headers=A).json()
res["deep pause audit request"] = [e["request"] for e in a["items"] if e["action"]=="pause"][:1]
# audit: purge then 1100 denied
post("/v1/dead-letters/purge", {"filter": {"reason": "payload_too_large"}, "confirm": True}, A)
for i in range(1100):
    s.get(base+"/v1/audit", headers=P)
a = s.get(base+"/v1/audit?limit=1000", headers=A).json()
res["audit items (limit=1000)"] = len(a["items"]); res["purge visible"] = any(e["action"]=="purge" for e in a["items"]); res["audit next_cursor key"] = "next_cursor" in a
p.terminate(); p.wait()
shutil.rmtree(d, ignore_errors=True)
for k,v in res.items(): print(k, "=>", v)
