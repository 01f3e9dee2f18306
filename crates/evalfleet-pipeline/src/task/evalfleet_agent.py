"""evalfleet's persistent-agent helper (`task.mode: server`).

evalfleet puts this file on the agent's PYTHONPATH. It turns a function
into a server of evalfleet's agent protocol (JSON lines on standard input
and output, docs/agents.md), so that the agent's imports and set-up are
paid once per process, not once per item:

    from evalfleet_agent import serve

    def solve(item, client):          # or: async def solve(item, client)
        reply = client.chat.completions.create(model="m", messages=[...])
        return reply.choices[0].message.content

    serve(solve)                      # serve(solve, fork=True): a process per item

or, with no code of its own, `python3 -m evalfleet_agent agent.py solve`.

`item` is the item as the agent is given it; `client` has `base_url`,
`api_key`, `item_id` and `attempt`, and is used as an `openai.OpenAI` (an
`openai.AsyncOpenAI` for an `async def`) pointed at the item's own address
at the run's gateway: `client.chat.completions.create(...)` (the SDK's
client is made on first use). The return value
is the answer (a value that is not a string is sent as JSON); an exception
fails the attempt with its message.

Items run concurrently: `async def` solvers as tasks of one event loop,
plain ones on threads, at most EVALFLEET_CONCURRENCY at once. With
`fork=True` each item runs in a child forked from the loaded agent (its
imports shared copy-on-write), for agents that keep state in globals.
Whatever the agent prints goes to standard error: standard output is the
protocol's.
"""

import asyncio
import concurrent.futures
import inspect
import json
import os
import signal
import sys
import threading
import traceback

__all__ = ["serve", "Context"]


class Context:
    """Where an item's calls go, for agents that make their own client."""

    def __init__(self, request):
        self.base_url = request["base_url"]
        self.api_key = request["api_key"]
        self.item_id = request.get("item_id")
        self.attempt = request.get("attempt")


class _Client(Context):
    """The item's client: an `openai.OpenAI` (`AsyncOpenAI`) made on first
    use, so that an agent that makes its own (LangChain's ChatOpenAI from
    `base_url` and `api_key`) does not pay for one it never uses."""

    def __init__(self, request, asynchronous):
        super().__init__(request)
        self._asynchronous = asynchronous
        self._real = None

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_real", "_asynchronous"):
            raise AttributeError(name)
        if self._real is None:
            import openai

            kind = openai.AsyncOpenAI if self._asynchronous else openai.OpenAI
            # evalfleet's gateway retries what may be retried; the SDK
            # does not. Items share the process's connections.
            self._real = kind(
                base_url=self.base_url,
                api_key=self.api_key,
                max_retries=0,
                http_client=_http(self._asynchronous),
            )
        return getattr(self._real, name)


_HTTP = {}
_HTTP_LOCK = threading.Lock()


def _http(asynchronous):
    """The process's HTTP client for the SDK (an async one per event loop):
    made once, not once per item (each costs a TLS context)."""
    import openai

    if asynchronous:
        key = id(asyncio.get_running_loop())
        make = openai.DefaultAsyncHttpxClient
    else:
        key = "sync"
        make = openai.DefaultHttpxClient
    with _HTTP_LOCK:
        if key not in _HTTP:
            _HTTP[key] = make()
        return _HTTP[key]


def _client(request, asynchronous):
    return _Client(request, asynchronous)


def _answer_of(value):
    return value if isinstance(value, str) else json.dumps(value)


class _Protocol:
    """The protocol's streams, kept from the agent's code: its requests
    come on a descriptor of their own, its replies go out one whole line at
    a time."""

    def __init__(self):
        # The protocol keeps the real standard input and output; the agent's
        # code and the programs it starts read an empty input and write to
        # standard error, so that a tool's `cat` or a stray print takes or
        # spoils no line.
        self._out = os.fdopen(os.dup(1), "w", encoding="utf-8")
        self.requests = os.fdopen(os.dup(0), "rb")
        os.dup2(2, 1)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        sys.stdout = sys.stderr
        sys.stdin = open(os.devnull, "r")
        self._lock = threading.Lock()

    def reply(self, key, output=None, error=None):
        message = {"key": key}
        if error is not None:
            message["error"] = error
        else:
            try:
                message["output"] = _answer_of(output)
            except (TypeError, ValueError) as exc:
                message["error"] = "its answer cannot be sent as JSON: %s" % exc
        line = json.dumps(message, ensure_ascii=False) + "\n"
        with self._lock:
            self._out.write(line)
            self._out.flush()


def _failure(exc):
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    traceback.print_exc(file=sys.stderr)
    return text


def serve(solve, fork=False, concurrency=None):
    """Serves evalfleet's items with `solve(item, client)` until standard
    input ends."""
    protocol = _Protocol()
    limit = concurrency or int(os.environ.get("EVALFLEET_CONCURRENCY", "16"))
    asynchronous = inspect.iscoroutinefunction(solve)
    if fork:
        runner = _Forking(solve, asynchronous, protocol, limit)
    elif asynchronous:
        runner = _Async(solve, protocol, limit)
    else:
        runner = _Threads(solve, protocol, limit)
    for raw in protocol.requests:
        try:
            request = json.loads(raw)
        except ValueError:
            print("evalfleet_agent: not a request: %r" % raw[:200], file=sys.stderr)
            continue
        if request.get("type") == "cancel":
            runner.cancel(request["key"])
        elif request.get("type") == "item":
            runner.submit(request)
    runner.close()


