"""Disaggregated serving on one host as on several: a router, two prefill workers and two
decode workers (CPU engines), each in a network namespace of its own joined by veth pairs to a
bridge, the state moved by NIXL with UCX over TCP; the official `openai` package as the client.

Started by crates/tandem/tests/disagg.rs inside a user, network and mount namespace of its own
(`unshare -rnm`, so that every address lives only there), or by hand the same way:
    TANDEM=target/release/tandem unshare -rnm python crates/tandem/tests/serve/test_disagg.py
Where namespaces cannot be made, the same processes run on loopback ports (said in the output).

With TANDEM_DISAGG_GPU=1 (on a GPU machine, loopback ports): a prefill worker and a decode
worker as two processes on one GPU, the state moved GPU memory to GPU memory through NIXL;
greedy outputs as a single GPU server's. TANDEM_DISAGG_GPU=2 (two GPUs): the prefill worker
on cuda:0, the decode worker on cuda:1.

Checks: greedy outputs through the router (remote prefill, local prefill, conditional) equal a
single-process server's for plain requests, chat, streams, sessions and prefix-cache hits;
workers joining and a restarted router; a state that does not match its request is refused and
the request prefilled on the decode worker; a prefill worker frozen or killed mid-request is
replaced within a bounded time and the slot it was writing is freed; a decode worker killed
mid-stream gives its client an error and gets no more requests; delay and loss (tc netem) where
the kernel has it. Exits 1 on a failure.
"""

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import openai

from test_serve import check, parse_metrics, wait_until

TANDEM = os.environ.get("TANDEM", "target/release/tandem")
MODEL = "synthetic:tiny"
ENGINES = ["--prefill", "cpu:threads=1", "--decode", "cpu:threads=1"]
PORT = 8000
VOCAB = 1024


def sh(*cmd):
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class Net:
    """Addresses for the router and workers: each in a network namespace of its own (veth to a
    bridge in this namespace), or, where that cannot be done, loopback ports."""

    NAMES = ["router", "p1", "p2", "d1", "d2", "single", "router2", "p3", "d3"]

    def __init__(self):
        self.netns = False
        self.why = ""
        try:
            sh("mount", "-t", "tmpfs", "tandem-netns", "/run")
            os.makedirs("/run/netns", exist_ok=True)
            sh("ip", "link", "set", "lo", "up")
            sh("ip", "link", "add", "br0", "type", "bridge")
            sh("ip", "addr", "add", "10.78.0.1/24", "dev", "br0")
            sh("ip", "link", "set", "br0", "up")
            for i, name in enumerate(self.NAMES):
                sh("ip", "netns", "add", name)
                sh("ip", "link", "add", f"v-{name}", "type", "veth", "peer", "name", "eth0", "netns", name)
                sh("ip", "link", "set", f"v-{name}", "master", "br0")
                sh("ip", "link", "set", f"v-{name}", "up")
                sh("ip", "-n", name, "addr", "add", f"10.78.0.{10 + i}/24", "dev", "eth0")
                sh("ip", "-n", name, "link", "set", "eth0", "up")
                sh("ip", "-n", name, "link", "set", "lo", "up")
            self.netns = True
        except (subprocess.CalledProcessError, OSError) as e:
            detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
            self.why = f"{' '.join(e.cmd) if isinstance(e, subprocess.CalledProcessError) else 'setup'}: {detail}"

    def host(self, name):
        return f"10.78.0.{10 + self.NAMES.index(name)}" if self.netns else "127.0.0.1"

    def port(self, name):
        return PORT if self.netns else 18100 + self.NAMES.index(name)

    def url(self, name):
        return f"http://{self.host(name)}:{self.port(name)}"

    def command(self, name, args):
        prefix = ["ip", "netns", "exec", name] if self.netns else []
        return prefix + [TANDEM, "serve", "--host", self.host(name), "--port", str(self.port(name)), *args]


