"""Answer checking for math tasks, on the host in pure Python: GSM8K numbers and MATH boxed answers.

Score functions here take a batch of decoded responses and ground truths and return one float per
response (`score_fn(responses: list[str], ground_truths: list[str]) -> list[float]`);
`jrl.rewards.python.make_python_reward` runs them inside the jitted step.

GSM8K (`Gsm8kScore`): the ground truth's answer is the number after its last `####` (or the whole
string when it holds no `####`, e.g. an already extracted "72"). A response's answer is the first
number after its last `####`; without `####` it is its last number (`fallback="last_number"`) or
nothing (`fallback="none"`, the strict format). Numbers may carry thousands commas, `$`, a sign,
decimals and trailing units ("$1,234.50 dollars" -> 1234.5); they are compared exactly as
fractions, so "18.00" equals "18".

MATH (`MathScore`): the answer is the content of the last `\\boxed{...}` (or `\\fbox{...}`, nested
braces allowed, `\\boxed 5` too) of the response; the ground truth's answer is its last boxed
content when it has one, else the whole string (MATH-500's `answer` field). Two answers are
equal when their normalised strings match (`normalize_answer`: `\\dfrac`, `\\left(`, spaces,
`^\\circ`, `\\%`, `$`, `\\text{ units}`, `x = ...`) or when both are plain numbers with the same
value; otherwise a symbolic check decides, through `math_verify` when it is installed (backend
"math_verify") or the sympy-based `sympy_equal` (backend "sympy"). The symbolic check runs in
worker processes with a per-answer time limit (`AnswerChecker`): an answer that takes longer
scores 0, is counted in `stats["timeouts"]`, and its worker is killed and replaced, so a
pathological expression never hangs the trainer.

Format (`FormatScore`): 1.0 when the response states a final answer in the expected form (a
`####` followed by a number for GSM8K, a boxed answer for MATH), else 0.0; correctness is
ignored.

Correct answers score 1.0; a stated but wrong answer scores `format_score` (default 0.0); a
response without an answer scores 0.0.
"""

from __future__ import annotations

import collections
import importlib
import importlib.util
import json
import logging
import multiprocessing.connection
import os
import re
import subprocess
import sys
import threading
import time
import weakref
from fractions import Fraction
from typing import Callable, Optional, Sequence

# ------------------------------------------------------------------------------------ numbers

# A number: optional sign (not after a word character, so "10-2" gives 10 and 2), thousands
# groups or plain digits, optional decimals; or a bare decimal ".5".
_NUMBER = re.compile(r"(?:(?<![\w.])[-−])?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<!\d)\.\d+")


def parse_number(text: str) -> Optional[Fraction]:
    """The exact value of a number string, or None: "1,234.50" -> 2469/2, "$-3" -> -3, "1/2" ->
    1/2, "50%" -> 50. Surrounding `$`, commas, spaces and a trailing "%" or "." are ignored."""
    s = text.strip().replace("−", "-").replace(",", "").replace("$", "").replace(" ", "")
    s = s.rstrip(".%")
    if not s or len(s) > 100:
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def extract_gsm8k_answer(text: str, fallback: str = "last_number") -> Optional[str]:
    """The final numeric answer of a GSM8K-style text, commas and `$` removed, or None.

    The first number after the last `####`; without `####`, the last number of the text when
    `fallback == "last_number"`, None when `fallback == "none"`. E.g. "... #### $1,234" ->
    "1234"; "so she has -3 apples." -> "-3".
    """
    if fallback not in GSM8K_FALLBACKS:
        raise ValueError(f"fallback={fallback!r}: use one of {', '.join(GSM8K_FALLBACKS)}.")
    _, marker, tail = text.rpartition("####")
    if marker:
        match = _NUMBER.search(tail)
    else:
        found = _NUMBER.findall(text) if fallback == "last_number" else []
        match = found[-1] if found else None
    if match is None:
        return None
    number = match if isinstance(match, str) else match.group(0)
    return number.replace(",", "").replace("−", "-")


GSM8K_FALLBACKS = ("last_number", "none")