class _Threads:
    def __init__(self, solve, protocol, limit):
        self._solve, self._protocol = solve, protocol
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=limit)
        self._cancelled = set()
        self._lock = threading.Lock()

    def submit(self, request):
        self._pool.submit(self._run, request)

    def _run(self, request):
        key = request["key"]
        with self._lock:
            if key in self._cancelled:
                # Cancelled while it waited for a thread: not started.
                self._cancelled.discard(key)
                return
        try:
            output = self._solve(request["item"], _client(request, False))
            result = {"output": output}
        except BaseException as exc:  # noqa: BLE001 - the agent's failure is the item's
            result = {"error": _failure(exc)}
        with self._lock:
            if key in self._cancelled:
                self._cancelled.discard(key)
                return
        self._protocol.reply(key, **result)

    def cancel(self, key):
        # A thread cannot be stopped: its answer is dropped, and its calls
        # are refused by now (its address is closed).
        with self._lock:
            self._cancelled.add(key)

    def close(self):
        self._pool.shutdown(wait=True)


class _Async:
    def __init__(self, solve, protocol, limit):
        self._solve, self._protocol = solve, protocol
        self._loop = asyncio.new_event_loop()
        self._tasks = {}
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._gate = None
        self._limit = limit

    async def _run(self, request):
        key = request["key"]
        if self._gate is None:
            self._gate = asyncio.Semaphore(self._limit)
        try:
            async with self._gate:
                output = await self._solve(request["item"], _client(request, True))
            self._protocol.reply(key, output=output)
        except asyncio.CancelledError:
            pass
        except BaseException as exc:  # noqa: BLE001
            self._protocol.reply(key, error=_failure(exc))
        finally:
            self._tasks.pop(key, None)

    def submit(self, request):
        def start():
            self._tasks[request["key"]] = self._loop.create_task(self._run(request))

        self._loop.call_soon_threadsafe(start)

    def cancel(self, key):
        def stop():
            task = self._tasks.pop(key, None)
            if task is not None:
                task.cancel()

        self._loop.call_soon_threadsafe(stop)

    def close(self):
        async def drain():
            while self._tasks:
                await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)

        asyncio.run_coroutine_threadsafe(drain(), self._loop).result()


class _Forking:
    """A child per item, forked from this loaded process."""

    def __init__(self, solve, asynchronous, protocol, limit):
        self._solve, self._asynchronous, self._protocol = solve, asynchronous, protocol
        self._gate = threading.Semaphore(limit)
        self._children = {}
        self._cancelled = set()
        self._lock = threading.Lock()
        self._threads = []

    def submit(self, request):
        thread = threading.Thread(target=self._run, args=(request,), daemon=True)
        self._threads.append(thread)
        thread.start()

    def _run(self, request):
        key = request["key"]
        with self._gate:
            with self._lock:
                if key in self._cancelled:
                    self._cancelled.discard(key)
                    return
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                # Only its own pipe's end stays open: not another item's
                # (forked by another thread meanwhile), not the protocol's.
                os.closerange(3, write)
                os.closerange(write + 1, 1 << 16)
                code = 0
                try:
                    client = _client(request, self._asynchronous)
                    if self._asynchronous:
                        output = asyncio.run(self._solve(request["item"], client))
                    else:
                        output = self._solve(request["item"], client)
                    result = {"output": _answer_of(output)}
                except BaseException as exc:  # noqa: BLE001
                    result = {"error": _failure(exc)}
                    code = 1
                with os.fdopen(write, "w", encoding="utf-8") as out:
                    out.write(json.dumps(result))
                os._exit(code)
            os.close(write)
            with self._lock:
                self._children[key] = pid
            with os.fdopen(read, "r", encoding="utf-8") as got:
                text = got.read()
            # Forgotten before it is reaped: a cancel from now on signals
            # no pid (which, once reaped, could be another process's).
            with self._lock:
                cancelled = self._children.pop(key, None) is None
            _, status = os.waitpid(pid, 0)
        if cancelled:
            return
        try:
            result = json.loads(text)
        except ValueError:
            result = {"error": "its process for the item ended with status %d and no answer" % status}
        self._protocol.reply(key, **result)

    def cancel(self, key):
        with self._lock:
            pid = self._children.pop(key, None)
            if pid is None:
                # Not forked yet: it will not be.
                self._cancelled.add(key)
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self):
        for thread in self._threads:
            thread.join()


def _main(argv):
    import importlib.util

    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print("usage: python3 -m evalfleet_agent FILE.py [FUNCTION] [--fork]", file=sys.stderr)
        return 2
    fork = "--fork" in argv
    words = [a for a in argv[1:] if a != "--fork"]
    path, name = words[0], (words[1] if len(words) > 1 else "solve")
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    spec = importlib.util.spec_from_file_location("evalfleet_user_agent", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    serve(getattr(module, name), fork=fork)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
