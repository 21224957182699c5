"""The built-in `calc` tool: exact arithmetic on + - * / ( ), integers and decimals.

A small recursive-descent parser over `fractions.Fraction` (never Python's `eval`): the grammar is

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := ("+" | "-") factor | number | "(" expr ")"
    number := digits ["." digits] | "." digits

with spaces ignored. Results are exact: an integer prints as one (`12*34` -> `408`), anything else
as a decimal rounded to `DECIMALS` places with trailing zeros dropped (`1/3` -> `0.33333333`,
`7/2` -> `3.5`). A bad expression raises `ValueError` with a one-line reason (the tool host turns
it into an error message for the model): division by zero, an unknown character, an unbalanced
parenthesis, an expression too long, a number (written, intermediate or the result) with more
than MAX_RESULT_DIGITS integer digits.
"""

from __future__ import annotations

from fractions import Fraction

DECIMALS = 8  # places of a non-integer result
MAX_EXPRESSION_CHARS = 256  # longer expressions are refused
MAX_RESULT_DIGITS = 100  # numbers with more integer digits are refused (results, operands)
MAX_DEPTH = 64  # nested parentheses / signs


def _tokens(expression: str) -> list[str]:
    """Numbers, operators and parentheses of `expression`, spaces dropped."""
    out, i, text = [], 0, expression
    while i < len(text):
        ch = text[i]
        if ch.isspace():
            i += 1
        elif ch in "+-*/()":
            out.append(ch)
            i += 1
        elif ch.isdigit() or ch == ".":
            j = i
            while j < len(text) and (text[j].isdigit() or text[j] == "."):
                j += 1
            number = text[i:j]
            if number.count(".") > 1 or number == ".":
                raise ValueError(f"bad number {number!r}")
            out.append(number)
            i = j
        else:
            raise ValueError(f"unexpected character {ch!r} (use digits, + - * / and parentheses)")
    return out


class _Parser:
    def __init__(self, tokens: list[str]):
        self.tokens, self.i = tokens, 0

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ValueError("incomplete expression")
        self.i += 1
        return token

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            value = value + self.term(depth) if self.take() == "+" else value - self.term(depth)
            _check_size(value)
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op, rhs = self.take(), self.factor(depth)
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                raise ValueError("division by zero")
            else:
                value = value / rhs
            _check_size(value)
        return value

    def factor(self, depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise ValueError(f"nested more than {MAX_DEPTH} deep")
        token = self.take()
        if token in ("+", "-"):
            value = self.factor(depth + 1)
            return value if token == "+" else -value
        if token == "(":
            value = self.expr(depth + 1)
            if self.peek() != ")":
                raise ValueError("missing ')'")
            self.take()
            return value
        if token in ("*", "/", ")"):
            raise ValueError(f"unexpected {token!r}")
        return _check_size(Fraction(token))


def _check_size(value: Fraction) -> Fraction:
    """`value`, or ValueError when its integer part has more than MAX_RESULT_DIGITS digits (a
    number written in the expression, an intermediate result or the result)."""
    if abs(value) >= 10**MAX_RESULT_DIGITS:
        raise ValueError(f"result has more than {MAX_RESULT_DIGITS} digits")
    return value


def evaluate(expression: str) -> Fraction:
    """The exact value of `expression`; ValueError with a one-line reason when it is not one."""
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tokens = _tokens(expression)
    if not tokens:
        raise ValueError("empty expression")
    parser = _Parser(tokens)
    value = parser.expr(0)
    if parser.peek() is not None:
        raise ValueError(f"unexpected {parser.peek()!r}")
    return value


def format_number(value: Fraction) -> str:
    """An integer as digits, anything else rounded half-even to DECIMALS places, zeros dropped."""
    if value.denominator == 1:
        return str(value.numerator)
    scaled = round(value * 10**DECIMALS)  # Fraction.__round__: exact, half to even
    sign = "-" if scaled < 0 else ""
    whole, frac = divmod(abs(scaled), 10**DECIMALS)
    frac_text = str(frac).rjust(DECIMALS, "0").rstrip("0")
    return f"{sign}{whole}.{frac_text}" if frac_text else f"{sign}{whole}"


def calc(expression: str) -> str:
    """Evaluates an arithmetic expression exactly: + - * / ( ), integers and decimals."""
    return format_number(evaluate(expression))


CALC_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": (
            "Evaluate an arithmetic expression exactly: + - * / and parentheses over integers "
            "and decimals, e.g. '12*34' or '(1.5+2)/7'."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "the expression to evaluate"}
            },
            "required": ["expression"],
        },
    },
}
