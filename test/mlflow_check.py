"""volt's MLFlowLogger against a real MLflow tracking server, read back with MLflow's Python client.

    python mlflow_check.py <mlflow_run>

Starts `mlflow server` (the pinned MLflow of scripts/install-python-tools.sh --mlflow) on 127.0.0.1 with a SQLite
store and an artifact folder in a temporary folder, behind gunicorn with an access log that records each request's
Authorization header, and runs the test program test/mlflow.cpp:

1. a reference fit without MLflow (its metrics.csv is what the others must log);
2. a fit with the logger and MLFLOW_TRACKING_TOKEN, 1500 metrics more in its first step and every checkpoint uploaded:
   the run FINISHED, each metric's history equal to the CSV logger's (NaN included), the 1500 metrics whole, the
   parameters equal to the saved configuration (hparams.yaml, flattened as Lightning does), the tags, each uploaded
   checkpoint equal to the file on disk; the token reached the server (access log) and is in no file the run wrote;
3. a fit stopped by SIGTERM (basic authentication from MLFLOW_TRACKING_USERNAME/PASSWORD) and resumed: KILLED, then
   the same run id FINISHED, the histories those of the reference run, the password in no file;
2b. a checkpoint (and its safetensors) every step, each pruned by the next save, behind a proxy that holds each
   upload 0.2 s: every file the saves wrote reached the server, no warning, no staged copy left;
5. no server at the URI, and a wrong path on the server: the fit fails at its start with one line naming the URI
   (the server's HTML page as one line); with continue_without_server, one warning and the fit as without MLflow;
4. the server hung (SIGSTOP) mid-fit, then killed (SIGKILL): each fit ends with the reference's metrics.csv, exit 0
   and one warning, within the stated bound of the retries (mlflow_client.hpp), plus a margin for a loaded machine.

Prints "mlflow ok" at the end. The server's process group and the temporary folder are removed in every case.
"""

import base64
import csv
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import yaml
from mlflow.tracking import MlflowClient

PROGRAM = sys.argv[1]
TOKEN = "volt-test-token-5f0c2a9d"
USER, PASSWORD = "volt-user", "volt-password-81e3b7"


def fail(msg):
    print("MISMATCH: " + msg)
    sys.exit(1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`mlflow server` in its own process group (the group is what gets signalled and removed). `start` starts it (on
    another free port when the one drawn was taken before the server bound it) and waits until it answers."""

    def __init__(self, root):
        self.root = root
        self.proc = None

    def start(self):
        for _ in range(3):
            self.launch()
            if self.ready():
                return
            self.stop()
        print(open(os.path.join(self.root, "server.out")).read()[-3000:])
        fail("the MLflow server did not start")

    def launch(self):
        root = self.root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.access_log = os.path.join(root, "access.log")
        gunicorn = f"--access-logfile {self.access_log} --access-logformat '%(m)s %(U)s %({{authorization}}i)s'"
        self.proc = subprocess.Popen(
            [os.path.join(os.path.dirname(sys.executable), "mlflow"), "server", "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", "sqlite:///" + os.path.join(root, "mlflow.db"),
             "--artifacts-destination", os.path.join(root, "artifacts"), "--gunicorn-opts", gunicorn],
            stdout=open(os.path.join(root, "server.out"), "w"), stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(os.environ, TMPDIR=root))  # its store's lock file (db_init_lock-*) goes with the folder
        self.pgid = self.proc.pid

    def ready(self):
        deadline = time.time() + 120
        while time.time() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(self.uri + "/health", timeout=2) as r:
                    if r.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.3)
        return False

    def group_alive(self):
        """Processes of the server's group other than zombies (a zombie is gone but for its parent's wait)."""
        alive = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                stat = open(f"/proc/{pid}/stat").read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == self.pgid and fields[0] != "Z":
                alive.append(int(pid))
        return alive

    def stop(self):
        if self.proc is None:
            return
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.proc = None
        # Every process of the group is gone (workers included), checked by its group id.
        deadline = time.time() + 10
        while self.group_alive() and time.time() < deadline:
            time.sleep(0.1)
        if self.group_alive():
            fail(f"processes {self.group_alive()} of the server's group {self.pgid} are still there")


class SlowProxy:
    """An HTTP proxy in front of the server that holds each artifact upload (PUT) `delay` seconds before passing it on,
    so that uploads are still waiting while the fit's next saves prune their files."""

    def __init__(self, target, delay):
        import http.server
        import threading
        import urllib.error

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # (answers curl's Expect: 100-continue)

            def log_message(self, *args):
                pass

            def forward(self):
                if "chunked" in self.headers.get("Transfer-Encoding", ""):
                    fail("an upload came without its length (chunked); the proxy passes sized bodies only")
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if self.command == "PUT":
                    time.sleep(delay)
                skip = ("host", "content-length", "connection", "expect", "transfer-encoding")
                headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                request = urllib.request.Request(target + self.path, data=body, method=self.command, headers=headers)
                try:
                    with urllib.request.urlopen(request, timeout=120) as r:
                        status, data, answer = r.status, r.read(), r.headers
                except urllib.error.HTTPError as e:
                    status, data, answer = e.code, e.read(), e.headers
                self.send_response(status)
                for k, v in answer.items():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = forward

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.uri = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


