"""User reward functions in a process of their own, and the failures of host rewards.

`ProcessScore("package.module:function", name=..., timeout_s=...)` is a score function
`(responses, ground_truths) -> scores` that runs the user's function in a worker process: a
fresh `python -c` process (started with `subprocess`: not forked from the trainer, whose JAX
threads a fork would copy half-way; not `multiprocessing`'s spawn or forkserver either, whose
children import the trainer's `__main__` module, `jrl.train`, and JAX with it) that loads this
file alone (standard library only) and the user's module. Requests and replies are pickles over
its stdin / stdout; a reply is read back with an unpickler that builds nothing but plain Python
values and numpy arrays, so no reply can run code in the trainer. Whatever the function does,
the trainer goes on and the failure is named in one line (the `error` class it is given:
`jrl.rewards.RewardError`):

  - it raises (anything, `sys.exit` and KeyboardInterrupt included): an exception of the same
    type name and message is raised in the trainer, so `checked_scores` names the sample as for
    an in-process function (it calls the function again one sample at a time);
  - its process ends (`os._exit`, a crash, the kernel's OOM killer) or it runs longer than
    `timeout_s`: the process is killed, a fresh one is started, and the batch's samples are
    scored one at a time (each within `timeout_s`, for at most `timeout_s` more) until one
    fails the same way, which the error names (the batch as a whole when none does alone); the
    `ProcessScore` then refuses every later call with the same error;
  - a stop was requested (`request_stop`, called on SIGTERM / SIGINT by the trainer) while it
    runs: the call gets `STOP_GRACE_S` more seconds, then raises `Stopped`.

The worker starts when the `ProcessScore` is made, which waits until it has imported the
function (a one-line ValueError when that fails, as `jrl.rewards.math.import_path` words it). It
runs in a session of its own (a Ctrl-C at the terminal reaches the trainer alone), with
`JAX_PLATFORMS=cpu` (a function that uses JAX computes on the host, leaving the accelerators to the
trainer), and ends when the trainer does: at end of input, or (Linux) by the parent-death signal
when the trainer is killed outright. Its prints go to the trainer's stderr.

`Outcome` is the other half: the host callback of a Python reward (`jrl.rewards.python`) calls
its score function through `Outcome.call`. By default an exception passes through (inside
`jax.jit` it reaches the caller as an XLA runtime error); once `defer` was called (the trainer
does), the first exception is recorded instead and the callback returns zeros, so that the
step ends normally and the trainer reads the failure before it keeps anything of the step.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref

STOP_GRACE_S = 5.0  # after a stop request, a running user reward may go on this long
STARTUP_S = 120.0  # time limit for a worker to start and import the user's function
_POLL_S = 0.05  # how often a waiting call looks at the clock and for a stop request

# Request a stop (monotonic time of the request, or None) and whether a call was abandoned since.
_stop = {"at": None, "abandoned": False}
_stop_lock = threading.Lock()


class Stopped(Exception):
    """A user reward was abandoned because a stop was requested while it ran."""


def request_stop() -> None:
    """A stop was requested (the trainer's SIGTERM / SIGINT handler): user rewards running now
    or started later get `STOP_GRACE_S` seconds, then raise `Stopped`."""
    with _stop_lock:
        if _stop["at"] is None:
            _stop["at"] = time.monotonic()


def clear_stop() -> None:
    """Forgets a stop request (a new run in the same process)."""
    with _stop_lock:
        _stop["at"], _stop["abandoned"] = None, False


def abandoned() -> bool:
    """Whether a call was abandoned for a stop request since the last `clear_stop`."""
    return _stop["abandoned"]


def _stop_deadline() -> float | None:
    at = _stop["at"]
    return None if at is None else at + STOP_GRACE_S


class Outcome:
    """The failure of a host reward's callback, for whoever runs the step to read afterwards."""

    def __init__(self):
        self.deferred = False  # record failures (True) or let them raise (False)
        self.error: BaseException | None = None  # the first failure recorded
        self.interrupted = False  # it came from a stop request
        self._lock = threading.Lock()

    def defer(self) -> None:
        """From now on record a failure and return zeros instead of raising."""
        self.deferred = True

    def call(self, fn, args, zeros):
        """`fn(*args)`; deferred, after a failure (this call's or an earlier one's) `zeros`."""
        if self.error is not None and self.deferred:
            return zeros
        try:
            return fn(*args)
        except BaseException as e:  # noqa: BLE001 - every failure ends as a recorded one
            if not self.deferred:
                raise
            with self._lock:
                if self.error is None:
                    self.error = e
                    self.interrupted = isinstance(e, Stopped) or abandoned()
            return zeros

    def take(self) -> tuple[BaseException | None, bool]:
        """(the recorded failure or None, whether a stop caused it); clears both."""
        with self._lock:
            out = self.error, self.interrupted
            self.error, self.interrupted = None, False
        return out


# -------------------------------------------------------------------------------- the worker

# The worker: this file run alone (no jrl package, no JAX), its `serve` answering requests.
_WORKER_CODE = (
    "import importlib.util, sys; "
    "spec = importlib.util.spec_from_file_location('_jrl_reward_worker', sys.argv[1]); "
    "module = importlib.util.module_from_spec(spec); "
    "spec.loader.exec_module(module); module.serve(sys.argv[2], int(sys.argv[3]))"
)


def _load_import_path():
    """`jrl.rewards.math.import_path`, from that file alone (it imports the standard library
    only), so the worker imports neither the jrl package nor JAX."""
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("_jrl_reward_math", os.path.join(here, "math.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.import_path


def serve(path: str, parent: int) -> None:
    """The worker's loop: import `path`, say ready, answer each request until the input ends."""
    if sys.platform.startswith("linux"):  # killed with the trainer, however the trainer ends
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        return
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the function's own reads and prints never touch the protocol
    os.dup2(2, 1)

    def send(message) -> None:
        replies.write(pickle.dumps(message))
        replies.flush()

    try:
        fn = _load_import_path()(path, "reward function")
    except BaseException as e:  # noqa: BLE001 - a ValueError naming the problem, or the import's
        send(("failed", str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"))
        return
    send(("ready",))
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        try:
            result = fn(*request)
        except BaseException as e:  # noqa: BLE001 - sys.exit and KeyboardInterrupt too
            send(("raised", type(e).__name__, str(e)))
            continue
        try:
            message = pickle.dumps(("ok", _plain(result)))
        except Exception as e:  # noqa: BLE001 - an object that cannot be pickled
            message = pickle.dumps(
                ("raised", "TypeError", f"its result, a {type(result).__name__}, cannot be sent "
                 f"back ({e}); return a list of floats")
            )
        replies.write(message)
        replies.flush()


def _plain(result):
    """`result` as plain values: a sequence (not a string) becomes a list whose real numbers
    (numpy's, fractions) are floats; anything else is sent as it is."""
    import numbers

    if isinstance(result, (str, bytes, dict)) or not hasattr(result, "__len__"):
        return result
    try:
        items = list(result)
    except Exception:  # noqa: BLE001 - a len() without iteration: sent as it is
        return result
    return [
        float(x) if isinstance(x, numbers.Real) and not isinstance(x, (bool, int)) else x
        for x in items
    ]


class _Refused(pickle.UnpicklingError):
    """A reply holding an object of a class the trainer does not build."""


class _Replies(pickle.Unpickler):
    """Reads a worker's reply: plain Python values and numpy arrays / scalars, nothing else."""

    _NUMPY_MODULES = ("numpy", "numpy.core.multiarray", "numpy._core.multiarray", "numpy.dtypes")
    _NUMPY = {"_reconstruct", "scalar", "ndarray", "dtype", "_frombuffer"}
    _BUILTINS = {"complex", "set", "frozenset", "bytearray", "slice", "range"}

    def find_class(self, module, name):
        numpy = module in self._NUMPY_MODULES and (name in self._NUMPY or name.endswith("DType"))
        if numpy or (module == "builtins" and name in self._BUILTINS):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


class _Hard(Exception):
    """The worker ended or ran out of time, or its reply cannot be read (not an exception of
    the function): (what happened, the fix)."""


def _preview(text: str) -> str:
    return repr(text if len(text) <= 80 else text[:77] + "...")


def _raised(type_name: str, message: str) -> Exception:
    """An exception named as the function's was (its class is not imported here)."""
    return type(type_name, (Exception,), {"__module__": "reward"})(message)


class _Process:
    """One worker process."""

    def __init__(self, path: str):
        here = os.path.abspath(__file__)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        env["JAX_PLATFORMS"] = "cpu"  # a function that uses JAX must not take the trainer's GPU
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CODE, here, path, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # a Ctrl-C at the terminal goes to the trainer only
        )

    def send(self, request) -> None:
        self.proc.stdin.write(pickle.dumps(request))
        self.proc.stdin.flush()

    def wait(self, timeout: float) -> bool:
        """True once a reply (or the end of the output) can be read, within `timeout` s."""
        import multiprocessing.connection

        return bool(multiprocessing.connection.wait([self.proc.stdout], timeout))

    def recv(self):
        return _Replies(self.proc.stdout).load()

    def kill(self) -> int | None:
        """Kills the process (if alive); its exit status."""
        if self.proc.poll() is None:
            self.proc.kill()
        status = self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        return status


class ProcessScore:
    """A user score function "package.module:function" / "path/to/file.py:function" run in a
    worker process (see the module docstring).

    Args:
      path: where the function is (a "user:" prefix is allowed).
      name: the reward's name, for messages.
      timeout_s: time limit of one call (one batch), seconds; None: no limit.
      error: the exception class of a failure that is not the function's own exception
        (`jrl.rewards.RewardError`).
      startup_s: time limit for the worker to start and import the function.
    """

    def __init__(
        self,
        path: str,
        *,
        name: str,
        timeout_s: float | None,
        error: type[Exception] = ValueError,
        startup_s: float = STARTUP_S,
    ):
        self.path, self.name, self.timeout_s = path.removeprefix("user:"), name, timeout_s
        self._error = error
        self._broken: str | None = None  # the message every call raises after a hard failure
        self._lock = threading.Lock()
        self._worker = self._start(startup_s)
        self._finalizer = weakref.finalize(self, _Process.kill, self._worker)

    def _start(self, startup_s: float) -> _Process:
        worker = _Process(self.path)
        if not worker.wait(startup_s):
            worker.kill()
            raise ValueError(
                f"reward {self.name!r}: its worker process did not import the function within "
                f"{startup_s:.0f}s; check what the module does when imported."
            )
        try:
            reply = worker.recv()
        except (EOFError, pickle.UnpicklingError):
            status = worker.kill()
            raise ValueError(
                f"reward {self.name!r}: its worker process exited (status {status}) while "
                "importing the function; see its error output above."
            ) from None
        if reply[0] == "failed":
            worker.kill()
            raise ValueError(reply[1])
        return worker

    def close(self) -> None:
        """Stops the worker (calls after this fail)."""
        self._finalizer()

    def __call__(self, responses, ground_truths):
        with self._lock:
            if self._broken is not None:
                raise self._error(self._broken)
            try:
                reply = self._request(self._worker, [list(responses), list(ground_truths)])
            except _Hard as e:
                self._broken = self._name_the_sample(e, responses, ground_truths)
                raise self._error(self._broken) from None
        if reply[0] == "raised":
            raise _raised(reply[1], reply[2])
        return reply[1]

    def _request(self, worker: _Process, request):
        """The worker's reply to `request`; _Hard when it ends or runs out of time, Stopped
        after a stop request and its grace."""
        start = time.monotonic()
        try:
            worker.send(request)
        except OSError:  # the worker is gone
            pass
        while True:
            deadlines = [start + self.timeout_s] if self.timeout_s is not None else []
            stop = _stop_deadline()
            if stop is not None:
                deadlines.append(stop)
            left = min(deadlines, default=float("inf")) - time.monotonic()
            if worker.wait(max(0.0, min(left, _POLL_S))):
                try:
                    return worker.recv()
                except (EOFError, OSError, pickle.UnpicklingError) as e:
                    return self._unreadable(worker, e)
            if time.monotonic() < min(deadlines, default=float("inf")):
                continue
            worker.kill()
            if stop is not None and time.monotonic() >= stop:
                _stop["abandoned"] = True
                raise Stopped(
                    f"reward {self.name!r} was still running {STOP_GRACE_S:.0f}s after the stop "
                    "request; abandoned"
                )
            raise _Hard(
                f"took longer than reward.timeout_s={self.timeout_s:g}s",
                "fix the reward function, or raise reward.timeout_s",
            )

    def _unreadable(self, worker: _Process, error: Exception):
        """A reply that does not read back: the worker ended, or sent an object of a class the
        trainer does not build."""
        status = worker.kill()
        if _stop["at"] is not None:  # e.g. signalled with the trainer's whole process group
            _stop["abandoned"] = True
            raise Stopped(f"reward {self.name!r} ended after the stop request")
        if isinstance(error, _Refused):
            raise _Hard(
                f"returned a value holding a {error} object, which the trainer does not read back",
                "return one float per response",
            )
        raise _Hard(
            f"ended its process (exit status {status}: os._exit, a crash or the OOM killer)",
            "fix the reward function",
        )

    def _name_the_sample(self, failure: _Hard, responses, ground_truths) -> str:
        """The one-line error of a hard failure: the samples are scored one at a time in a fresh
        worker (each within `timeout_s`) until one fails the same way, starting no sample
        `timeout_s` after the first (a call that timed out so ends within three times its
        limit); the batch is named when none does."""
        where = f"a batch of {len(responses)} responses (no sample fails alone)"
        end = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        worker = None
        try:
            for i, (r, g) in enumerate(zip(responses, ground_truths)):
                if end is not None and time.monotonic() > end:
                    break
                if worker is None or worker.proc.poll() is not None:
                    worker = self._start(STARTUP_S)
                try:
                    self._request(worker, [[r], [g]])
                except _Hard as e:
                    failure, where = e, f"sample {i} (response {_preview(r)})"
                    break
        except ValueError:  # the worker did not start again: the batch is all we can name
            pass
        finally:
            if worker is not None:
                worker.kill()
        problem, fix = failure.args
        return f"reward {self.name!r} {problem} on {where}; {fix}."