class Proc:
    """One tandem process, its log kept."""

    def __init__(self, net, name, args):
        self.name = name
        self.url = net.url(name)
        # UCX over TCP; cuda_copy too where a GPU is (NIXL wants a CUDA transport there). GPU
        # workers: UCX picks its transports (CUDA IPC between processes on one GPU).
        env = dict(os.environ) if net.why.startswith("loopback on the GPU") else dict(os.environ, UCX_TLS="tcp,cuda_copy" if os.path.exists("/dev/nvidiactl") else "tcp")
        self.proc = subprocess.Popen(net.command(name, args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.log = []
        up = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.log.append(line.rstrip())
                if "listening on http://" in line:
                    up.set()

        threading.Thread(target=read, daemon=True).start()
        if not up.wait(120):
            self.proc.kill()
            raise RuntimeError(f"{name} did not start:\n" + "\n".join(self.log))

    def request(self, method, path, body=None, timeout=60):
        host, port = self.url[len("http://"):].split(":")
        c = http.client.HTTPConnection(host, int(port), timeout=timeout)
        c.request(method, path, body=None if body is None else json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        out = (r.status, r.read().decode())
        c.close()
        return out

    def metrics(self):
        return parse_metrics(self.request("GET", "/metrics")[1])

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def ids(n, seed):
    return [(i * 7919 + seed * 104729 + 17) % VOCAB for i in range(n)]


def completion(server, prompt, max_tokens=12, **extra):
    r = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra)
    return r.choices[0].text, r.usage


def chat(server, messages, max_tokens=12, stream=False, **extra):
    c = server.client()
    if stream:
        parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True, extra_body=extra) if ch.choices]
        return "".join(parts)
    return c.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, extra_body=extra).choices[0].message.content


def live(router):
    """How many workers the router would send requests to."""
    return sum(w["live"] for w in json.loads(router.request("GET", "/health")[1])["workers"])


def router_metric(router, name):
    return router.metrics().get(name, 0.0)


def summed(workers, name):
    return sum(w.metrics().get(name, 0.0) for w in workers)


@contextlib.contextmanager
def stopped_at_the_end(procs):
    """Run the body; if it fails, print the last lines of each process's log; then kill them."""
    try:
        yield
    except Exception:
        for p in procs:
            print(f"--- log of {p.name}:\n" + "\n".join(p.log[-30:]), file=sys.stderr)
        raise
    finally:
        for p in procs:
            p.stop(signal.SIGKILL)


def gpu(gpus):
    """Two processes on one GPU (gpus 1) or one on each of two (gpus 2: the prefill worker on
    cuda:0, the decode worker on cuda:1): every state written GPU memory to GPU memory, and used."""
    net = Net.__new__(Net)
    net.netns, net.why = False, "loopback on the GPU machine"
    engines = ["--prefill", "cuda:0", "--decode", "cuda:0"]
    procs = []
    with stopped_at_the_end(procs):
        single = Proc(net, "single", ["--model", MODEL, *engines, "--gpu-memory-utilization", "0.25"])
        procs.append(single)
        router = Proc(net, "router", ["--role", "router", "--prefill-placement", "remote"])
        procs.append(router)
        share = ["--gpu-memory-utilization", "0.25"]
        decode_engines = ["--mode", "decode-engine", "--decode", "cuda:1"] if gpus == 2 else engines
        decoder = Proc(net, "d1", ["--role", "decode", "--model", MODEL, "--router", router.url, *decode_engines, *share])
        prefiller = Proc(net, "p1", ["--role", "prefill", "--model", MODEL, "--router", router.url, "--mode", "prefill-engine", "--prefill", "cuda:0", *share])
        procs += [decoder, prefiller]
        wait_until(lambda: live(router) == 2, "both workers registered with the router")
        check(decoder.metrics().get('tandem_worker_state_transfer{transfer="nixl-gpu"}') == 1, "the decode worker receives states in GPU memory")
        prompts = [ids(5, 1), ids(16, 2), ids(300, 3), ids(1200, 4), ids(3000, 5)]
        for p in prompts:
            want = completion(single, p)[0]
            got = completion(router, p)[0]
            check(got == want, f"a {len(p)}-token prompt, its state GPU to GPU: {got!r}, alone {want!r}")
        messages = [{"role": "user", "content": "Tell me about tandem bicycles and how two riders share the work."}]
        check(chat(router, messages, stream=True) == chat(single, messages, stream=True), "a streamed chat, its state GPU to GPU")
        used = decoder.metrics()['tandem_remote_states_total{outcome="used"}']
        refused = decoder.metrics()['tandem_remote_states_total{outcome="refused"}']
        check(used == len(prompts) + 1 and refused == 0, f"every state used ({used}), none refused ({refused})")
        check(decoder.metrics()["tandem_state_slots_reserved"] == 0, "no slot stays reserved")
        where = "from cuda:0 to cuda:1" if gpus == 2 else "between two processes on one GPU"
        print(f"gpu: {used:.0f} states (5-3000 tokens) GPU memory to GPU memory {where}, outputs as a single GPU server's")
        print("disagg gpu: ok")


