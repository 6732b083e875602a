"""`tandem serve` against real clients: the official `openai` Python package and curl.

Started by crates/tandem/tests/serve.rs (which installs the package into a virtualenv), or by
hand:  TANDEM=target/release/tandem python crates/tandem/tests/serve/test_serve.py

Each check starts its own server (synthetic:tiny unless TANDEM_MODEL says otherwise) on a free
port, talks to it over loopback, and stops it. Prints what it measured; exits 1 on a failure.
"""

import asyncio
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import openai

TANDEM = os.environ.get("TANDEM", "target/release/tandem")
MODEL = os.environ.get("TANDEM_MODEL", "synthetic:tiny")
ENGINES = os.environ.get("TANDEM_ENGINES", "").split()


class Server:
    """A `tandem serve` process on a free loopback port."""

    def __init__(self, *extra):
        cmd = [TANDEM, "serve", "--model", MODEL, "--port", "0", *ENGINES, *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log = []
        found = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.log.append(line.rstrip())
                m = re.search(r"listening on http://([\d.]+):(\d+)", line)
                if m:
                    self.host, self.port = m.group(1), int(m.group(2))
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(120):
            self.proc.kill()
            raise RuntimeError("tandem serve did not start:\n" + "\n".join(self.log))
        self.url = f"http://{self.host}:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise RuntimeError("tandem serve did not stop within 30 s of SIGTERM")

    def request(self, method, path, body=None):
        """(status, headers, body text) of one plain HTTP request."""
        c = http.client.HTTPConnection(self.host, self.port, timeout=60)
        c.request(method, path, body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        out = (r.status, dict(r.getheaders()), r.read().decode())
        c.close()
        return out

    def metrics(self):
        """/metrics as {name{labels}: value}."""
        return parse_metrics(self.request("GET", "/metrics")[2])

    def rss_kib(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))

    def curl(self, *args):
        r = subprocess.run(["curl", "-sS", *args], capture_output=True, text=True, timeout=60)
        return r.stdout


def parse_metrics(text):
    """Prometheus text as {name{labels}: value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def wait_until(pred, what, seconds=10.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"not within {seconds} s: {what}")


def user(text):
    return [{"role": "user", "content": text}]


def api_and_sdk():
    with Server("--max-context", "256") as s:
        c = s.client
        models = c.models.list()
        check([m.id for m in models.data] == [MODEL], f"/v1/models lists the model: {models}")

        r = c.chat.completions.create(model=MODEL, messages=user("Tell me about tandem bicycles."), max_tokens=12, temperature=0)
        text = r.choices[0].message.content
        check(r.object == "chat.completion" and r.choices[0].finish_reason == "length", f"a whole chat response: {r}")
        check(r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12, f"usage: {r.usage}")
        check(isinstance(text, str) and text, "the reply has text")

        # Streaming gives the same greedy text, from a cached state this time.
        stream = c.chat.completions.create(model=MODEL, messages=user("Tell me about tandem bicycles."), max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True})
        deltas, finish, usage = [], None, None
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for ch in chunk.choices:
                deltas.append(ch.delta.content or "")
                finish = ch.finish_reason or finish
        check("".join(deltas) == text, f"streamed {''.join(deltas)!r} == whole {text!r}")
        check(finish == "length" and usage.completion_tokens == 12, f"stream finish {finish}, usage {usage}")
        check(usage.prompt_tokens_details.cached_tokens > 0, f"the repeated prompt continued a cached state: {usage}")

        # Completions, whole and streamed; stop strings cut the text where they start.
        r = c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=16, temperature=0)
        full = r.choices[0].text
        check(r.object == "text_completion" and r.usage.completion_tokens == 16, f"completion: {r}")
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=16, temperature=0, stream=True))
        check(streamed == full, f"completion streamed {streamed!r} == {full!r}")
        stop = full[len(full) // 2 :][:3]
        r = c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=16, temperature=0, stop=[stop])
        check(r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop", f"stop {stop!r}: {r.choices[0].text!r} from {full!r}")

        # Seeds: the same seed samples the same text; another seed another text.
        kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, top_p=0.95)
        a, b = (c.completions.create(seed=7, **kw).choices[0].text for _ in range(2))
        other = c.completions.create(seed=8, **kw).choices[0].text
        check(a == b and a != other, f"seed 7 twice {a!r} {b!r}, seed 8 {other!r}")
        r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, extra_body={"top_k": 1}, temperature=1.0)
        greedy = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0).choices[0].text
        check(r.choices[0].text == greedy, "top_k = 1 is greedy")

        # ignore_eos (vLLM's extension, what load generators send): every reply has max_tokens.
        for seed in range(6):
            r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
            check(r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length", f"ignore_eos, seed {seed}: {r.usage}, {r.choices[0].finish_reason}")

        # Bad requests: OpenAI-style errors with the right status; the server keeps serving.
        def refused(status, param, **kw):
            try:
                c.chat.completions.create(**{"model": MODEL, "messages": user("hi"), **kw})
            except openai.APIStatusError as e:
                err = e.body if isinstance(e.body, dict) and "message" in e.body else e.body["error"]
                check(e.status_code == status and err.get("param") == param, f"{kw}: {e.status_code} {err}")
                return err["message"]
            raise AssertionError(f"{kw} was accepted")

        refused(404, "model", model="gpt-4")
        refused(400, "messages", messages=[])
        refused(400, "max_tokens", max_tokens=0)
        refused(400, "max_tokens", extra_body={"max_tokens": "ten"})
        refused(400, "temperature", temperature=5)
        refused(400, "n", n=0)
        # Options that would change the output and that tandem does not do: refused, not ignored.
        refused(400, "response_format", response_format={"type": "xml"})
        m = refused(400, "messages", messages=user("word " * 300), max_tokens=10)
        check("context is 256 tokens" in m, f"a prompt past --max-context says so: {m}")
        m = refused(400, "messages", messages=user("word " * 40), max_tokens=250)
        check("250 more were asked for" in m, f"a reply that would not fit says so: {m}")
        status, _, body = s.request("POST", "/v1/chat/typing", json.dumps({"model": MODEL, "session_id": "long", "messages": user("word " * 300)}))
        err = json.loads(body)["error"]
        check(status == 400 and err["param"] == "messages" and err["code"] == "context_length_exceeded", f"typing past --max-context is refused as chat is: {status} {body}")
        r = c.chat.completions.create(model=MODEL, messages=user("still serving?"), max_tokens=3, temperature=0)
        check(r.usage.completion_tokens == 3, "the server serves after refusing")
        print(f"  openai {openai.__version__}: models, chat and completions (whole and streamed), stop, seed, top_k, 10 refusals")


def raw_json(s, path, body):
    """POST a JSON body; the (status, decoded JSON) of the answer."""
    status, _, text = s.request("POST", path, json.dumps({"model": MODEL, **body}))
    return status, json.loads(text)


def sampling_options():
    """logprobs, n, logit_bias, the penalties, min_p and stop_token_ids, through the SDK (and
    raw JSON where the SDK has no field)."""
    with Server() as s:
        c = s.client
        ask = dict(model=MODEL, messages=user("Tell me about tandem bicycles."), max_tokens=12, temperature=0)

        # logprobs: each token's, with the likeliest three; greedy picks the likeliest, and the
        # tokens' bytes put together are the text.
        r = c.chat.completions.create(logprobs=True, top_logprobs=3, **ask)
        text, content = r.choices[0].message.content, r.choices[0].logprobs.content
        check(len(content) == 12, f"a log-probability per token: {len(content)}")
        for e in content:
            check(e.logprob <= 0 and len(e.top_logprobs) == 3, f"{e}")
            check(e.top_logprobs[0].token == e.token and abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6, f"greedy takes the likeliest: {e}")
            check(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob, f"likeliest first: {e.top_logprobs}")
        check(bytes(b for e in content for b in e.bytes).decode() == text, f"the tokens' bytes are the text {text!r}")
        streamed = [e for ch in c.chat.completions.create(stream=True, logprobs=True, top_logprobs=3, **ask) for choice in ch.choices if choice.logprobs for e in choice.logprobs.content]
        check([(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content], "streamed log-probabilities == whole")
        plain = c.chat.completions.create(**ask)
        check(plain.choices[0].logprobs is None and plain.choices[0].message.content == text, "no logprobs unless asked; asking changes nothing")
        r = c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=10, temperature=0, logprobs=2)
        lp = r.choices[0].logprobs
        check(len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10, f"completion logprobs: {lp}")
        check("".join(lp.tokens) == r.choices[0].text and all(len(t) == 2 for t in lp.top_logprobs), f"completion logprobs: {lp}")
        check(lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)], f"offsets: {lp.text_offset}")

        # n: one prompt, n choices; choice k is what the request alone samples with seed + k.
        kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, top_p=0.95)
        r = c.completions.create(n=3, seed=11, **kw)
        texts = [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]
        alone = [c.completions.create(seed=11 + k, **kw).choices[0].text for k in range(3)]
        check(texts == alone and len(set(texts)) > 1, f"n = 3: {texts} vs alone {alone}")
        check(r.usage.completion_tokens == 48, f"usage counts every choice: {r.usage}")
        parts = {}
        for ch in c.completions.create(n=3, seed=11, stream=True, **kw):
            for choice in ch.choices:
                parts[choice.index] = parts.get(choice.index, "") + choice.text
        check([parts[k] for k in range(3)] == texts, f"n = 3 streamed: {parts}")
        chat = c.chat.completions.create(model=MODEL, messages=user("Hi"), n=2, max_tokens=8, temperature=1.0, seed=3)
        check(sorted(ch.index for ch in chat.choices) == [0, 1] and all(ch.finish_reason for ch in chat.choices), f"chat n = 2: {chat}")

        # logit_bias: +100 on one token makes greedy pick it every time; -100 on greedy's first
        # pick moves it.
        base = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        _, g = raw_json(s, "/v1/completions", base)
        ids = g["choices"][0]["token_ids"]
        _, b = raw_json(s, "/v1/completions", {**base, "logit_bias": {"1234": 100}})
        check(b["choices"][0]["token_ids"] == [1234] * 8, f"logit_bias +100: {b['choices'][0]['token_ids']}")
        _, b = raw_json(s, "/v1/completions", {**base, "logit_bias": {str(ids[0]): -100}})
        check(b["choices"][0]["token_ids"][0] != ids[0], f"logit_bias -100 moves greedy's first pick {ids[0]}")
        status, e = raw_json(s, "/v1/completions", {**base, "logit_bias": {"999999999": 1}})
        check(status == 400 and e["error"]["param"] == "logit_bias" and "outside the vocabulary" in e["error"]["message"], f"{e}")

        # Penalties: the synthetic model's greedy text repeats no token in 48; negative penalties
        # reward repeats (the repetition penalty's also the prompt's tokens), and a positive
        # frequency penalty ends a run that a logit bias forces.
        long = {**base, "max_tokens": 48}
        _, g = raw_json(s, "/v1/completions", long)
        ids = g["choices"][0]["token_ids"]
        check(len(set(ids)) == 48, f"greedy repeats nothing: {ids}")
        for option in [{"frequency_penalty": -2.0}, {"presence_penalty": -2.0}, {"repetition_penalty": 0.5}]:
            _, p = raw_json(s, "/v1/completions", {**long, **option})
            pids = p["choices"][0]["token_ids"]
            check(len(set(pids)) < 48, f"{option} rewards repeats: {pids}")
        _, forced = raw_json(s, "/v1/completions", {**long, "logit_bias": {"1234": 30}})
        _, ended = raw_json(s, "/v1/completions", {**long, "logit_bias": {"1234": 30}, "frequency_penalty": 2.0})
        runs = [r["choices"][0]["token_ids"].count(1234) for r in (forced, ended)]
        check(runs[0] == 48 and 0 < runs[1] < 48, f"a +30 bias repeats token 1234 {runs[0]} times, with frequency_penalty 2 {runs[1]} times")
        # min_p = 1 keeps only the likeliest: sampling at any temperature is greedy.
        r = c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=1.5, seed=1, extra_body={"min_p": 1.0})
        check(r.choices[0].text == c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0).choices[0].text, "min_p 1 is greedy")

        # stop_token_ids: the choice ends before the first of them, finish_reason stop.
        stop_id = ids[5]
        _, r = raw_json(s, "/v1/completions", {**long, "stop_token_ids": [stop_id]})
        check(r["choices"][0]["token_ids"] == ids[: ids.index(stop_id)] and r["choices"][0]["finish_reason"] == "stop", f"stop_token_ids [{stop_id}]: {r['choices'][0]}")
        print("  logprobs (chat and completions, whole and streamed), n (each choice as its seed alone), logit_bias, three penalties, min_p, stop_token_ids")


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Today's weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def tools_in_prompts():
    """A tool round trip's requests as the SDK sends them: the tools go into the prompt through
    the template (unless tool_choice is none), an assistant turn's calls and the tool's result
    go back in; what tandem cannot do yet is refused, and bad calls are named."""
    with Server() as s:
        c = s.client
        ask = dict(model=MODEL, messages=user("Weather in Paris?"), max_tokens=4, temperature=0)
        plain = c.chat.completions.create(**ask).usage.prompt_tokens
        with_tools = c.chat.completions.create(tools=[WEATHER], **ask)
        none = c.chat.completions.create(tools=[WEATHER], tool_choice="none", **ask).usage.prompt_tokens
        check(with_tools.usage.prompt_tokens > plain + 20 and none == plain, f"prompt tokens: plain {plain}, with tools {with_tools.usage.prompt_tokens}, tool_choice none {none}")
        check(with_tools.choices[0].finish_reason in ("length", "stop"), f"{with_tools}")
        history = user("Weather in Paris?") + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        ]
        r = c.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=4, temperature=0)
        check(r.usage.prompt_tokens > with_tools.usage.prompt_tokens + 15, f"the call and its result are in the prompt: {r.usage}")

        def refused(param, **kw):
            try:
                c.chat.completions.create(**{**ask, **kw})
            except openai.BadRequestError as e:
                check(e.body.get("param") == param, f"{kw}: {e.body}")
                return
            raise AssertionError(f"{kw} was accepted")

        refused("tool_choice", tool_choice="required")
        refused("tools[0]", tools=[{"type": "function", "function": {"name": ""}}])
        refused("messages[1].tool_calls", messages=user("x") + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}, *user("y")])
        refused("messages[1].tool_call_id", messages=user("x") + [{"role": "tool", "content": "r"}])
        print("  tools rendered into the prompt (not with tool_choice none), a call and its result sent back, 4 refusals")


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
          "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog"]}, "maxItems": 3}}, "required": ["name", "age", "pets"], "additionalProperties": False}
CITY_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Today's weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}}}


def structured_output():
    """response_format and required tool calls, enforced while sampling: the synthetic model's
    random text, which is no JSON unconstrained, parses and validates; a tool round trip and
    streamed tool calls through the SDK; curl and the jsonschema validator as a second client."""
    import jsonschema

    with Server() as s:
        c = s.client
        ask = dict(model=MODEL, messages=user("Describe a person as JSON."), max_tokens=120, temperature=0)
        free = c.chat.completions.create(**ask).choices[0].message.content
        try:
            json.loads(free)
            raise AssertionError(f"the unconstrained reply parses as JSON: {free!r}")
        except json.JSONDecodeError:
            pass
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        for temperature, seed in [(0, 0), (1.0, 1), (1.0, 2)]:
            r = c.chat.completions.create(response_format=fmt, **{**ask, "temperature": temperature, "seed": seed})
            text = r.choices[0].message.content
            jsonschema.validate(json.loads(text), PERSON)
            check(r.choices[0].finish_reason == "stop", f"the reply ends with the JSON: {r.choices[0]}")
        # Any object: the random model's keys would run on for ever, so a bias on '"' (id 1)
        # closes each string at once; the grammar still decides what may come.
        r = c.chat.completions.create(response_format={"type": "json_object"}, logit_bias={"1": 30}, **{**ask, "max_tokens": 400, "temperature": 0.7, "seed": 3})
        check(r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict), f"json_object: {r.choices[0]}")
        # The same through streaming, n choices and the completions endpoint.
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(response_format=fmt, stream=True, **ask) if ch.choices)
        check(streamed == c.chat.completions.create(response_format=fmt, **ask).choices[0].message.content, f"streamed {streamed!r}")
        for ch in c.chat.completions.create(response_format=fmt, n=3, **{**ask, "temperature": 1.0, "seed": 4}).choices:
            jsonschema.validate(json.loads(ch.message.content), PERSON)
        r = c.completions.create(model=MODEL, prompt="A person:", max_tokens=120, temperature=0, extra_body={"response_format": fmt})
        jsonschema.validate(json.loads(r.choices[0].text), PERSON)

        # Tool calls: required forces a call; its arguments follow the function's schema; the
        # call and its result go back for the next turn.
        tools = [CITY_WEATHER]
        r = c.chat.completions.create(model=MODEL, messages=user("Weather in Paris?"), tools=tools, tool_choice="required", max_tokens=200, temperature=0)
        m = r.choices[0].message
        check(r.choices[0].finish_reason == "tool_calls" and m.tool_calls and not m.content, f"a required call: {r.choices[0]}")
        call = m.tool_calls[0]
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, CITY_WEATHER["function"]["parameters"])
        check(call.function.name == "get_weather" and call.type == "function" and call.id, f"{call}")
        history = user("Weather in Paris?") + [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
        r2 = c.chat.completions.create(model=MODEL, messages=history, tools=tools, max_tokens=8, temperature=0)
        check(r2.choices[0].finish_reason in ("length", "stop", "tool_calls"), f"the round trip's next turn: {r2}")
        # Streamed: the call arrives as delta.tool_calls; put together it is the whole reply's call.
        named = {"type": "function", "function": {"name": "get_weather"}}
        whole = c.chat.completions.create(model=MODEL, messages=user("Weather in Rome?"), tools=tools, tool_choice=named, max_tokens=200, temperature=0).choices[0].message.tool_calls
        parts, finish = {}, None
        for ch in c.chat.completions.create(model=MODEL, messages=user("Weather in Rome?"), tools=tools, tool_choice=named, max_tokens=200, temperature=0, stream=True):
            for choice in ch.choices:
                finish = choice.finish_reason or finish
                for tc in choice.delta.tool_calls or []:
                    p = parts.setdefault(tc.index, {"name": "", "arguments": ""})
                    p["name"] += tc.function.name or ""
                    p["arguments"] += tc.function.arguments or ""
        check(finish == "tool_calls" and [(p["name"], json.loads(p["arguments"])) for p in parts.values()] == [(w.function.name, json.loads(w.function.arguments)) for w in whole], f"streamed calls {parts} vs {whole}")
        # The SDK's own parse helper reads the schema-constrained reply into its model.
        parsed = c.chat.completions.parse(model=MODEL, messages=user("A person"), response_format=fmt, max_tokens=120, temperature=0)
        check(json.loads(parsed.choices[0].message.content) == json.loads(c.chat.completions.create(response_format=fmt, **{**ask, "messages": user("A person")}).choices[0].message.content), "parse")

        # A second client: curl, the reply checked by the jsonschema validator.
        body = json.dumps({"model": MODEL, "messages": user("A person, please"), "max_tokens": 120, "temperature": 0.8, "seed": 9, "response_format": fmt})
        out = json.loads(s.curl(s.url + "/v1/chat/completions", "-H", "Content-Type: application/json", "-d", body))
        jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), PERSON)
        bad = json.loads(s.curl(s.url + "/v1/chat/completions", "-d", json.dumps({"messages": user("x"), "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}})))
        check(bad["error"]["param"] == "response_format" and "could not compile" in bad["error"]["message"], f"{bad}")
        print("  response_format json_schema (whole, streamed, n = 3, completions) and json_object validate; required and named tool calls, a round trip, streamed calls; curl + jsonschema")


def curl_checks():
    with Server() as s:
        body = json.dumps({"model": MODEL, "messages": user("Hello"), "max_tokens": 5, "temperature": 0})
        out = json.loads(s.curl(s.url + "/v1/chat/completions", "-H", "Content-Type: application/json", "-d", body))
        check(out["choices"][0]["message"]["role"] == "assistant" and out["usage"]["completion_tokens"] == 5, f"curl chat: {out}")
        sse = s.curl("-N", s.url + "/v1/chat/completions", "-d", json.dumps({**json.loads(body), "stream": True}))
        events = [line[6:] for line in sse.splitlines() if line.startswith("data: ")]
        check(events[-1] == "[DONE]", f"the stream ends with data: [DONE]: {events[-2:]}")
        chunks = [json.loads(e) for e in events[:-1]]
        check(all(ch["object"] == "chat.completion.chunk" for ch in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length", "chunks")
        check("".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == out["choices"][0]["message"]["content"], "curl stream == whole")

        code = s.curl("-o", "/dev/null", "-w", "%{http_code}", s.url + "/v1/chat/completions", "-d", '{"messages": [{"role": "user", "content": "hi"}')
        check(code == "400", f"malformed JSON: {code}")
        err = json.loads(s.curl(s.url + "/v1/chat/completions", "-d", '{"messages": [{"role": "user"'))["error"]
        check(err["type"] == "invalid_request_error" and "not valid JSON" in err["message"], f"malformed JSON error: {err}")
        err = json.loads(s.curl(s.url + "/v1/completions", "-d", '{"prompt": "x", "stop": 5}'))["error"]
        check(err["param"] == "stop", f"a field of the wrong type: {err}")
        check(json.loads(s.curl(s.url + "/health")) == {"status": "ok"}, "/health")
        status, _, text = s.request("GET", "/v1/nothing")
        check(status == 404 and json.loads(text)["error"]["code"] == "not_found", "unknown path")
        status, _, _ = s.request("GET", "/v1/chat/completions")
        check(status == 405, "wrong method")
        metrics = s.curl(s.url + "/metrics")
        for name in ["tandem_time_to_first_token_seconds_bucket", "tandem_time_per_output_token_seconds_bucket", "tandem_queue_depth", "tandem_active_sequences",
                     "tandem_prompt_tokens_total", "tandem_generation_tokens_total", 'tandem_engine_busy_seconds_total{work="prefill"}', "tandem_prefix_cache_hits_total",
                     'tandem_prefix_cache_bytes{tier="host"}']:
            check(name in metrics, f"/metrics has {name}")
        check(s.metrics()['tandem_requests_total{endpoint="chat",outcome="invalid"}'] == 2, "invalid requests are counted")
        print("  curl: chat whole and streamed ([DONE]), malformed JSON, wrong type, 404, 405, /health, /metrics")


def conversation(s, history_words, label):
    """Two turns of one conversation, as an unmodified client sends them: the second turn
    repeats the whole history. Returns (turn-2 usage, turn-2 TTFT in s, cold TTFT in s)."""
    c = s.client
    system = {"role": "system", "content": f"You are assistant {label}."}
    first = [system, {"role": "user", "content": " ".join(f"w{i}" for i in range(history_words))}]
    r = c.chat.completions.create(model=MODEL, messages=first, max_tokens=8, temperature=0)
    second = first + [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "And then?"}]

    def ttft(messages, extra=None):
        t = time.perf_counter()
        stream = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True}, extra_body=extra)
        first_token, usage = None, None
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            if first_token is None and chunk.choices and chunk.choices[0].delta.content:
                first_token = time.perf_counter() - t
        return first_token, usage

    hits = s.metrics()["tandem_prefix_cache_hits_total"]
    warm, usage = ttft(second)
    check(s.metrics()["tandem_prefix_cache_hits_total"] == hits + 1, "the second turn is a prefix cache hit")
    # The same conversation under a salt of its own: nothing cached covers it.
    cold, cold_usage = ttft(second, {"cache_salt": f"cold-{label}"})
    check(cold_usage.prompt_tokens_details.cached_tokens == 0, f"cold: {cold_usage}")
    return usage, warm, cold


def multi_turn():
    with Server() as s:
        rows = []
        for words in (50, 400, 1600):
            usage, warm, cold = conversation(s, words, f"h{words}")
            new = usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
            rows.append((words, usage.prompt_tokens, new, warm, cold))
        for words, prompt, new, warm, cold in rows:
            print(f"  turn 2 after a {words}-word message: prompt {prompt} tokens, prefilled {new}, TTFT {warm * 1e3:.1f} ms (whole prompt: {cold * 1e3:.1f} ms)")
        news = {new for _, _, new, _, _ in rows}
        check(max(news) - min(news) <= 4, f"turn 2 prefills the same few tokens whatever the history: {rows}")
        check(rows[-1][1] > 8 * rows[-1][2], f"most of a long history is reused: {rows[-1]}")
        # In a session the reply's end is prefilled in the background for the next turn, which
        # then prefills only its own message; the reply is the one a cold prefill gives.
        c = s.client
        first = [{"role": "system", "content": "You are assistant s."}, user(" ".join(f"v{i}" for i in range(300)))[0]]
        prefills = s.metrics()["tandem_prefix_cache_reply_prefills_total"]
        r = c.chat.completions.create(model=MODEL, messages=first, max_tokens=8, temperature=0, extra_body={"session_id": "c1"})
        wait_until(lambda: s.metrics()["tandem_prefix_cache_reply_prefills_total"] == prefills + 1, "the reply's end prefilled for the session")
        second = first + [{"role": "assistant", "content": r.choices[0].message.content}] + user("And then?")
        warm = c.chat.completions.create(model=MODEL, messages=second, max_tokens=6, temperature=0, extra_body={"session_id": "c1"})
        cold = c.chat.completions.create(model=MODEL, messages=second, max_tokens=6, temperature=0, extra_body={"cache_salt": "cold"})
        new = warm.usage.prompt_tokens - warm.usage.prompt_tokens_details.cached_tokens
        check(new + 8 <= rows[0][2], f"the session's turn 2 prefills only its own message, not the 8-token reply again: {warm.usage}, {rows}")
        check(cold.usage.prompt_tokens_details.cached_tokens == 0, f"a new salt sees nothing cached: {cold.usage}")
        check(warm.choices[0].message.content == cold.choices[0].message.content, "the session's reply equals the cold one")
        print(f"  session: turn 2 prefills {new} of {warm.usage.prompt_tokens} prompt tokens (the reply's end was prefilled in the background)")
        # Token ids in and out (return_token_ids): an agent loop's next prompt is the last one,
        # the reply's ids and a tool result; in a session it is sent at once and waits for the
        # reply end's prefill instead of prefilling the reply again.
        prompt = [(i * 37 + 11) % 200 + 5 for i in range(300)]
        for turn in range(3):
            status, _, body = s.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                                                              "return_token_ids": True, "session_id": "agent"}))
            check(status == 200, f"completions with token ids: {status} {body}")
            r = json.loads(body)
            ids = r["choices"][0]["token_ids"]
            check(len(ids) == r["usage"]["completion_tokens"] == 6, f"token_ids hold the reply's tokens: {r}")
            if turn > 0:
                check(r["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 40, f"turn {turn} continues the previous reply's end: {r['usage']}")
            prompt = prompt + ids + [(turn * 13 + i) % 200 + 5 for i in range(40)]
        stream = c.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, stream=True, extra_body={"return_token_ids": True, "ignore_eos": True})
        streamed = [t for chunk in stream for ch in chunk.choices for t in (ch.model_extra or {}).get("token_ids", [])]
        whole = json.loads(s.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}))[2])
        check(streamed == whole["choices"][0]["token_ids"] and len(streamed) == 5, f"streamed deltas' token_ids add up to the whole reply's: {streamed} {whole['choices'][0]}")
    print("  multi-turn: the second turn continues the first turn's state; its prefill does not grow with the history")


def typing_ahead():
    with Server() as s:
        history = [{"role": "system", "content": "Be brief."}]
        text = "Could you explain how a recurrent state differs from a KV cache"
        pre = None
        for cut in (10, 30, len(text)):
            status, _, body = s.request("POST", "/v1/chat/typing", json.dumps({"model": MODEL, "session_id": "u1", "messages": history + user(text[:cut])}))
            check(status == 200, f"typing: {status} {body}")
            pre = json.loads(body)
        check(pre["cached_tokens"] > 0, f"typing continues its earlier snapshot: {pre}")
        r = s.client.chat.completions.create(model=MODEL, messages=history + user(text), max_tokens=4, temperature=0, extra_body={"session_id": "u1"})
        check(r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens, f"sent as typed: nothing left to prefill: {r.usage}")
        other = s.client.chat.completions.create(model=MODEL, messages=history + user(text), max_tokens=4, temperature=0, extra_body={"session_id": "u2", "cache_salt": "u2"})
        check(other.usage.prompt_tokens_details.cached_tokens == 0, "under another cache_salt nothing of u1's is seen")
        check(other.choices[0].message.content == r.choices[0].message.content, "typed-ahead state gives the same reply as a cold prefill")
        shared = s.client.chat.completions.create(model=MODEL, messages=history + user(text), max_tokens=4, temperature=0)
        check(shared.usage.prompt_tokens_details.cached_tokens == shared.usage.prompt_tokens, f"without a salt the prefix cache is shared: {shared.usage}")
        status, _, body = s.request("POST", "/v1/chat/typing", json.dumps({"messages": user("x")}))
        check(status == 400 and json.loads(body)["error"]["param"] == "session_id", f"typing needs a session: {body}")
        print(f"  typing ahead: message prefilled while typed ({pre}); sent as typed, {r.usage.prompt_tokens} of {r.usage.prompt_tokens} prompt tokens cached")


def read_events(sock_file, n):
    """Read n SSE data lines from a raw HTTP response."""
    got = 0
    while got < n:
        line = sock_file.readline()
        if not line:
            raise AssertionError("the stream ended early")
        if line.startswith(b"data: "):
            got += 1


def raw_post(s, path, body):
    sock = socket.create_connection((s.host, s.port))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def cancellation():
    with Server() as s:
        long = {"model": MODEL, "messages": user("Go on forever."), "max_tokens": 30000, "temperature": 0}
        sock = raw_post(s, "/v1/chat/completions", {**long, "stream": True})
        read_events(sock.makefile("rb"), 5)
        check(s.metrics()["tandem_active_sequences"] == 1, "the stream is running")
        sock.close()
        t = time.monotonic()
        wait_until(lambda: s.metrics()["tandem_active_sequences"] == 0, "a closed stream frees its sequence")
        freed = time.monotonic() - t
        check(s.metrics()['tandem_requests_total{endpoint="chat",outcome="cancelled"}'] == 1, "counted as cancelled")
        generated = s.metrics()["tandem_generation_tokens_total"]
        time.sleep(0.3)
        check(s.metrics()["tandem_generation_tokens_total"] == generated, "no tokens are generated for it afterwards")

        sock = raw_post(s, "/v1/chat/completions", long)
        wait_until(lambda: s.metrics()["tandem_generation_tokens_total"] > generated + 5, "the whole-response request runs")
        sock.close()
        wait_until(lambda: s.metrics()["tandem_active_sequences"] == 0, "a client that leaves before a whole response cancels it")
        check(s.metrics()['tandem_requests_total{endpoint="chat",outcome="cancelled"}'] == 2, "counted as cancelled")
        r = s.client.chat.completions.create(model=MODEL, messages=user("next"), max_tokens=2)
        check(r.usage.completion_tokens == 2, "serving on")
        print(f"  cancellation: a client closing its stream freed its sequence in {freed * 1e3:.0f} ms; a whole-response client too")


def shutdown():
    s = Server("--max-concurrent", "1")
    # (ignore_eos: a sampled stop token must not end the stream before the signal's grace does)
    stream = raw_post(s, "/v1/chat/completions", {"model": MODEL, "messages": user("Go on."), "max_tokens": 30000, "ignore_eos": True, "stream": True})
    events = stream.makefile("rb")
    read_events(events, 2)
    queued = raw_post(s, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3})
    wait_until(lambda: s.metrics()["tandem_queue_depth"] == 1, "a second request queues behind the stream")
    t = time.monotonic()
    s.proc.terminate()
    # The stream runs on through the grace period, then ends with a finish reason and [DONE].
    last, done = None, False
    for line in events:
        if line.startswith(b"data: "):
            payload = line[6:].strip()
            if payload == b"[DONE]":
                done = True
                break
            last = json.loads(payload)
    ended = time.monotonic() - t
    answer = queued.makefile("rb").read().decode(errors="replace")
    code = s.proc.wait(30)
    took = time.monotonic() - t
    finish = last and last["choices"] and last["choices"][0]["finish_reason"]
    check(done and finish == "abort" and 9 < ended < 15, f"SIGTERM: the stream ended after {ended:.1f} s (10 s of grace) with finish_reason {finish!r} and [DONE] ({done})")
    check(answer.startswith("HTTP/1.1 503") and "shutting_down" in answer, f"a request still queued at the grace period's end is refused: {answer[:300]}")
    check(code == 0 and took < 20, f"exit {code} after {took:.1f} s")
    check(any("stopping" in line for line in s.log) and any(line.endswith("stopped") for line in s.log), "\n".join(s.log))
    print(f"  shutdown: SIGTERM with a stream running and a request queued: the stream had its 10 s, then ended with finish_reason abort and [DONE]; the queued request got 503; exit 0 after {took:.1f} s")


def queue_and_429():
    with Server("--max-concurrent", "1", "--max-queue", "1") as s:
        long = {"model": MODEL, "messages": user("Go on."), "max_tokens": 30000, "temperature": 0, "ignore_eos": True, "stream": True}
        first = raw_post(s, "/v1/chat/completions", long)
        read_events(first.makefile("rb"), 2)
        second = raw_post(s, "/v1/chat/completions", long)
        wait_until(lambda: s.metrics()["tandem_queue_depth"] == 1, "the second request queues")
        status, headers, body = s.request("POST", "/v1/chat/completions", json.dumps({**long, "max_tokens": 2}))
        err = json.loads(body)["error"]
        check(status == 429 and int(headers.get("retry-after", headers.get("Retry-After", "0"))) >= 1 and err["type"] == "rate_limit_error", f"past the queue: {status} {headers} {err}")
        try:
            s.client.chat.completions.create(model=MODEL, messages=user("x"), max_tokens=2)
            raise AssertionError("the openai client got through a full queue")
        except openai.RateLimitError as e:
            check(e.status_code == 429, "openai sees RateLimitError")
        # A client that leaves while queued frees its place and is counted as cancelled.
        cancelled = 'tandem_requests_total{endpoint="chat",outcome="cancelled"}'
        second.close()
        wait_until(lambda: s.metrics()["tandem_queue_depth"] == 0, "a client gone while queued leaves the queue")
        check(s.metrics().get(cancelled, 0) == 1, f"a request dropped while queued is counted: {s.metrics().get(cancelled)}")
        third = raw_post(s, "/v1/chat/completions", long)
        wait_until(lambda: s.metrics()["tandem_queue_depth"] == 1, "the third request queues")
        first.close()
        read_events(third.makefile("rb"), 2)
        check(s.metrics()["tandem_queue_depth"] == 0 and s.metrics()["tandem_active_sequences"] == 1, "the queued request runs once the first leaves")
        third.close()
        wait_until(lambda: s.metrics()["tandem_active_sequences"] == 0, "all freed")
        print(f"  queue: past --max-concurrent 1 a request waits (one that leaves while waiting is counted as cancelled); past --max-queue 1, 429 with Retry-After {headers.get('retry-after')}")


def load_test(clients=32, requests=256):
    # A K/V budget of 8 blocks (4 KiB each on the tiny model, whose CPU engine serves here):
    # room for two or three of the 8 sequences, so requests wait for room and running ones
    # are swapped out to disk and back.
    with Server("--max-concurrent", "8", "--max-queue", "16", "--prefix-cache-memory", "64MiB", "--kv-cache-memory", "32KiB") as s:
        prompts = [f"Request {i}: say something about the number {i * 7919 % 1000}." for i in range(requests)]
        lengths = [8 + i % 17 for i in range(requests)]
        # What each prompt gives alone (greedy), to find any stream that got another's tokens.
        expected = [s.client.chat.completions.create(model=MODEL, messages=user(p), max_tokens=n, temperature=0).choices[0].message.content for p, n in zip(prompts, lengths)]
        baseline = s.rss_kib()
        aclient = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
        results = [None] * requests
        refusals = [0]
        next_i = iter(range(requests))

        async def worker():
            # A refused request is retried after its Retry-After (at most 1 s here), 3 times.
            for i in next_i:
                for attempt in range(4):
                    try:
                        stream = await aclient.chat.completions.create(model=MODEL, messages=user(prompts[i]), max_tokens=lengths[i], temperature=0, stream=True, stream_options={"include_usage": True})
                        text, usage = [], None
                        async for chunk in stream:
                            usage = chunk.usage or usage
                            text.extend(ch.delta.content or "" for ch in chunk.choices)
                        results[i] = ("done", "".join(text), usage)
                        break
                    except openai.RateLimitError as e:
                        results[i] = ("refused", e.response.headers.get("retry-after"), None)
                        refusals[0] += 1
                        await asyncio.sleep(min(1.0, float(results[i][1] or 1)))

        async def run():
            await asyncio.gather(*(worker() for _ in range(clients)))
            await aclient.close()

        t = time.monotonic()
        asyncio.run(asyncio.wait_for(run(), 300))
        took = time.monotonic() - t
        done = [i for i, r in enumerate(results) if r and r[0] == "done"]
        refused = [i for i, r in enumerate(results) if r and r[0] == "refused"]
        check(len(done) + len(refused) == requests, f"every request completed or was refused: {len(done)} + {len(refused)} of {requests}")
        check(all(results[i][2] is not None and results[i][2].completion_tokens == lengths[i] for i in done), "every completed stream has its usage")
        mixed = [i for i in done if results[i][1] != expected[i]]
        check(not mixed, f"streams whose text is not their own prompt's: {mixed[:5]}")
        check(all(results[i][1] and int(results[i][1]) >= 1 for i in refused), "refusals carry Retry-After")
        wait_until(lambda: s.metrics()["tandem_active_sequences"] == 0 and s.metrics()["tandem_queue_depth"] == 0, "idle after the load")
        after = s.rss_kib()
        m = s.metrics()
        check(m['tandem_prefix_cache_bytes{tier="host"}'] <= 64 << 20, "the prefix cache stays within --prefix-cache-memory")
        check(m["tandem_kv_cache_blocks_limit"] == 8, "the K/V budget is 8 blocks")
        check(m["tandem_kv_cache_blocks_used"] == 0 and m["tandem_state_slots_used"] == 0, "every block and slot is back")
        swaps = (m['tandem_kv_cache_swaps_total{direction="out"}'], m['tandem_kv_cache_swaps_total{direction="in"}'])
        check(swaps[0] > 0 and swaps[0] == swaps[1], f"sequences were swapped out and all came back: {swaps}")
        check(after - baseline < 48 * 1024, f"memory back to its baseline: {baseline} KiB before, {after} KiB after")
        check(refusals[0] > 0, "the load went past --max-queue (else raise it)")
        print(f"  load: {clients} streaming clients, {requests} requests in {took:.1f} s: {len(done)} completed with their own text, {len(refused)} refused (429) after 3 retries"
              f" ({refusals[0]} refusals in all); {int(swaps[0])} sequences swapped out to disk and back;"
              f" RSS {baseline // 1024} MiB before, {after // 1024} MiB after")


def disk_tier():
    d = tempfile.mkdtemp(prefix="tandem-prefix-disk-")
    body = {"model": MODEL, "messages": user("tell me about " + "rivers and seven quick engines " * 12), "max_tokens": 8, "temperature": 0}

    def ask(s):
        status, _, raw = s.request("POST", "/v1/chat/completions", json.dumps(body))
        r = json.loads(raw)
        check(status == 200, f"{status} {raw}")
        return r["choices"][0]["message"]["content"], r["usage"]["prompt_tokens_details"]["cached_tokens"]

    # No host memory for snapshots: each goes straight to the directory.
    args = ("--prefix-cache-memory", "1", "--prefix-cache-dir", d)
    with Server(*args) as s:
        cold, cached = ask(s)
        m = s.metrics()
        check(cached == 0 and m['tandem_prefix_cache_snapshots{tier="disk"}'] >= 1, f"first server: cached {cached}, {m}")
    with Server(*args) as s:
        again, cached = ask(s)
        check(cached > 0 and again == cold, f"a restarted server: cached {cached}, {again!r} against {cold!r}")
        check(any("from an earlier server" in line for line in s.log), "\n".join(s.log))
    for name in os.listdir(d):
        if name.endswith(".state"):
            path = os.path.join(d, name)
            data = bytearray(open(path, "rb").read())
            data[len(data) // 2] ^= 0x40
            open(path, "wb").write(bytes(data))
    with Server(*args) as s:
        damaged, cached = ask(s)
        m = s.metrics()
        check(cached == 0 and damaged == cold and m["tandem_prefix_cache_refused_total"] >= 1, f"damaged files: cached {cached}, {damaged!r}, {m}")
        check(any("refused" in line and ".state" in line for line in s.log), "\n".join(s.log))
    shutil.rmtree(d)
    print(f"  disk tier: a restarted server continued {d}'s snapshot with the same reply; damaged files were refused and the prompt prefilled")


def main():
    checks = [api_and_sdk, sampling_options, tools_in_prompts, structured_output, curl_checks, multi_turn, typing_ahead, cancellation, disk_tier, shutdown, queue_and_429, load_test]
    only = sys.argv[1:]
    failed = 0
    for f in checks:
        if only and f.__name__ not in only:
            continue
        t = time.monotonic()
        print(f"{f.__name__}:", flush=True)
        try:
            f()
            print(f"  ok ({time.monotonic() - t:.1f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - report every check
            failed += 1
            print(f"  FAILED: {type(e).__name__}: {e}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