def run(args, env_extra, expect_rc=0):
    """Runs mlflow_run; its exit status must be `expect_rc` (None: any but 0)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(env_extra)
    start = time.time()
    p = subprocess.run([PROGRAM] + args, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.time() - start
    if (p.returncode == 0) if expect_rc is None else (p.returncode != expect_rc):
        print(p.stdout[-3000:], p.stderr[-3000:])
        want = "a failure" if expect_rc is None else expect_rc
        fail(f"mlflow_run {' '.join(args)} exited with {p.returncode}, expected {want}")
    run_id = ""
    for line in p.stdout.splitlines():
        if line.startswith("run id: "):
            run_id = line[len("run id: "):]
    return p, run_id, seconds


def read_csv(root):
    """{metric: [(step, value)]} from the CSV logger's metrics.csv under root (the one version there)."""
    versions = sorted(os.listdir(os.path.join(root, "volt_logs")))
    path = os.path.join(root, "volt_logs", versions[-1], "metrics.csv")
    out = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            for k, v in row.items():
                if k != "step" and v != "":
                    out.setdefault(k, []).append((step, float(v)))
    return out, os.path.dirname(path)


def same_value(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == b


def check_histories(client, run_id, expected, what):
    """Every metric of `expected` has exactly that history in the run; the run has no other metric."""
    logged = set(client.get_run(run_id).data.metrics)
    if logged != set(expected):
        fail(f"{what}: the run's metrics {sorted(logged - set(expected))[:5]} / the CSV's "
             f"{sorted(set(expected) - logged)[:5]} differ")
    for key, rows in expected.items():
        # MLflow's store keeps one of equal entries (same step, value and millisecond): the CSV's `epoch` at a step
        # of a training row and a validation row is one entry there. So the histories compare as sets.
        history = sorted({(m.step, "nan" if math.isnan(m.value) else m.value)
                          for m in client.get_metric_history(run_id, key)}, key=str)
        want = sorted({(s, "nan" if math.isnan(v) else v) for s, v in rows}, key=str)
        if history != want:
            extra = sorted(set(history) - set(want), key=str)[:4]
            missing = sorted(set(want) - set(history), key=str)[:4]
            fail(f"{what}: {key}'s history ({len(history)} entries) differs from the CSV's ({len(want)}): "
                 f"only in MLflow {extra}, only in the CSV {missing}")


def flatten(d, prefix=""):
    """Lightning's flattening of hyper-parameters, each value as Python's str writes it (a list as JSON)."""
    out = {}
    for k, v in d.items():
        name = f"{prefix}/{k}" if prefix else k
        if isinstance(v, dict):
            out.update(flatten(v, name))
        elif isinstance(v, list):
            out[name] = json.dumps(v, separators=(",", ":"))
        else:
            out[name] = str(v)
    return out


def files_containing(root, secret):
    hits = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                if secret.encode() in fh.read():
                    hits.append(os.path.join(dirpath, f))
    return hits


def warnings_of(stderr):
    return [line for line in stderr.splitlines() if "MLFlowLogger" in line]


def main():
    root = tempfile.mkdtemp(prefix="volt-mlflow-")
    server = None
    try:
        os.makedirs(os.path.join(root, "server"))
        server = Server(os.path.join(root, "server"))
        server.start()
        client = MlflowClient(tracking_uri=server.uri)
        common = ["--trainer.max_epochs=3"]

        ref_dir = os.path.join(root, "ref")
        _, _, ref_seconds = run(common + [f"--trainer.default_root_dir={ref_dir}", "--run.mlflow=false"], {})
        reference, _ = read_csv(ref_dir)

        # 2. A whole fit with a token, 1500 metrics more in its first step, each checkpoint uploaded.
        fit_dir = os.path.join(root, "fit")
        p, run_id, _ = run(common + [f"--trainer.default_root_dir={fit_dir}", "--run.wide=1500", "--run.experiment=fit"],
                           {"MLFLOW_TRACKING_URI": server.uri, "MLFLOW_TRACKING_TOKEN": TOKEN})
        if warnings_of(p.stderr):
            fail("a clean fit warned: " + "; ".join(warnings_of(p.stderr)))
        info = client.get_run(run_id)
        if info.info.status != "FINISHED":
            fail(f"the fit's run is {info.info.status}, not FINISHED")
        csv_metrics, log_dir = read_csv(fit_dir)
        if sum(k.startswith("wide/") for k in csv_metrics) != 1500:
            fail("the CSV does not hold the 1500 metrics")
        check_histories(client, run_id, csv_metrics, "fit")
        with open(os.path.join(log_dir, "hparams.yaml")) as f:
            params = flatten(yaml.safe_load(f))
        if info.data.params != params:
            diff = {k for k in set(params) | set(info.data.params) if params.get(k) != info.data.params.get(k)}
            fail(f"the run's parameters differ from hparams.yaml at {sorted(diff)[:6]}")
        if info.data.tags.get("suite") != "volt" or info.data.tags.get("mlflow.runName") != "regression":
            fail(f"tags: {info.data.tags}")
        uploaded = {os.path.basename(a.path) for a in client.list_artifacts(run_id, "checkpoints")}
        on_disk = set(os.listdir(os.path.join(fit_dir, "checkpoints")))
        if not on_disk <= uploaded or "last.ckpt" not in uploaded:
            fail(f"uploaded checkpoints {sorted(uploaded)} do not include those on disk {sorted(on_disk)}")
        for name in on_disk:
            got = client.download_artifacts(run_id, "checkpoints/" + name, os.path.join(root, "download"))
            if open(got, "rb").read() != open(os.path.join(fit_dir, "checkpoints", name), "rb").read():
                fail(f"the uploaded {name} differs from the file")
        if f"Bearer {TOKEN}" not in open(server.access_log).read():
            fail("the token did not reach the server")
        if files_containing(fit_dir, TOKEN):
            fail(f"the token is written in {files_containing(fit_dir, TOKEN)}")
        print(f"fit: FINISHED, {len(csv_metrics)} metrics' histories equal to the CSV's, {len(params)} parameters, "
              f"{len(on_disk)} checkpoints uploaded whole, the token sent and in no file")

        # 2b. A checkpoint every step (and its safetensors), each pruned by the next save, every upload held 0.2 s by
        # a proxy: every file a save wrote reaches the server (each staged until its upload ends), with no warning.
        slow_dir = os.path.join(root, "slow")
        proxy = SlowProxy(server.uri, 0.2)
        try:
            p, slow_id, _ = run(common + [f"--trainer.default_root_dir={slow_dir}", "--run.every_step=true",
                                          "--run.experiment=slow"], {"MLFLOW_TRACKING_URI": proxy.uri})
        finally:
            proxy.stop()
        if warnings_of(p.stderr):
            fail("the fit behind a slow server warned: " + "; ".join(warnings_of(p.stderr)))
        uploaded = {os.path.basename(a.path) for a in client.list_artifacts(slow_id, "checkpoints")}
        steps = 3 * 96 // 8  # 3 epochs of 12 batches
        want = {f"step={n}.{ext}" for n in range(1, steps + 1) for ext in ("ckpt", "safetensors")}
        want |= {"last.ckpt", "last.safetensors"}
        if want - uploaded:
            fail(f"{len(want - uploaded)} of the {len(want)} files the saves wrote did not reach the server: "
                 f"{sorted(want - uploaded)[:6]}")
        left = [f for f in os.listdir(os.path.join(slow_dir, "checkpoints")) if ".tmp." in f]
        if left:
            fail(f"staged uploads are left in the checkpoint folder: {left[:4]}")
        on_disk = sorted(os.listdir(os.path.join(slow_dir, "checkpoints")))
        print(f"every step's checkpoint behind uploads held 0.2 s: all {len(want)} files the saves wrote reached the "
              f"server ({len(on_disk)} left on disk: {on_disk}), no warning, no staged copy left")

        # 3. Stopped by SIGTERM at step 17 and resumed: one run, KILLED then FINISHED, the reference's histories.
        stop_dir = os.path.join(root, "stop")
        auth = {"MLFLOW_TRACKING_URI": server.uri, "MLFLOW_TRACKING_USERNAME": USER, "MLFLOW_TRACKING_PASSWORD": PASSWORD}
        args = common + [f"--trainer.default_root_dir={stop_dir}", "--run.experiment=stop"]
        run(args + ["--run.stop_at=17"], auth, expect_rc=143)  # the process ends with the signal: no id printed
        runs = client.search_runs([client.get_experiment_by_name("stop").experiment_id])
        if len(runs) != 1 or runs[0].info.status != "KILLED":
            fail(f"the stopped fit left {[(r.info.run_id, r.info.status) for r in runs]}, not one KILLED run")
        first_id = runs[0].info.run_id
        _, second_id, _ = run(args + ["--run.resume=true"], auth)
        if second_id != first_id:
            fail(f"the resumed fit logged to run {second_id}, not {first_id}")
        if client.get_run(first_id).info.status != "FINISHED":
            fail("the resumed run did not finish")
        runs = client.search_runs([client.get_experiment_by_name("stop").experiment_id])
        if len(runs) != 1:
            fail(f"the experiment holds {len(runs)} runs")
        check_histories(client, first_id, reference, "stopped and resumed")
        basic = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        if basic not in open(server.access_log).read():
            fail("the user name and password did not reach the server")
        if files_containing(stop_dir, PASSWORD):
            fail(f"the password is written in {files_containing(stop_dir, PASSWORD)}")
        print(f"stopped at step 17 (KILLED) and resumed: run {first_id} FINISHED, histories equal to the reference's")

        # 5. No server at the URI, or a wrong path on it: the fit fails as it starts, in one line naming the URI (the
        # server's HTML page as one line); with continue_without_server, one warning and the fit as without MLflow.
        nobody = f"http://127.0.0.1:{free_port()}"
        d = os.path.join(root, "nobody")
        p, _, _ = run(common + [f"--trainer.default_root_dir={d}", "--run.timeout=1"], {"MLFLOW_TRACKING_URI": nobody},
                      expect_rc=None)
        said = [line for line in p.stderr.splitlines() if "MLFlowLogger" in line]
        if len(said) != 1 or f"the run could not be opened at {nobody}" not in said[0] or "does not start" not in said[0]:
            fail(f"no server at {nobody}: said {said}")
        wrong = server.uri + "/no/such/prefix"
        p, _, _ = run(common + [f"--trainer.default_root_dir={os.path.join(root, 'wrong')}"],
                      {"MLFLOW_TRACKING_URI": wrong}, expect_rc=None)
        said = [line for line in p.stderr.splitlines() if "MLFlowLogger" in line]
        if len(said) != 1 or "Not Found" not in said[0] or "<" in said[0] or wrong not in said[0]:
            fail(f"a wrong path ({wrong}): said {said}")
        d = os.path.join(root, "nobody-on")
        p, _, _ = run(common + [f"--trainer.default_root_dir={d}", "--run.timeout=1",
                                "--run.continue_without_server=true"], {"MLFLOW_TRACKING_URI": nobody})
        if len(warnings_of(p.stderr)) != 1 or "gave no answer" not in warnings_of(p.stderr)[0]:
            fail(f"continue_without_server: warnings {warnings_of(p.stderr)}")
        got, _ = read_csv(d)
        if got.keys() != reference.keys():
            fail("continue_without_server: the fit's metrics.csv is not the reference's")
        print(f"no server at the URI, or a wrong path on it: the fit fails at its start in one line naming the URI; "
              f"with continue_without_server, one warning and the reference's metrics")

        # 4. The server hung, then killed, mid-fit: the fits end as without the logger, with one warning.
        bounds = {"STOP": 4 * 1.0 + 3.5, "KILL": 3.5}  # (retries + 1) x timeout + backoffs; refused: backoffs
        for sig in ("STOP", "KILL"):
            d = os.path.join(root, "freeze-" + sig)
            p, _, seconds = run(common + [f"--trainer.default_root_dir={d}", "--run.timeout=1",
                                          f"--run.freeze_group={server.pgid}", "--run.freeze_at=10",
                                          f"--run.freeze_signal={sig}", "--run.experiment=freeze-" + sig],
                                {"MLFLOW_TRACKING_URI": server.uri})
            warned = warnings_of(p.stderr)
            if len(warned) != 1 or "gave no answer" not in warned[0]:
                fail(f"server {sig}: warnings {warned}")
            got, _ = read_csv(d)
            if got != reference and not all(len(got[k]) == len(reference[k]) and all(
                    g[0] == r[0] and same_value(g[1], r[1]) for g, r in zip(got[k], reference[k])) for k in reference):
                fail(f"server {sig}: the fit's metrics differ from the reference's")
            extra = seconds - ref_seconds
            if extra > bounds[sig] + 30:
                fail(f"server {sig}: the fit took {extra:.1f} s longer than without MLflow (bound {bounds[sig]} s + 30)")
            print(f"server {sig} at step 10: the fit ended as without the logger, one warning, {extra:+.1f} s "
                  f"against the reference (bound {bounds[sig]} s)")
            if sig == "STOP":
                os.killpg(server.pgid, signal.SIGCONT)
        print("mlflow ok")
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
        if os.path.exists(root) and sys.exc_info()[0] is None:
            fail(f"{root} is still there")


if __name__ == "__main__":
    main()
