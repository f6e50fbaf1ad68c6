"""1 MiB of newlines posted as JSON Lines to a real `serve` while `/ping` is polled every 20 ms: status,
seconds, slowest /ping, growth of the process's peak RSS (VmHWM), answer bytes. One JSON line out.

    PYTHONPATH=container .venv/bin/python tools/bench_jsonl_lines.py
    PYTHONPATH=container .venv/bin/python tools/bench_jsonl_lines.py SEMIF_MAX_JSONL_RECORDS=1048576

Arguments are extra SEMIF_* settings for the server; PYTHONPATH picks the checkout whose code it runs.
"""
import os, sys, tempfile, time, threading, json
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "tests"))
import httpx
from serving import ServeProcess, embedded_model, free_port
from pathlib import Path

def rss_kib(pid, key):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(key):
            return int(line.split()[1])

extra = dict(a.split("=", 1) for a in sys.argv[1:])
port = free_port()
env = {k: v for k, v in os.environ.items() if not k.startswith("SEMIF_")}
env.update(SEMIF_HOST="127.0.0.1", SEMIF_PORT=str(port), SEMIF_MODEL_PATH=str(embedded_model()),
           SEMIF_MODEL_DIR=os.path.join(tempfile.gettempdir(), "no-model-dir"), SEMIF_N_THREADS="1", **extra)
proc = ServeProcess(env, port, Path(tempfile.gettempdir()) / f"serve-{port}.log").wait_ready()
try:
    pid = proc.proc.pid
    before = rss_kib(pid, "VmRSS:")
    lat, stop = [], threading.Event()
    def ping():
        with httpx.Client(base_url=proc.base_url, timeout=60) as c:
            while not stop.is_set():
                t = time.perf_counter(); c.get("/ping"); lat.append(time.perf_counter() - t); time.sleep(0.02)
    th = threading.Thread(target=ping); th.start(); time.sleep(0.2)
    t = time.perf_counter()
    r = httpx.post(proc.base_url + "/invocations", content=b"\n" * (1 << 20), timeout=600,
                   headers={"content-type": "application/jsonlines"})
    took = time.perf_counter() - t
    stop.set(); th.join()
    peak = rss_kib(pid, "VmHWM:")
    print(json.dumps({"env": extra, "status": r.status_code, "seconds": round(took, 2), "worst_ping_s": round(max(lat), 3),
                      "peak_rss_growth_mib": round((peak - before) / 1024, 1), "answer_bytes": len(r.content)}))
finally:
    proc.stop()
