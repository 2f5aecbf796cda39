"""A test-only "kubelet": runs each pod's containers as local processes.

There is no container runtime in the test environment, so this agent stands in for the kubelet
of one node (``--node-name``). It registers a Ready Node and keeps its status and Lease fresh,
binds unscheduled pods to that node (Binding subresource; there is no scheduler), and for every
pod on the node runs each container's ``command`` + ``args`` (image and entrypoint are ignored;
``$(VAR)`` references are expanded) with the pod's env, ``envFrom``, ``workingDir`` and volumes.

Volumes (configMap, secret, projected: serviceAccountToken/configMap/secret/downwardAPI,
downwardAPI, emptyDir, hostPath) are materialised under ``<workdir>/<ns>_<pod>_<uid>/volumes``.
Service-account tokens come from the TokenRequest API, bound to the pod. Each container runs in
its own mount namespace (``unshare --mount --propagation private``) in which every volume is
bind-mounted on its ``mountPath`` -- so ``/var/run/secrets/kubernetes.io/serviceaccount`` and
``/dev/termination-log`` are per pod, and in-cluster config works with
``KUBERNETES_SERVICE_HOST=127.0.0.1`` / ``KUBERNETES_SERVICE_PORT=<apiserver port>``. Mount points
that do not exist are created (empty) on the host first. If ``unshare`` is not permitted (or
``--no-mount-ns``), volumes are not mounted: the process gets ``KUBECONFIG`` pointing at a per-pod
kubeconfig built from the pod's token and CA and ``WEIGHTSYNC_VOLUMES`` naming the volume dir.
Host paths given with ``--image-path`` (the project checkout and its venv) stand for the image's
content: they stay visible in every container even where a volume is mounted on a parent (the
chart's pods mount an emptyDir on ``/tmp``, which would hide a checkout under ``/tmp``).

Status is reported like a kubelet: phase, conditions, container states, exit codes,
termination messages (``terminationMessagePath``, or the log tail for
``FallbackToLogsOnError``), restart counts, podIP 127.0.0.1 (the node's processes share its
network, like ``hostNetwork`` pods); a pod annotated ``OWN_IP_ANNOTATION: "true"`` gets an address
of its own instead, 127.0.0.N (all of 127/8 is the loopback device), as pods of a real node do:
the replicas of one Deployment can then listen on the same port, each on its ``status.podIP``
(``$(POD_IP)`` from the downward API). ``restartPolicy`` is honoured with a short backoff. A
container with a ``readinessProbe`` (``httpGet`` or ``tcpSocket``, on the pod IP) is Ready only
once the probe passes (``initialDelaySeconds``, ``periodSeconds``
capped at 2 s, ``timeoutSeconds``, ``failureThreshold``): a pod whose server is still starting
stays out of the Ready pods a selector finds. Other probe kinds (``exec``, ``grpc``) and
liveness/startup probes are not run: such a container is Ready while it runs. When a pod gets a
deletionTimestamp its process groups get SIGTERM, then SIGKILL after
``terminationGracePeriodSeconds`` (capped at 3 s), and the pod is deleted with grace 0.
Logs go to ``<pod dir>/logs/<container>.log``; see ``pod_logs()``.

    python tests/k8s/node_agent.py --kubeconfig K --node-name N --path-prefix DIR --workdir W
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as dt
import json
import os
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
NODE_IP = "127.0.0.1"
OWN_IP_ANNOTATION = "node-agent.weightsync.test/own-pod-ip"
"""A pod annotated with it ("true") gets a loopback address of its own (`NodeAgent.own_ip`)."""
Obj = dict[str, Any]


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod_logs(workdir: Path | str, namespace: str, pod: str, container: str | None = None) -> str:
    """Logs of the newest pod ``namespace/pod`` run by an agent with this workdir."""
    dirs = sorted(Path(workdir).glob(f"{namespace}_{pod}_*"), key=lambda p: p.stat().st_mtime)
    if not dirs:
        raise FileNotFoundError(f"no pod {namespace}/{pod} under {workdir}")
    logs = sorted((dirs[-1] / "logs").glob(f"{container or '*'}.log"))
    return "".join(p.read_text(errors="replace") for p in logs)


class Api:
    """Thin JSON-over-HTTP wrapper around the kubernetes client's ApiClient."""

    def __init__(self, kubeconfig: str) -> None:
        self.client = config.new_client_from_config(config_file=kubeconfig)
        self.core = client.CoreV1Api(self.client)
        self.server: str = self.client.configuration.host
        self.ca: str = self.client.configuration.ssl_ca_cert

    def __call__(self, method: str, path: str, body: Any = None, merge: bool = False) -> Any:
        ctype = "application/merge-patch+json" if merge else "application/json"
        headers = {"Content-Type": ctype, "Accept": "application/json"}
        method, url, headers, body, _ = self.client.param_serialize(
            method, path, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        resp = self.client.call_api(method, url, header_params=headers, body=body, _request_timeout=30)
        data = resp.read()
        if not 200 <= resp.status < 300:
            raise ApiException(status=resp.status, reason=resp.reason, body=data.decode(errors="replace"))
        return json.loads(data) if data else None


class PodRunner(threading.Thread):
    """Runs one pod: prepares volumes, runs init containers then containers, reports status."""

    def __init__(self, agent: NodeAgent, pod: Obj) -> None:
        super().__init__(daemon=True, name=f"pod-{pod['metadata']['name']}")
        self.agent, self.pod, self.api = agent, pod, agent.api
        md = pod["metadata"]
        self.ns, self.name, self.uid = md["namespace"], md["name"], md["uid"]
        self.dir = agent.workdir / f"{self.ns}_{self.name}_{self.uid[:8]}"
        self.deleting = threading.Event()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.statuses: dict[str, Obj] = {}
        self.probes: dict[str, Probe] = {}
        self.init_statuses: dict[str, Obj] = {}
        self.phase, self.initialized, self.start_time = "Pending", False, now()
        own = md.get("annotations", {}).get(OWN_IP_ANNOTATION) == "true"
        self.ip = agent.own_ip() if own else NODE_IP

    # --------------------------------------------------------------------- lifecycle
    def run(self) -> None:
        try:
            self._run()
        except Exception as e:
            print(f"node-agent: pod {self.ns}/{self.name}: {e!r}", flush=True)
        if self.deleting.is_set():
            self._kill_all()
            self._ignore_404(
                "DELETE",
                f"/api/v1/namespaces/{self.ns}/pods/{self.name}",
                {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}},
            )

    def _run(self) -> None:
        spec = self.pod["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            self.statuses[c["name"]] = self._waiting(c, "ContainerCreating")
        self._report()
        while not self._prepare():
            if self.deleting.wait(1.0):
                return
        for c in spec.get("initContainers", []):
            while not self.deleting.is_set():
                if self._run_to_completion(c) == 0:
                    break
                if spec.get("restartPolicy", "Always") == "Never":
                    self.phase = "Failed"
                    return self._report()
                self.deleting.wait(1.0)
        self.initialized = True
        ctrs = spec["containers"]
        for c in ctrs:
            self._start(c)
        self._report()
        policy, backoff = spec.get("restartPolicy", "Always"), {c["name"]: 0.5 for c in ctrs}
        restart_at: dict[str, float] = {}
        while not self.deleting.wait(0.2):
            changed = False
            for c in ctrs:
                n = c["name"]
                proc = self.procs.get(n)
                if proc is not None and proc.poll() is not None:
                    code = self._finish(c, proc)
                    changed = True
                    if policy == "Always" or (policy == "OnFailure" and code != 0):
                        restart_at[n] = time.monotonic() + backoff[n]
                        backoff[n] = min(backoff[n] * 2, 5.0)
                if proc is None and n not in restart_at and "waiting" in self.statuses[n]["state"]:
                    if self.deleting.wait(1.0):  # CreateContainerConfigError: try again
                        return
                    before = self.statuses[n]["state"]
                    self._start(c)
                    changed = changed or self.statuses[n]["state"] != before
                if n in restart_at and time.monotonic() >= restart_at[n]:
                    del restart_at[n]
                    last = self.statuses[n]["state"]
                    self._start(c)
                    self.statuses[n]["restartCount"] += 1
                    self.statuses[n]["lastState"] = last
                    changed = True
            changed = self._probe() or changed
            waiting = any("waiting" in self.statuses[c["name"]]["state"] for c in ctrs)
            if not self.procs and not restart_at and not waiting:
                codes = [s["state"]["terminated"]["exitCode"] for s in self.statuses.values()]
                self.phase = "Succeeded" if all(x == 0 for x in codes) else "Failed"
                return self._report()
            if changed:
                self._report()

    def stop(self) -> None:
        self.deleting.set()

    # --------------------------------------------------------------------- volumes
    def _prepare(self) -> bool:
        """Materialise volumes; False while a referenced object is missing (retry)."""
        vdir = self.dir / "volumes"
        shutil.rmtree(vdir, ignore_errors=True)
        for d in ("logs", "term", "volumes"):
            (self.dir / d).mkdir(parents=True, exist_ok=True)
        try:
            for vol in self.pod["spec"].get("volumes", []):
                self._volume(vol, vdir / vol["name"])
        except LookupError as e:
            print(f"node-agent: pod {self.ns}/{self.name} waiting: {e}", flush=True)
            return False
        kc = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "pod",
            "clusters": [{"name": "c", "cluster": {"server": self.api.server}}],
            "users": [{"name": "u", "user": {}}],
            "contexts": [{"name": "pod", "context": {"cluster": "c", "user": "u"}}],
        }
        for c in self.pod["spec"]["containers"]:
            for m in c.get("volumeMounts", []):
                if m["mountPath"] == SA_DIR:
                    src = vdir / m["name"]
                    kc["clusters"][0]["cluster"]["certificate-authority"] = str(src / "ca.crt")
                    kc["users"][0]["user"]["tokenFile"] = str(src / "token")
        (self.dir / "kubeconfig").write_text(json.dumps(kc))
        return True

    def _volume(self, vol: Obj, dest: Path) -> None:
        dest.mkdir(parents=True, exist_ok=True)
        if "hostPath" in vol:
            dest.rmdir()
            dest.symlink_to(vol["hostPath"]["path"])
        elif "configMap" in vol or "secret" in vol:
            self._keys(vol.get("configMap") or vol["secret"], "secret" in vol, dest)
        elif "downwardAPI" in vol:
            self._downward(vol["downwardAPI"].get("items", []), dest)
        elif "projected" in vol:
            for src in vol["projected"].get("sources", []):
                if "serviceAccountToken" in src:
                    t = src["serviceAccountToken"]
                    self._write(dest / t["path"], self._token(t).encode())
                elif "configMap" in src or "secret" in src:
                    self._keys(src.get("configMap") or src["secret"], "secret" in src, dest)
                elif "downwardAPI" in src:
                    self._downward(src["downwardAPI"].get("items", []), dest)

    def _keys(self, ref: Obj, secret: bool, dest: Path) -> None:
        name = ref.get("name") or ref.get("secretName")
        try:
            data = self._data("secrets" if secret else "configmaps", name)
        except LookupError:
            if ref.get("optional"):
                return
            raise
        items = ref.get("items") or [{"key": k, "path": k} for k in data]
        for it in items:
            if it["key"] in data:
                self._write(dest / it["path"], data[it["key"]])
            elif not ref.get("optional"):
                raise LookupError(f"key {it['key']} not in {name}")

    def _data(self, kind: str, name: str) -> dict[str, bytes]:
        try:
            obj = self.api("GET", f"/api/v1/namespaces/{self.ns}/{kind}/{name}")
        except ApiException as e:
            if e.status == 404:
                raise LookupError(f"{kind}/{name} not found") from None
            raise
        out = {k: base64.b64decode(v) for k, v in obj.get("binaryData", {}).items()}
        if kind == "secrets":
            out.update({k: base64.b64decode(v) for k, v in obj.get("data", {}).items()})
        else:
            out.update({k: v.encode() for k, v in obj.get("data", {}).items()})
        return out

    def _downward(self, items: list[Obj], dest: Path) -> None:
        for it in items:
            if "fieldRef" in it:
                self._write(dest / it["path"], self._field(it["fieldRef"]["fieldPath"]).encode())

    def _field(self, path: str) -> str:
        md, spec = self.pod["metadata"], self.pod["spec"]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return str(md.get(m[1], {}).get(m[2], ""))
        if path in ("metadata.labels", "metadata.annotations"):
            kv = md.get(path.split(".")[1], {})
            return "\n".join(f'{k}="{v}"' for k, v in sorted(kv.items()))
        simple = {
            "metadata.name": self.name,
            "metadata.namespace": self.ns,
            "metadata.uid": self.uid,
            "spec.nodeName": self.agent.node,
            "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
            "status.podIP": self.ip,
            "status.hostIP": NODE_IP,
        }
        return simple.get(path, "")

    def _token(self, src: Obj) -> str:
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        spec: Obj = {
            "expirationSeconds": src.get("expirationSeconds", 3600),
            "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": self.name, "uid": self.uid},
        }
        if src.get("audience"):
            spec["audiences"] = [src["audience"]]
        path = f"/api/v1/namespaces/{self.ns}/serviceaccounts/{sa}/token"
        try:
            tr = self.api(
                "POST", path, {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
            )
        except ApiException as e:
            if e.status == 404:
                raise LookupError(f"serviceaccount {sa} not found") from None
            raise
        return str(tr["status"]["token"])

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    # --------------------------------------------------------------------- processes
    def _env(self, c: Obj) -> dict[str, str]:
        env = {
            "PATH": self.agent.path,
            "HOME": str(self.dir),
            "HOSTNAME": self.name,
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(self.agent.port),
        }
        if not self.agent.mount_ns:
            env["KUBECONFIG"] = str(self.dir / "kubeconfig")
            env["WEIGHTSYNC_VOLUMES"] = str(self.dir / "volumes")
        for ef in c.get("envFrom", []):
            ref = ef.get("configMapRef") or ef.get("secretRef")
            try:
                data = self._data("secrets" if "secretRef" in ef else "configmaps", ref["name"])
            except LookupError:
                if not ref.get("optional"):
                    raise
                data = {}
            env.update({ef.get("prefix", "") + k: v.decode() for k, v in data.items()})
        for e in c.get("env", []):
            vf = e.get("valueFrom")
            if vf is None:
                env[e["name"]] = _expand(e.get("value", ""), env)
            elif "fieldRef" in vf:
                env[e["name"]] = self._field(vf["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in vf or "configMapKeyRef" in vf:
                ref = vf.get("secretKeyRef") or vf["configMapKeyRef"]
                kind = "secrets" if "secretKeyRef" in vf else "configmaps"
                try:
                    env[e["name"]] = self._data(kind, ref["name"])[ref["key"]].decode()
                except (LookupError, KeyError):
                    if not ref.get("optional"):
                        raise LookupError(f"{kind}/{ref['name']}[{ref['key']}] missing") from None
        return env

    def _start(self, c: Obj) -> None:
        n = c["name"]
        st = self.statuses.get(n) or self._waiting(c, "ContainerCreating")
        self.statuses[n] = st
        term = self.dir / "term" / n
        term.write_bytes(b"")
        try:
            env = self._env(c)
        except LookupError as e:  # like a kubelet: Waiting, retried until the Secret/ConfigMap key exists
            st["state"] = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
            return
        try:
            argv = [_expand(a, env) for a in c.get("command", []) + c.get("args", [])]
            exe = shutil.which(argv[0], path=env["PATH"]) if argv else None
            if exe is None:
                raise LookupError(f"executable not found: {argv[:1]} (image entrypoints unsupported)")
        except LookupError as e:
            st["state"] = {
                "terminated": {
                    "exitCode": 128,
                    "reason": "ContainerCannotRun",
                    "message": str(e),
                    "startedAt": now(),
                    "finishedAt": now(),
                }
            }
            return
        cwd = c.get("workingDir") or str(self.dir)
        log = open(self.dir / "logs" / f"{n}.log", "ab")  # noqa: SIM115
        if self.agent.mount_ns:
            mounts = [
                (self.dir / "volumes" / m["name"] / m.get("subPath", ""), m["mountPath"])
                for m in c.get("volumeMounts", [])
            ]
            mounts.append((term, c.get("terminationMessagePath", "/dev/termination-log")))
            script = ["set -e"]
            # Hold the image paths before any volume can hide them; restore them after the volumes.
            holds = [(self.dir / "image" / str(i), p) for i, p in enumerate(self.agent.image_paths)]
            for hold, path in holds:
                hold.mkdir(parents=True, exist_ok=True)
                script.append(f"mount --bind {shlex.quote(path)} {shlex.quote(str(hold))}")
            for src, dst in mounts:
                q, s = shlex.quote(dst), shlex.quote(str(src.resolve()))
                mk = (
                    f"mkdir -p {q}" if src.is_dir() else f'mkdir -p "$(dirname {q})"; [ -e {q} ] || touch {q}'
                )
                script += [mk, f"mount --bind {s} {q}"]
            for hold, path in holds:
                q = shlex.quote(path)
                script += [f"mkdir -p {q}", f"mount --bind {shlex.quote(str(hold))} {q}"]
            script += [f"mkdir -p {shlex.quote(cwd)}", f"cd {shlex.quote(cwd)}", 'exec "$@"']
            cmd = [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "--",
                "/bin/sh",
                "-c",
                "\n".join(script),
                "sh",
                exe,
                *argv[1:],
            ]
            cwd = str(self.dir)
        else:
            cmd = [exe, *argv[1:]]
            Path(cwd).mkdir(parents=True, exist_ok=True)
        with log:
            self.procs[n] = subprocess.Popen(
                cmd,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        probe = c.get("readinessProbe")
        if probe is not None and ("httpGet" in probe or "tcpSocket" in probe):
            self.probes[n] = Probe(probe, c.get("ports", []), self.ip)
        st.update(
            state={"running": {"startedAt": now()}},
            ready=n not in self.probes,
            started=True,
            containerID=f"local://{self.procs[n].pid}",
        )

    def _probe(self) -> bool:
        """Run the readiness probes that are due; True when a container's readiness changed."""
        changed = False
        for n, probe in list(self.probes.items()):
            st = self.statuses[n]
            if n not in self.procs:  # exited: _finish made it unready; a restart makes a new probe
                del self.probes[n]
                continue
            ready = probe.due_result(st["ready"])
            if ready is not None and ready != st["ready"]:
                st["ready"], changed = ready, True
        return changed

    def _finish(self, c: Obj, proc: subprocess.Popen[bytes]) -> int:
        n, code = c["name"], proc.returncode
        del self.procs[n]
        code = 128 - code if code < 0 else code  # killed by signal N -> 128+N
        msg_path = self.dir / "term" / n
        if not self.agent.mount_ns:
            msg_path = Path(c.get("terminationMessagePath", "/dev/termination-log"))
        msg = msg_path.read_bytes()[-4096:].decode(errors="replace") if msg_path.is_file() else ""
        if not msg and code != 0 and c.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            lines = (self.dir / "logs" / f"{n}.log").read_bytes().decode(errors="replace")
            msg = "\n".join(lines.splitlines()[-80:])[-2048:]
        st = self.statuses[n]
        started = st["state"].get("running", {}).get("startedAt", now())
        term = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": started,
            "finishedAt": now(),
            "containerID": st.get("containerID"),
        }
        if msg:
            term["message"] = msg
        st.update(state={"terminated": term}, ready=False, started=False)
        return code

    def _run_to_completion(self, c: Obj) -> int:
        n = c["name"]
        self._start(c)
        self.init_statuses[n] = self.statuses[n]
        proc = self.procs.get(n)
        self._report()
        while proc is None and "waiting" in self.statuses[n]["state"]:  # CreateContainerConfigError
            if self.deleting.wait(1.0):
                return -1
            self._start(c)
            proc = self.procs.get(n)
        while proc is not None and proc.poll() is None:
            if self.deleting.wait(0.2):
                return -1
        code = self._finish(c, proc) if proc else self.statuses[n]["state"]["terminated"]["exitCode"]
        self._report()
        return code

    def _kill_all(self) -> None:
        grace = min(self.pod["spec"].get("terminationGracePeriodSeconds", 30), 3)
        procs = list(self.procs.values())
        for p in procs:
            _signal(p, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        for p in procs:
            _signal(p, signal.SIGKILL)
            p.wait()

    # --------------------------------------------------------------------- status
    def _waiting(self, c: Obj, reason: str) -> Obj:
        return {
            "name": c["name"],
            "image": c.get("image", ""),
            "imageID": "",
            "ready": False,
            "started": False,
            "restartCount": 0,
            "state": {"waiting": {"reason": reason}},
        }

    def _report(self) -> None:
        if self.deleting.is_set():
            return
        spec = self.pod["spec"]
        ctrs = [self.statuses[c["name"]] for c in spec["containers"] if c["name"] in self.statuses]
        ready = self.phase == "Running" or (self.phase == "Pending" and self.initialized)
        ready = ready and bool(ctrs) and all("running" in s["state"] and s["ready"] for s in ctrs)
        if self.initialized and self.phase == "Pending":
            self.phase = "Running"
        t = now()

        def cond(kind: str, ok: bool) -> Obj:
            return {"type": kind, "status": str(ok), "lastTransitionTime": t}

        status = {
            "phase": self.phase,
            "hostIP": NODE_IP,
            "hostIPs": [{"ip": NODE_IP}],
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "startTime": self.start_time,
            "conditions": [
                cond("PodScheduled", True),
                cond("Initialized", self.initialized),
                cond("ContainersReady", ready),
                cond("Ready", ready),
            ],
            "containerStatuses": ctrs,
            "initContainerStatuses": list(self.init_statuses.values()),
        }
        path = f"/api/v1/namespaces/{self.ns}/pods/{self.name}/status"
        try:  # a failed update is retried with the next change; never kill the runner for it
            self._ignore_404("PATCH", path, {"status": status}, merge=True)
        except Exception as e:
            print(f"node-agent: status of {self.ns}/{self.name}: {e!r}", flush=True)

    def _ignore_404(self, method: str, path: str, body: Obj, merge: bool = False) -> None:
        try:
            self.api(method, path, body, merge=merge)
        except ApiException as e:
            if e.status not in (404, 409):
                raise


class Probe:
    """A container's readinessProbe (httpGet or tcpSocket) against the pod IP."""

    PERIOD_CAP_S = 2.0
    """Like the capped grace period: a test waits at most this long past the moment a server answers."""

    def __init__(self, spec: Obj, ports: list[Obj], host: str = NODE_IP) -> None:
        self.spec, self.host = spec, host
        target = spec.get("httpGet") or spec["tcpSocket"]
        port = target["port"]
        if isinstance(port, str) and not port.isdigit():  # a named containerPort (None: none such)
            port = next((p["containerPort"] for p in ports if p.get("name") == port), None)
        self.port = None if port is None else int(port)
        self.period = min(float(spec.get("periodSeconds", 10)), self.PERIOD_CAP_S)
        self.timeout = float(spec.get("timeoutSeconds", 1))
        self.failure_threshold = int(spec.get("failureThreshold", 3))
        self.next = time.monotonic() + float(spec.get("initialDelaySeconds", 0))
        self.failures = 0

    def due_result(self, ready: bool) -> bool | None:
        """The readiness after a probe that is due now (None when none is due): Ready on one
        success, unready after failureThreshold failures in a row."""
        if time.monotonic() < self.next:
            return None
        ok = self._check()
        self.next = time.monotonic() + self.period
        self.failures = 0 if ok else self.failures + 1
        return True if ok else (ready and self.failures < self.failure_threshold)

    def _check(self) -> bool:
        if self.port is None:  # a kubelet reports the probe as failing, too
            return False
        if "tcpSocket" in self.spec:
            try:
                with socket.create_connection((self.host, self.port), timeout=self.timeout):
                    return True
            except OSError:
                return False
        get = self.spec["httpGet"]
        scheme = str(get.get("scheme", "HTTP")).lower()
        url = f"{scheme}://{self.host}:{self.port}{get.get('path', '/')}"
        headers = {h["name"]: h["value"] for h in get.get("httpHeaders", [])}
        request = urllib.request.Request(url, headers=headers)
        # HTTPS without verification, as a kubelet probes
        tls = ssl._create_unverified_context() if scheme == "https" else None
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=tls) as r:
                return 200 <= int(r.status) < 400
        except (urllib.error.URLError, OSError, ValueError):  # HTTPError (4xx/5xx) is a URLError
            return False


def _expand(s: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion; ``$$(VAR)`` escapes."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), s
    )


def _signal(p: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)


def mount_ns_available() -> bool:
    try:
        cmd = ["unshare", "--mount", "--propagation", "private", "true"]
        return subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class NodeAgent:
    def __init__(
        self,
        kubeconfig: str,
        node: str,
        path_prefix: list[str],
        workdir: Path,
        mount_ns: bool = True,
        image_paths: list[str] | None = None,
    ) -> None:
        self.api, self.node, self.workdir = Api(kubeconfig), node, workdir
        self.image_paths = [os.path.realpath(p) for p in image_paths or []]
        self.path = os.pathsep.join([*path_prefix, os.environ.get("PATH", "/usr/bin:/bin")])
        self.port = int(self.api.server.rsplit(":", 1)[1].split("/")[0])
        self.mount_ns = mount_ns and mount_ns_available()
        self.runners: dict[str, PodRunner] = {}
        self.stopping = threading.Event()

    def run(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._register()
        threading.Thread(target=self._heartbeat, daemon=True).start()
        mode = "mount namespace" if self.mount_ns else "KUBECONFIG fallback"
        print(f"node-agent: node {self.node} ready ({mode})", flush=True)
        while not self.stopping.is_set():
            try:
                w = watch.Watch()
                for ev in w.stream(self.api.core.list_pod_for_all_namespaces, timeout_seconds=60):
                    if self.stopping.is_set():
                        break
                    self._on_event(ev["type"], ev["raw_object"])
            except Exception as e:
                print(f"node-agent: watch error {e!r}", flush=True)
                time.sleep(1)

    def shutdown(self) -> None:
        self.stopping.set()
        for r in list(self.runners.values()):
            r._kill_all()

    def _on_event(self, kind: str, pod: Obj) -> None:
        md, spec, uid = pod["metadata"], pod["spec"], pod["metadata"]["uid"]
        if kind == "DELETED":
            if uid in self.runners:
                self.runners.pop(uid).stop()
            return
        if kind == "ERROR" or spec.get("schedulerName", "default-scheduler") != "default-scheduler":
            return
        if not spec.get("nodeName"):
            if not self._fits(spec):
                return  # as the scheduler would: a pod whose nodeSelector names other labels stays Pending
            body = {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": md["name"]},
                "target": {"apiVersion": "v1", "kind": "Node", "name": self.node},
            }
            try:
                self.api("POST", f"/api/v1/namespaces/{md['namespace']}/pods/{md['name']}/binding", body)
            except ApiException as e:
                print(f"node-agent: bind {md['name']}: {e.status} {e.reason}", flush=True)
            return
        if spec["nodeName"] != self.node:
            return
        runner = self.runners.get(uid)
        if md.get("deletionTimestamp"):
            if runner is not None and runner.is_alive():
                runner.stop()  # the runner kills its processes, then deletes the pod
            else:
                path = f"/api/v1/namespaces/{md['namespace']}/pods/{md['name']}"
                opts = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
                PodRunner(self, pod)._ignore_404("DELETE", path, opts)
        elif runner is None and pod.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
            runner = self.runners[uid] = PodRunner(self, pod)
            runner.start()

    def own_ip(self) -> str:
        """A loopback address no running pod of this agent holds (127.0.0.2 and up). Called from
        the watch thread only, which is the one that adds runners."""
        held = {r.ip for r in self.runners.values() if r.is_alive()}
        for n in range(2, 255):
            if (ip := f"127.0.0.{n}") not in held:
                return ip
        raise RuntimeError("node-agent: no free loopback address for a pod")

    def _labels(self) -> dict[str, str]:
        return {"kubernetes.io/hostname": self.node, "kubernetes.io/os": "linux"}

    def _fits(self, spec: Obj) -> bool:
        labels = self._labels()
        return all(labels.get(k) == v for k, v in (spec.get("nodeSelector") or {}).items())

    def _register(self) -> None:
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.node,
                "labels": self._labels(),
            },
            "status": self._node_status(),
        }
        try:
            self.api("POST", "/api/v1/nodes", node)
        except ApiException as e:
            if e.status != 409:
                raise
        self._heartbeat_once()

    def _node_status(self) -> Obj:
        t = now()
        res = {"cpu": "16", "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi"}
        ready = {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "test node agent",
            "lastHeartbeatTime": t,
            "lastTransitionTime": t,
        }
        return {
            "capacity": res,
            "allocatable": res,
            "conditions": [ready],
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": self.node},
            ],
            "nodeInfo": {
                "kubeletVersion": "v0.0.0-weightsync-node-agent",
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "containerRuntimeVersion": "local-process://0",
                "osImage": "",
                "kernelVersion": os.uname().release,
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        }

    def _heartbeat_once(self) -> None:
        self.api("PATCH", f"/api/v1/nodes/{self.node}/status", {"status": self._node_status()}, merge=True)
        renew = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        lease = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.node}"
        try:
            self.api("PATCH", lease, {"spec": {"renewTime": renew}}, merge=True)
        except ApiException as e:
            if e.status != 404:
                raise
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.node, "namespace": "kube-node-lease"},
                "spec": {"holderIdentity": self.node, "leaseDurationSeconds": 40, "renewTime": renew},
            }
            self.api("POST", lease.rsplit("/", 1)[0], body)

    def _heartbeat(self) -> None:
        while not self.stopping.wait(10):
            try:
                self._heartbeat_once()
            except Exception as e:
                print(f"node-agent: heartbeat error {e!r}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--node-name", default="node-0")
    ap.add_argument("--path-prefix", action="append", default=[], help="dir put first on PATH")
    ap.add_argument("--workdir", type=Path, required=True, help="per-pod dirs and logs go here")
    ap.add_argument("--no-mount-ns", action="store_true", help="force the KUBECONFIG fallback")
    ap.add_argument(
        "--image-path",
        action="append",
        default=[],
        help="host path kept visible in containers (image content)",
    )
    a = ap.parse_args()
    agent = NodeAgent(a.kubeconfig, a.node_name, a.path_prefix, a.workdir, not a.no_mount_ns, a.image_path)

    def on_term(*_: object) -> None:
        agent.shutdown()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    agent.run()


if __name__ == "__main__":
    main()