# --------------------------------------------------------------------------------- boxed answers

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _closing_brace(text: str, open_index: int) -> int:
    """Index of the `}` matching the `{` at `open_index` (escaped `\\{` `\\}` skipped), or -1."""
    depth, i = 0, open_index
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def last_boxed(text: str) -> Optional[str]:
    """The content of the last `\\boxed{...}` / `\\fbox{...}` of `text`, or None.

    Nested braces are kept whole: "\\boxed{\\frac{1}{2}}" -> "\\frac{1}{2}". The brace-less form
    "\\boxed 5" gives the token after the space. An unclosed box gives None.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    rest_at = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    rest = text[rest_at:]
    if rest.startswith("{"):
        end = _closing_brace(rest, 0)
        return rest[1:end].strip() if end >= 0 else None
    if rest.startswith(" "):
        token = rest.strip().split(" ")[0].split("$")[0]
        return token or None
    return None


def ground_truth_answer(ground_truth: str) -> str:
    """The reference answer of a MATH ground truth: its last boxed content, else the string."""
    boxed = last_boxed(ground_truth)
    return ground_truth.strip() if boxed is None else boxed


# ------------------------------------------------------------------------------ normalisation

_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?![a-zA-Z])")
_REMOVE = (
    "\\displaystyle",
    "\\!",
    "\\,",
    "\\;",
    "\\:",
    "\\qquad",
    "\\quad",
    "^{\\circ}",
    "^\\circ",
    "°",
    "\\circ",
    "\\$",
    "$",
    "\\%",
    "%",
)
_TEXT_COMMANDS = r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)"
_TRAILING_TEXT_UNIT = re.compile(r"(?<=[\d}])\s*" + _TEXT_COMMANDS + r"\{[^{}]*\}(?:\^\{?\d\}?)?$")
_TEXT = re.compile(_TEXT_COMMANDS + r"\{([^{}]*)\}")
_WORD_UNITS = re.compile(r"^(-?[\d.,/]*\d)\s+[a-zA-Z][a-zA-Z\s.]*$")
_LHS = re.compile(r"^\\?[a-zA-Z]+(?:_\{?\w+\}?)?=")
_SHORT_FRAC = re.compile(r"\\frac(\d|\{[^{}]*\})(\d|\{[^{}]*\})")
_SHORT_SQRT = re.compile(r"\\sqrt(\w)")
_INT_SLASH = re.compile(r"^(-?\d+)/(\d+)$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def _brace(arg: str) -> str:
    return arg if arg.startswith("{") else "{" + arg + "}"


def normalize_answer(answer: str) -> str:
    """A canonical string for comparing math answers (no sympy; cheap and safe on any input).

    Drops `\\left` / `\\right`, spacing commands, degrees, `$`, percent signs, a trailing unit
    (`5\\text{ cm}`, `5 cm`), a leading `x =`, all spaces and a trailing "."; unwraps `\\text{..}`;
    writes `\\dfrac` / `\\tfrac` as `\\frac`, `\\frac12` as `\\frac{1}{2}`, `\\sqrt2` as
    `\\sqrt{2}`, `a/b` of integers as `\\frac{a}{b}`, ".5" as "0.5", and removes thousands
    commas ("1,000" and "1{,}000" -> "1000").
    """
    s = answer.strip().replace("\n", " ")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    s = _LEFT_RIGHT.sub("", s)
    for token in _REMOVE:
        s = s.replace(token, "")
    s = s.replace("\\ ", " ").strip()
    stripped = _TRAILING_TEXT_UNIT.sub("", s).strip()
    s = stripped or s
    s = _TEXT.sub(lambda m: m.group(1), s)
    s = _WORD_UNITS.sub(lambda m: m.group(1), s.strip())
    s = s.replace(" ", "").rstrip(".")
    if s.count("=") == 1 and _LHS.match(s):
        s = s.split("=", 1)[1]
    s = _SHORT_FRAC.sub(lambda m: "\\frac" + _brace(m.group(1)) + _brace(m.group(2)), s)
    s = _SHORT_SQRT.sub(lambda m: "\\sqrt{" + m.group(1) + "}", s)
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    s = _INT_SLASH.sub(lambda m: "\\frac{" + m.group(1) + "}{" + m.group(2) + "}", s)
    if s.startswith("."):
        s = "0" + s
    elif s.startswith("-."):
        s = "-0" + s[1:]
    return s


_FRAC_NUMBER = re.compile(r"^(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}$")


def answer_value(normalized: str) -> Optional[Fraction]:
    """The exact value of a normalised answer that is a plain number or `\\frac` of numbers."""
    m = _FRAC_NUMBER.match(normalized)
    if m:
        num, den = Fraction(m.group(2)), Fraction(m.group(3))
        if den == 0:
            return None
        return -num / den if m.group(1) else num / den
    if re.fullmatch(r"-?\d+(?:\.\d+)?", normalized):
        return Fraction(normalized)
    return None


def quick_equal(pred: str, gt: str) -> Optional[bool]:
    """True / False when string normalisation or exact numbers decide, None when they cannot."""
    a, b = normalize_answer(pred), normalize_answer(gt)
    if a == b:
        return True
    va, vb = answer_value(a), answer_value(b)
    if va is not None and vb is not None:
        return va == vb
    return None


# ---------------------------------------------------------------------------- symbolic check

_FUNCTIONS = ("sqrt", "log", "ln", "exp", "sin", "cos", "tan", "cot", "sec", "csc", "pi", "oo")
_SAFE_EXPR = re.compile(r"^[0-9a-zA-Z+\-*/()., ]*$")


def _replace_command(s: str, command: str, arity: int, build: Callable[..., str]) -> str:
    """Rewrites every `\\command{a}{b}` (innermost first) as `build(a, b)`."""
    while True:
        i = s.rfind(command + "{")
        if i < 0:
            return s
        args, j = [], i + len(command)
        for _ in range(arity):
            if j >= len(s) or s[j] != "{":
                raise ValueError(f"malformed {command}")
            end = _closing_brace(s, j)
            if end < 0:
                raise ValueError(f"unclosed {command}")
            args.append(s[j + 1 : end])
            j = end + 1
        s = s[:i] + build(*args) + s[j:]


def _letters(name: str) -> str:
    return name if name in _FUNCTIONS else "*".join(name)


def latex_to_sympy(latex: str):
    """A sympy expression for a normalised LaTeX answer (fractions, roots, powers, pi, common
    functions, implicit products; `i` is the imaginary unit, `e` Euler's number).

    Raises ValueError for anything else; the parser only ever sees a whitelisted alphabet and
    whitelisted names, so model output cannot run code here.
    """
    import sympy
    from sympy.parsing import sympy_parser as sp

    s = normalize_answer(latex)
    s = re.sub(r"\\sqrt\[([^\]]*)\]\{", r"\\root{\1}{", s)
    s = _replace_command(s, "\\frac", 2, lambda a, b: f"(({a})/({b}))")
    s = _replace_command(s, "\\root", 2, lambda n, a: f"(({a})**(1/({n})))")
    s = _replace_command(s, "\\sqrt", 1, lambda a: f" sqrt({a})")
    for src, dst in (("\\cdot", "*"), ("\\times", "*"), ("\\div", "/"), ("\\infty", "oo")):
        s = s.replace(src, dst)
    s = re.sub(r"\\(" + "|".join(_FUNCTIONS) + r")(?![a-zA-Z])", r" \1 ", s)
    s = s.replace("{", "(").replace("}", ")").replace("^", "**")
    if not _SAFE_EXPR.match(s) or re.search(r"\.(?!\d)", s):
        raise ValueError(f"unsupported characters in {latex!r}")
    # Only whitelisted names reach the parser: any other run of letters is a product ("xy").
    s = re.sub(r"[a-zA-Z]+", lambda m: _letters(m.group(0)), s)
    transformations = sp.standard_transformations + (sp.implicit_multiplication_application,)
    local = {"e": sympy.E, "i": sympy.I, "pi": sympy.pi, "oo": sympy.oo, "ln": sympy.log}
    return sp.parse_expr(s, local_dict=local, transformations=transformations, evaluate=True)


def _split_top_level(s: str) -> list[str]:
    """Splits on commas outside any brackets."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    return parts + [s[start:]]


def _tuple_parts(s: str):
    """(open, close, items) for "(a,b)" / "[a,b)" / "\\{a,b\\}" / "a,b"; None for one item."""
    for opener, closer in (("\\{", "\\}"),) + tuple((o, c) for o in "([" for c in ")]"):
        if s.startswith(opener) and s.endswith(closer):
            items = _split_top_level(s[len(opener) : len(s) - len(closer)])
            if len(items) > 1:
                return opener, closer, items
    items = _split_top_level(s)
    return ("", "", items) if len(items) > 1 else None


def _expr_equal(a: str, b: str) -> bool:
    import sympy

    if a.count("=") == 1 and b.count("=") == 1:  # equations: compare lhs - rhs up to a factor
        (la, ra), (lb, rb) = a.split("="), b.split("=")
        da = latex_to_sympy(la) - latex_to_sympy(ra)
        db = latex_to_sympy(lb) - latex_to_sympy(rb)
        if db == 0:
            return da == 0
        ratio = sympy.simplify(da / db)
        return bool(ratio.is_number and ratio != 0)
    x, y = latex_to_sympy(a), latex_to_sympy(b)
    diff = sympy.simplify(x - y)
    if diff == 0:
        return True
    if diff.is_number:
        value = complex(sympy.N(diff))
        scale = max(1.0, abs(complex(sympy.N(y))))
        return abs(value) <= 1e-9 * scale
    return False


def sympy_equal(pred: str, gt: str) -> bool:
    """Symbolic equality of two LaTeX answers with sympy (tuples and intervals item by item, the
    same brackets required; equations up to a nonzero factor). Exceptions mean "not equal"."""
    if quick_equal(pred, gt):
        return True
    a, b = normalize_answer(pred), normalize_answer(gt)
    ta, tb = _tuple_parts(a), _tuple_parts(b)
    if ta is not None or tb is not None:
        if ta is None or tb is None or ta[:2] != tb[:2] or len(ta[2]) != len(tb[2]):
            return False
        if ta[0] == "\\{":  # sets: any order
            left = list(tb[2])
            for item in ta[2]:
                match = next((k for k, other in enumerate(left) if sympy_equal(item, other)), None)
                if match is None:
                    return False
                left.pop(match)
            return True
        return all(sympy_equal(x, y) for x, y in zip(ta[2], tb[2]))
    try:
        return _expr_equal(a, b)
    except Exception:  # a parse or sympy error on model output: not equal
        return False


def math_verify_equal(pred: str, gt: str) -> bool:
    """Equality through `math_verify` (the gold first); both are wrapped as boxed answers."""
    from math_verify import parse, verify

    gold = parse("\\boxed{" + gt + "}", parsing_timeout=None)
    answer = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    return bool(verify(gold, answer, timeout_seconds=None))


def has_math_verify() -> bool:
    try:
        importlib.import_module("math_verify")
    except ImportError:
        return False
    return True


BACKENDS = {"sympy": sympy_equal, "math_verify": math_verify_equal}


def resolve_backend(backend: str) -> str:
    """ "auto" -> "math_verify" when installed, else "sympy"; checks the name."""
    if backend == "auto":
        return "math_verify" if has_math_verify() else "sympy"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of auto, {', '.join(BACKENDS)}.")
    if backend == "math_verify" and not has_math_verify():
        raise ValueError(
            "backend='math_verify' but math_verify is not installed: "
            "pip install math-verify, or use backend='sympy'."
        )
    return backend


def import_path(path: str, what: str = "function"):
    """The object at "package.module:name" (the module imported from `sys.path`: the current
    directory and PYTHONPATH) or at "path/to/file.py:name" (the file loaded from its path,
    relative to the current directory); a one-line ValueError when it cannot be found."""
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"{what} path {path!r} must look like 'package.module:function' or "
            "'path/to/file.py:function'."
        )
    is_file = module_name.endswith(".py")
    if is_file and not os.path.isfile(module_name):
        raise ValueError(
            f"{what} file {module_name!r} of {path!r} does not exist (a relative path starts at "
            f"the current directory, {os.getcwd()}); check the path."
        )
    try:
        module = _import_file(module_name) if is_file else importlib.import_module(module_name)
    except Exception as e:
        raise ValueError(
            f"cannot import module {module_name!r} of {what} {path!r}: {type(e).__name__}: {e}; "
            "check the name and that it is on PYTHONPATH (or give 'path/to/file.py:function')."
        ) from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} ({what} {path!r}).")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} {path!r} is a {type(obj).__name__}, not callable.")
    return obj