def main():
    net = Net()
    print(f"network: {'a namespace per process (veth pairs to a bridge), UCX over TCP' if net.netns else 'loopback ports (network namespaces not available: ' + net.why + ')'}")
    procs = []
    with stopped_at_the_end(procs):
        single = Proc(net, "single", ["--model", MODEL, *ENGINES])
        procs.append(single)
        router = Proc(net, "router", ["--role", "router", "--prefill-placement", "remote", "--prefill-timeout", "4"])
        procs.append(router)
        worker_args = lambda role: ["--role", role, "--model", MODEL, "--router", router.url, *ENGINES]
        decoders = [Proc(net, n, worker_args("decode")) for n in ["d1", "d2"]]
        prefillers = [Proc(net, n, worker_args("prefill")) for n in ["p1", "p2"]]
        procs += decoders + prefillers
        wait_until(lambda: live(router) == 4, "four workers registered with the router")
        print("workers joined: 2 prefill, 2 decode")

        # Remote prefill: every output as the single server's.
        prompts = [ids(5, 1), ids(64, 2), ids(300, 3), ids(1200, 4)]
        for p in prompts:
            want = completion(single, p)[0]
            got, usage = completion(router, p)
            check(got == want, f"a {len(p)}-token prompt through the router (remote prefill): {got!r}, alone {want!r}")
        messages = [{"role": "user", "content": "Tell me about tandem bicycles and how two riders share the work."}]
        check(chat(router, messages) == chat(single, messages), "chat through the router")
        check(chat(router, messages, stream=True) == chat(single, messages, stream=True), "a streamed chat through the router")
        remote = router_metric(router, 'tandem_router_requests_total{prefill="remote"}')
        used = summed(decoders, 'tandem_remote_states_total{outcome="used"}')
        check(remote == len(prompts) + 2 and used == remote, f"every request prefilled remotely ({remote}) and its state used ({used})")
        print(f"remote prefill: {len(prompts)} completions (5-1200 tokens), a chat and a streamed chat as the single server's; {used:.0f} states through NIXL")

        # Prefix-cache hits: the same long prompt again, and one sharing its first 1000 tokens.
        p = ids(1200, 4)
        _, usage = completion(router, p)
        check(usage.prompt_tokens_details.cached_tokens > 0, f"a repeated prompt is a prefix-cache hit (usage {usage})")
        shared = p[:1000] + ids(50, 9)
        check(completion(router, shared)[0] == completion(single, shared)[0], "a prompt sharing a cached prefix")
        print(f"prefix cache: a repeated 1200-token prompt found {usage.prompt_tokens_details.cached_tokens} tokens cached; a prompt sharing 1000 of them as the single server's")

        # Sessions: three turns through the router, as the single server's three turns.
        def conversation(server, session):
            history, replies = [], []
            for q in ["Hello there.", "What is a stoker on a tandem?", "And the captain?"]:
                history.append({"role": "user", "content": q})
                reply = chat(server, history, session_id=session)
                replies.append(reply)
                history.append({"role": "assistant", "content": reply})
            return replies

        check(conversation(router, "s-router") == conversation(single, "s-single"), "a three-turn session through the router")
        print("sessions: three turns as the single server's")

        # The serving benchmark pointed at the router.
        bench = subprocess.run([TANDEM, "bench", "--sections", "serve", "--url", router.url, "--model", MODEL, "--concurrency", "2", "--rates", "none", "--requests", "4", "--input-len", "300", "--output-len", "4"], capture_output=True, text=True, timeout=300)
        check(bench.returncode == 0 and "| concurrency 2 | 4 | 0 |" in bench.stdout, f"tandem bench --sections serve --url at the router: {bench.returncode}\n{bench.stdout}\n{bench.stderr[-2000:]}")
        print("the serving benchmark against the router: 4 requests at concurrency 2, none failed")

        # The bridges instead of NIXL: a decode worker that takes states by stream (the image
        # POSTed to it), then one that takes them as state files in a directory both see.
        router2 = Proc(net, "router2", ["--role", "router", "--prefill-placement", "remote"])
        p3 = Proc(net, "p3", ["--role", "prefill", "--model", MODEL, "--router", router2.url, *ENGINES])
        procs += [router2, p3]
        shared = tempfile.mkdtemp(prefix="tandem-states-")
        for how, kind in [("stream", "stream"), (f"file:{shared}", "file")]:
            d3 = Proc(net, "d3", ["--role", "decode", "--model", MODEL, "--router", router2.url, "--state-transfer", how, *ENGINES])
            procs.append(d3)
            wait_until(lambda: live(router2) == 2, f"a decode worker taking states by {kind} registered")
            check(d3.metrics().get(f'tandem_worker_state_transfer{{transfer="{kind}"}}') == 1, f"the decode worker says its states come by {kind}")
            for p in prompts[:3]:
                check(completion(router2, p)[0] == completion(single, p)[0], f"a {len(p)}-token prompt, its state by {kind}")
            used = d3.metrics()['tandem_remote_states_total{outcome="used"}']
            check(used == 3, f"every state by {kind} used ({used})")
            if kind == "stream":
                status, body = d3.request("POST", "/internal/reserve", {"tokens": 64})
                slot = json.loads(body)["slot"]
                c = http.client.HTTPConnection(*d3.url[len("http://"):].split(":"), timeout=10)
                c.request("POST", f"/internal/state/{slot}", body=b"TNDMSTAT" + bytes(200), headers={"Content-Type": "application/octet-stream"})
                r = c.getresponse()
                answer = r.read().decode()
                check(r.status == 400 and "refused" in answer, f"a damaged streamed state: {r.status} {answer[:200]}")
                status, _ = d3.request("POST", "/internal/state/999999", {})
                check(status == 404, f"a state for a slot never reserved: {status}")
            else:
                check(os.listdir(shared) == [], f"the state files are removed once read: {os.listdir(shared)}")
            check(d3.metrics()["tandem_state_slots_reserved"] == 0, f"no slot stays reserved ({kind})")
            d3.stop()
            wait_until(lambda: live(router2) == 1, "the router notices the decode worker gone", seconds=15)
        router2.stop()
        p3.stop()
        print("bridges instead of NIXL: states by stream and by state file, outputs as the single server's; a damaged streamed state refused, its slot freed")

        # A state that does not belong to its request is refused and the request prefilled on
        # the decode worker (the slot reserved for it freed).
        d = decoders[0]
        status, body = d.request("POST", "/internal/reserve", {"tokens": 64})
        check(status == 200, f"reserve: {status} {body}")
        slot = json.loads(body)["slot"]
        refused = d.metrics()['tandem_remote_states_total{outcome="refused"}']
        status, body = d.request("POST", "/v1/completions", {"prompt": ids(64, 2), "max_tokens": 12, "temperature": 0, "tandem_prefilled": {"slot": slot, "tokens": 64, "hash": "0000000000000000"}})
        check(status == 200 and json.loads(body)["choices"][0]["text"] == completion(single, ids(64, 2))[0], f"a request whose state does not match: {status} {body[:200]}")
        check(d.metrics()['tandem_remote_states_total{outcome="refused"}'] == refused + 1, "the mismatched state is counted as refused")
        check(d.metrics()["tandem_state_slots_reserved"] == 0, "its slot is freed")
        print("a state for another prompt: refused, the request prefilled on the decode worker, its slot freed")

        # A prefill worker frozen mid-request: the router gives up on it after --prefill-timeout,
        # frees the slot, and the next prefill worker does it.
        p1 = prefillers[0]
        p1.proc.send_signal(signal.SIGSTOP)
        t = time.monotonic()
        got = completion(router, ids(300, 5))[0]
        took = time.monotonic() - t
        p1.proc.send_signal(signal.SIGCONT)
        check(got == completion(single, ids(300, 5))[0], "the request a frozen prefill worker held, done elsewhere")
        check(took < 4 + 10, f"the request a frozen prefill worker held took {took:.1f} s (the router waits 4 s for a prefill)")
        check(summed(decoders, "tandem_state_slots_reserved") == 0, "no slot stays reserved")
        print(f"a frozen prefill worker: the request done elsewhere in {took:.1f} s (--prefill-timeout 4), no slot left reserved")
        wait_until(lambda: live(router) == 4, "the thawed prefill worker back")

        # A prefill worker killed while it prefills a long prompt.
        long_prompt = ids(3000, 6)
        want = completion(single, long_prompt)[0]
        result = {}

        def send():
            result["got"] = completion(router, long_prompt)[0]

        sender = threading.Thread(target=send)
        victim = None
        t = time.monotonic()
        sender.start()
        while victim is None and time.monotonic() - t < 20:
            for w in prefillers:
                if w.metrics().get("tandem_active_sequences", 0) > 0:
                    victim = w
                    break
            time.sleep(0.005)
        check(victim is not None, "a prefill worker took the long prompt")
        victim.proc.send_signal(signal.SIGKILL)
        sender.join(60)
        check(result.get("got") == want, f"the request of a killed prefill worker: {result}")
        check(summed(decoders, "tandem_state_slots_reserved") == 0, "no slot stays reserved after a prefill worker died")
        print(f"a prefill worker killed mid-prefill ({victim.name}): the request done elsewhere in {time.monotonic() - t:.1f} s, no slot left reserved")
        wait_until(lambda: not any(w["live"] and w["url"] == victim.url for w in json.loads(router.request("GET", "/health")[1])["workers"]), "the router stops using the dead prefill worker")

        # A restarted router with local placement: the workers register again by themselves.
        router.stop()
        router = Proc(net, "router", ["--role", "router", "--prefill-placement", "local"])
        procs.append(router)
        wait_until(lambda: live(router) == 3, "the workers back with a new router")
        for p in prompts[:3]:
            check(completion(router, p)[0] == completion(single, p)[0], f"a {len(p)}-token prompt through the router (local prefill)")
        check(router_metric(router, 'tandem_router_requests_total{prefill="local"}') == 3, "local placement prefills on the decode worker")
        print("a restarted router (local placement): the workers re-registered, outputs as the single server's")

        # A decode worker killed mid-stream: its client gets an error, and no more requests go there.
        c = router.client()
        stream = c.completions.create(model=MODEL, prompt=ids(20, 7), max_tokens=3000, temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        busy = [w for w in decoders if w.metrics().get("tandem_active_sequences", 0) > 0]
        check(len(busy) == 1, "one decode worker runs the stream")
        busy[0].proc.send_signal(signal.SIGKILL)
        error = None
        try:
            for _ in stream:
                pass
        except Exception as e:  # the SDK raises on the stream's error event
            error = e
        check(error is not None and "failed" in str(error), f"the client of a killed decode worker gets an error: {error!r}")
        other = [w for w in decoders if w is not busy[0]][0]
        for p in prompts[:2]:
            check(completion(router, p)[0] == completion(single, p)[0], "requests after a decode worker died")
        check(other.metrics()["tandem_active_sequences"] == 0, "the live decode worker finished them")
        print(f"a decode worker killed mid-stream: its client got {type(error).__name__} ({str(error)[:80]}...), later requests went to the other")

        # Delay and loss on the remaining decode worker's link, where the kernel has netem.
        if net.netns:
            dn = other.name
            r = subprocess.run(["ip", "netns", "exec", dn, "tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay", "20ms", "loss", "2%"], capture_output=True, text=True)
            if r.returncode != 0:
                print(f"netem: not available in this kernel ({r.stderr.strip()}); delay and loss not tested")
            else:
                router.stop()
                router = Proc(net, "router", ["--role", "router", "--prefill-placement", "remote"])
                procs.append(router)
                wait_until(lambda: live(router) == 2, "the workers back")
                for p in prompts[:3]:
                    check(completion(router, p)[0] == completion(single, p)[0], "a request over a link with 20 ms delay and 2% loss")
                print("netem: 20 ms delay and 2% loss on a decode worker's link: outputs as the single server's")
        else:
            print("netem: not tested (no network namespaces)")
        print("disagg: ok")


if __name__ == "__main__":
    try:
        gpu(int(os.environ["TANDEM_DISAGG_GPU"])) if os.environ.get("TANDEM_DISAGG_GPU") in ("1", "2") else main()
    except AssertionError as e:
        print(f"FAILED: {e}")
        sys.exit(1)