def _import_file(file_path: str):
    """The module of the Python file `file_path`, run once per process (kept in sys.modules
    under a name made from its absolute path)."""
    full = os.path.abspath(file_path)
    name = "jrl_user_" + "".join(c if c.isalnum() else "_" for c in full)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, full)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


# ------------------------------------------------------------------- time-limited worker pool

# A worker is a fresh `python -c` process (not a multiprocessing child, so the parent's __main__
# is never re-run); it reads JSON lines [pred, gt] on stdin and writes one JSON line per answer.
# It loads this file alone (registered under its module name, so `import_path` finds it) rather
# than `import jrl.rewards.math`, which would import the package and JAX with it.
_WORKER_CODE = (
    "import importlib.util, sys; "
    "spec = importlib.util.spec_from_file_location(sys.argv[2], sys.argv[3]); "
    "module = sys.modules[sys.argv[2]] = importlib.util.module_from_spec(spec); "
    "spec.loader.exec_module(module); module.serve_worker(sys.argv[1])"
)


def serve_worker(equal_fn: str) -> None:
    """Worker loop: resolve `equal_fn`, say ready, then answer each [pred, gt] line with
    ["ok", bool] (or ["error", false] when the check raised) until stdin closes."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr  # stray prints must not corrupt the protocol
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    def send(message) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    try:
        fn = import_path(equal_fn, "equality function")
    except ValueError as e:
        send(["failed", str(e)])
        return
    if fn in (sympy_equal, math_verify_equal):  # import the backend before saying ready
        fn("x", "2x")
    send(["ready", None])
    for line in sys.stdin:
        pred, gt = json.loads(line)
        try:
            send(["ok", bool(fn(pred, gt))])
        except Exception:
            send(["error", False])


class _Worker:
    """One worker process; `index` / `deadline` describe the answer it is checking."""

    def __init__(self, equal_fn: str, startup_s: float):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CODE, equal_fn, __name__, os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        self.ready, self.index = False, None
        self.deadline = time.monotonic() + startup_s

    def send(self, pair) -> None:
        self.proc.stdin.write(json.dumps(list(pair)) + "\n")
        self.proc.stdin.flush()

    def recv(self):
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError("worker exited")
        return json.loads(line)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(5)
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()


def _stop_workers(workers: list) -> None:
    for w in workers:
        w.kill()
    workers.clear()


class AnswerChecker:
    """Decides `pred == gt` for batches of math answers with a per-answer time limit.

    `quick_equal` decides in-process when it can; the rest go to up to `num_workers` worker
    processes (started on first need, then kept) that run the symbolic check. An answer not
    checked within `timeout_s` seconds counts as unequal, adds 1 to `stats["timeouts"]`, and its
    worker is killed and replaced; an exception in the check counts as unequal and adds 1 to
    `stats["errors"]`. Results are cached per (pred, gt) pair. Thread-safe.

    Args:
      backend: "auto" | "math_verify" | "sympy" (the symbolic check; see `resolve_backend`).
      timeout_s: time limit of one answer's symbolic check, seconds.
      num_workers: most worker processes.
      equal_fn: "package.module:function", `(pred, gt) -> bool`, replacing the backend's check;
        it must be importable in a fresh Python process (the parent's sys.path is passed on).
      startup_s: time limit for a worker to start and import its check (not counted in
        `timeout_s`).
      cache_size: most (pred, gt) results kept.
    """

    def __init__(
        self,
        *,
        backend: str = "auto",
        timeout_s: float = 5.0,
        num_workers: int = 2,
        equal_fn: Optional[str] = None,
        startup_s: float = 120.0,
        cache_size: int = 100_000,
    ):
        if timeout_s <= 0 or num_workers < 1:
            raise ValueError(
                f"timeout_s={timeout_s} must be > 0 and num_workers={num_workers} >= 1."
            )
        self.backend = resolve_backend(backend)
        self.equal_fn = equal_fn or f"{__name__}:{BACKENDS[self.backend].__name__}"
        self.timeout_s, self.num_workers, self.startup_s = timeout_s, num_workers, startup_s
        self.stats = {"checked": 0, "symbolic": 0, "timeouts": 0, "errors": 0}
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_size = cache_size
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        weakref.finalize(self, _stop_workers, self._workers)

    def close(self) -> None:
        """Stops the worker processes (new ones start when a check needs them)."""
        with self._lock:
            _stop_workers(self._workers)

    def start(self) -> None:
        """Starts all workers now and waits until they are ready (else done on first need)."""
        with self._lock:
            self._spawn(self.num_workers)
            self._run([])

    def equal(self, preds: Sequence[str], gts: Sequence[str]) -> list[bool]:
        """[N] answers and [N] reference answers -> [N] bools."""
        if len(preds) != len(gts):
            raise ValueError(f"{len(preds)} answers for {len(gts)} reference answers.")
        with self._lock:
            out, todo = [], {}
            for i, pair in enumerate(zip(preds, gts)):
                decided = self._cache.get(pair)
                if decided is None:
                    decided = quick_equal(*pair)
                if decided is None:
                    todo.setdefault(pair, []).append(i)
                out.append(decided)
            self.stats["checked"] += len(out)
            self.stats["symbolic"] += len(todo)
            pairs = list(todo)
            for pair, result in zip(pairs, self._run(pairs)):
                self._cache[pair] = result
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
                for i in todo[pair]:
                    out[i] = result
        return out

    def _spawn(self, count: int) -> None:
        while len(self._workers) < count:
            self._workers.append(_Worker(self.equal_fn, self.startup_s))

    def _run(self, pairs: list) -> list[bool]:
        """Checks `pairs` on the workers, one answer per worker at a time, with deadlines."""
        try:
            return self._schedule(pairs)
        except BaseException:  # workers may hold answers of this call: never reuse them
            _stop_workers(self._workers)
            raise

    def _schedule(self, pairs: list) -> list[bool]:
        results = [False] * len(pairs)
        pending = collections.deque(range(len(pairs)))
        self._spawn(min(self.num_workers, len(pairs)))
        while True:
            for w in self._workers:
                if w.ready and w.index is None and pending:
                    w.index = pending.popleft()
                    w.send(pairs[w.index])
                    w.deadline = time.monotonic() + self.timeout_s
            waiting = [w for w in self._workers if not w.ready or w.index is not None]
            if not waiting:
                return results
            timeout = max(0.0, min(w.deadline for w in waiting) - time.monotonic())
            readable = multiprocessing.connection.wait([w.proc.stdout for w in waiting], timeout)
            for w in waiting:
                if w.proc.stdout in readable:
                    self._receive(w, results, bool(pending))
                elif time.monotonic() >= w.deadline:
                    self._expire(w, results)

    def _receive(self, w: _Worker, results: list, more: bool) -> None:
        try:
            status, value = w.recv()
        except (EOFError, OSError, ValueError):  # the worker died (e.g. out of memory)
            status, value = "died", False
        if status == "failed":  # equal_fn does not import: a set-up error, not a model error
            self._replace(w, restart=False)
            raise ValueError(value)
        if status == "ready":
            w.ready = True
            return
        if status == "died" and not w.ready:
            self._replace(w, restart=False)
            raise RuntimeError(
                f"an answer-checking worker exited while starting (`{sys.executable} -c "
                f"{_WORKER_CODE!r}`): see its error output above."
            )
        if w.index is not None:
            results[w.index] = status == "ok" and bool(value)
            self.stats["errors"] += status != "ok"
        w.index = None
        if status == "died":
            self._replace(w, restart=more)

    def _expire(self, w: _Worker, results: list) -> None:
        if not w.ready:
            self._replace(w, restart=False)
            raise RuntimeError(
                f"an answer-checking worker did not start within {self.startup_s}s: raise "
                "startup_s, or check that this machine can start Python processes."
            )
        results[w.index] = False
        self.stats["timeouts"] += 1
        self._replace(w, restart=True)

    def _replace(self, w: _Worker, restart: bool) -> None:
        w.kill()
        if w in self._workers:
            self._workers.remove(w)
        if restart:
            self._workers.append(_Worker(self.equal_fn, self.startup_s))


# ------------------------------------------------------------------------------- score functions


class Gsm8kScore:
    """`(responses, ground_truths) -> scores`: 1.0 when the response's final number equals the
    ground truth's (see the module docstring), `format_score` when it states a different number,
    0.0 when it states none. `fallback`: "last_number" | "none" (only `####` answers count)."""

    def __init__(self, *, fallback: str = "last_number", format_score: float = 0.0):
        if fallback not in GSM8K_FALLBACKS:
            raise ValueError(f"fallback={fallback!r}: use one of {', '.join(GSM8K_FALLBACKS)}.")
        self.fallback, self.format_score = fallback, float(format_score)

    def score(self, response: str, ground_truth: str) -> float:
        pred = extract_gsm8k_answer(response, self.fallback)
        if pred is None:
            return 0.0
        gold = extract_gsm8k_answer(str(ground_truth), "last_number")
        a, b = parse_number(pred), None if gold is None else parse_number(gold)
        return 1.0 if a is not None and a == b else self.format_score

    def __call__(self, responses: Sequence[str], ground_truths: Sequence[str]) -> list[float]:
        return [self.score(r, g) for r, g in zip(responses, ground_truths)]


class MathScore:
    """`(responses, ground_truths) -> scores`: 1.0 when the last boxed answer of the response
    equals the ground truth's answer, `format_score` when it is boxed but different, 0.0 when
    the response has no boxed answer. Checker options: see `AnswerChecker`."""

    def __init__(
        self,
        *,
        format_score: float = 0.0,
        checker: Optional[AnswerChecker] = None,
        **checker_options,
    ):
        self.format_score = float(format_score)
        self.checker = checker or AnswerChecker(**checker_options)

    @property
    def stats(self) -> dict:
        return self.checker.stats

    def __call__(self, responses: Sequence[str], ground_truths: Sequence[str]) -> list[float]:
        preds = [last_boxed(r) for r in responses]
        found = [i for i, p in enumerate(preds) if p is not None]
        equal = self.checker.equal(
            [preds[i] for i in found], [ground_truth_answer(str(ground_truths[i])) for i in found]
        )
        scores = [0.0] * len(preds)
        for i, ok in zip(found, equal):
            scores[i] = 1.0 if ok else self.format_score
        return scores


FORMAT_STYLES = ("gsm8k", "boxed")


def has_answer(response: str, style: str) -> bool:
    """Whether `response` states a final answer: "gsm8k": `####` then a number; "boxed": a
    closed `\\boxed{...}` / `\\fbox{...}` (or `\\boxed x`)."""
    if style == "gsm8k":
        return "####" in response and extract_gsm8k_answer(response, "none") is not None
    if style == "boxed":
        return last_boxed(response) is not None
    raise ValueError(f"style={style!r}: use one of {', '.join(FORMAT_STYLES)}.")


class FormatScore:
    """`(responses, ground_truths) -> scores`: 1.0 when the response states a final answer in
    `style` ("gsm8k" | "boxed", see `has_answer`), else 0.0; the ground truths are unused."""

    def __init__(self, *, style: str = "boxed"):
        if style not in FORMAT_STYLES:
            raise ValueError(f"style={style!r}: use one of {', '.join(FORMAT_STYLES)}.")
        self.style = style

    def __call__(self, responses: Sequence[str], ground_truths: Sequence[str]) -> list[float]:
        return [float(has_answer(r, self.style)) for r in responses]
